"""Case 3: one of four hosts goes away mid-run; the other three converge, the summary and the exit code name it,
and `p40fleet run --retry-failed` finishes it once it is back.

`p40fleet run` takes four fresh hosts (node12-node15) through preflight and the CUDA toolkit, which installs the
one package its installer needs itself (the prerequisites stage would add four hosts' apt transactions and nothing
to the case; so would gcc-11, which their host_vars leave out: conftest.py's NO_HOST_COMPILER).
host_trap.py, armed on node15, freezes the CUDA installer once part of the toolkit is on disk; then node15's
container is stopped at once (an outage: no shutdown, the installer dies unfinished). Its SSH connection drops,
so node15 is unreachable for the rest of the run while the other three carry on. node15 is started again (on
another address, which the inventory follows), and `--retry-failed` runs it alone: its half-installed toolkit is
redone, never taken for installed.
(test_operations.py proves the summary, report and --retry-failed for a host that was down before the run.)
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from tests.faults.tools import BIN, HostTrap
from tests.pins import CUDA_HOME

from p40fleet import cli
from p40fleet_dev.paths import REPO_ROOT

pytestmark = [pytest.mark.sandbox, pytest.mark.fault_case(3)]

HOSTS = ("node12", "node13", "node14", "node15")
GONE = "node15"
CUDA = CUDA_HOME
MARKER = "/var/lib/p40fleet/cuda_toolkit-cuda-11.8.installing"
TAGS = "gpu_preflight,cuda_toolkit"


def p40fleet_run(fleet, log, report, *extra: str) -> subprocess.Popen:
    argv = [str(BIN / "p40fleet"), "run", "-i", str(fleet.inventory), "-t", TAGS, "--report", str(report)]
    argv += ["--become-password-file", str(fleet.password_file), *extra]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def test_a_host_gone_mid_run_is_named_and_finished_by_retry_failed(fleet, tmp_path):
    sandbox = fleet.sandbox
    trap = HostTrap(sandbox, GONE, "case3")
    trap.arm(
        pattern=r"cuda_11\.8\.0_520\.61\.05_linux\.run --silent",
        until=f"{CUDA}/bin/nvcc",
        unless=f"{CUDA}/version.json",
        step=0.0002,
        action="freeze",
    )
    log, report = tmp_path / "first.log", tmp_path / "first.json"
    run = p40fleet_run(fleet, log, report, "-l", ",".join(HOSTS))
    powered_off = False
    try:
        try:
            caught = trap.wait(run)
            assert "error" not in caught and not caught["overshot"], caught  # caught midway, not after the end
            sandbox.power_off(GONE)
            powered_off = True
            code = run.wait(timeout=1800)
        finally:
            if run.poll() is None:
                run.kill()
            if not powered_off:
                sandbox.power_off(GONE)  # the trap's frozen task goes with it
        output = log.read_text()
        assert code == cli.EXIT_HOSTS_UNREACHABLE, output[-4000:]
        first = json.loads(report.read_text())["runs"][-1]
        states = {host: entry["state"] for host, entry in first["hosts"].items()}
        assert states == {"node12": "changed", "node13": "changed", "node14": "changed", GONE: "unreachable"}
        assert any(line.startswith(f"  {GONE}: unreachable ok=") for line in output.splitlines()), output[-3000:]
        for host in HOSTS[:3]:
            assert fleet.exists(host, f"{CUDA}/version.json") and not fleet.exists(host, MARKER), host
    finally:
        # Back on whatever failed above: the fault suite's later tests run on the whole fleet.
        back = sandbox.power_on(GONE)
    assert back.address
    # Back from the outage: the toolkit it was installing is half there, and its marker says so.
    assert fleet.exists(GONE, f"{CUDA}/bin/nvcc") and not fleet.exists(GONE, f"{CUDA}/version.json")
    assert fleet.exists(GONE, MARKER)

    log, report = tmp_path / "retry.log", tmp_path / "retry.json"
    retry = p40fleet_run(fleet, log, report, "--retry-failed")
    code = retry.wait(timeout=1800)
    output = log.read_text()
    assert code == cli.EXIT_OK, output[-4000:]
    retried = json.loads(report.read_text())["runs"][-1]
    assert (retried["limit"], sorted(retried["hosts"])) == (GONE, [GONE])
    assert retried["hosts"][GONE]["state"] == "changed"
    assert fleet.exists(GONE, f"{CUDA}/version.json") and not fleet.exists(GONE, MARKER)

    # Finished: a run of all four changes nothing.
    log, report = tmp_path / "again.log", tmp_path / "again.json"
    again = p40fleet_run(fleet, log, report, "-l", ",".join(HOSTS))
    assert again.wait(timeout=1800) == cli.EXIT_OK, log.read_text()[-4000:]
    settled = json.loads(report.read_text())["runs"][-1]
    assert {host: entry["state"] for host, entry in settled["hosts"].items()} == dict.fromkeys(HOSTS, "ok")

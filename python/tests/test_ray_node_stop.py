"""ray_cluster's node script (p40fleet-ray-node) as its unit stops: `ray start --block` gets one SIGTERM, never
two, whether systemd signals the unit's whole control group or the script alone. `ray start` is the stand-in
python/tests/fixtures/standins/ray/ray_start_block.py (it hangs on a second SIGTERM, as Ray 2.47.1 was seen to);
test_ray_cluster.py stops real Ray nodes on sandbox hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from p40fleet_dev.paths import REPO_ROOT

NODE_SCRIPT = REPO_ROOT / "roles" / "ray_cluster" / "files" / "p40fleet-ray-node"
RAY = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "ray" / "ray_start_block.py"
# The script's supervise() on the stand-in, its forward grace shortened (the script's own: 10 s) but, as there, longer
# than `ray start` takes to stop (the stand-in: 0.5 s; Ray's: docs/benchmarks-code.md).
HARNESS = """
import importlib.util, sys
from importlib.machinery import SourceFileLoader
# The script has no .py suffix: its loader named, as importlib's own way for such a file.
loader = SourceFileLoader("p40fleet_ray_node", sys.argv[1])
node = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
loader.exec_module(node)
node.FORWARD_GRACE = 2
sys.exit(node.supervise([sys.executable, sys.argv[2], sys.argv[3]]))
"""


def wait_for_line(path, line, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and line in path.read_text().splitlines():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path}: no {line!r} within {timeout} s")


@pytest.mark.parametrize("signalled", ["the unit's control group", "the script alone"])
def test_ray_start_gets_one_sigterm_and_the_script_exits_clean(tmp_path, signalled):
    record = tmp_path / "signals"
    script = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(NODE_SCRIPT), str(RAY), str(record)], start_new_session=True
    )
    try:
        wait_for_line(record, "ready")
        stopped = time.monotonic()
        if signalled == "the script alone":
            script.send_signal(signal.SIGTERM)
        else:
            os.killpg(script.pid, signal.SIGTERM)  # KillMode=control-group: every process of the unit
        code = script.wait(timeout=20)
        took = time.monotonic() - stopped
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    assert record.read_text().splitlines() == ["ready", "SIGTERM"]
    assert code == 0
    # The stand-in stops in 0.5 s, the signal passed on after the 2 s grace where the script alone was signalled, and
    # the script looks once a second: a few seconds, where a hang would run into the 20 s above.
    assert took < 8, took

"""cuda_toolkit on sandbox hosts with the stand-in runfile: what the role promises.

node1 starts with no CUDA at all; node2 starts with another toolkit (/usr/local/cuda-12.2) that
/usr/local/cuda points at. The stand-in installer re-points /usr/local/cuda as soon as it starts, so
the role's record-and-restore logic really runs. Tests run in order on one converged fleet.
"""

from __future__ import annotations

import base64
import hashlib
import shlex

import pytest
import yaml

from p40fleet_dev.sandbox import Sandbox
from tests.host_state import exists, sh
from tests.pins import CUDA_HOME

# The modules of this group share the sandbox "cuda": one pytest-xdist worker runs them, in order.
pytestmark = [pytest.mark.sandbox, pytest.mark.xdist_group("cuda-sandbox")]

PLAYBOOK = "python/tests/playbooks/cuda_cudnn.yml"
HOSTS = ("node1", "node2")
HOME = CUDA_HOME
STAGING = "/var/tmp/p40fleet/cuda_toolkit.p40fleet"
RUNFILE = f"{STAGING}/cuda_11.8.0_520.61.05_linux.run"
MARKER = "/var/lib/p40fleet/cuda_toolkit-cuda-11.8.installing"
ENV_FILE = "/etc/p40fleet/cuda-11.8.sh"
LOG = "/var/log/cuda-installer.log"
KNOB = "/etc/p40fleet-sandbox/cuda-installer-fail"
OTHER = "/usr/local/cuda-12.2"
# `nvcc -V` of CUDA 11.8.0, as real 11.8 installs print it.
NVCC_11_8_BANNER = [
    "nvcc: NVIDIA (R) Cuda compiler driver",
    "Copyright (c) 2005-2022 NVIDIA Corporation",
    "Built on Wed_Sep_21_10:33:58_PDT_2022",
    "Cuda compilation tools, release 11.8, V11.8.89",
    "Build cuda_11.8.r11.8/compiler.31833905_0",
]
# Where /usr/local/cuda must point on each host after every run (None: absent).
DEFAULT_LINK = {"node1": None, "node2": OTHER}


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    sandbox = make_sandbox("cuda", ["p40", "p40"], login="sudo")
    # The fleet is shared with other modules: start from hosts without any CUDA state.
    for host in HOSTS:
        reset = sandbox.exec(
            host,
            "rm -rf /usr/local/cuda /usr/local/cuda-* /usr/local/cudnn-* /etc/p40fleet /var/lib/p40fleet"
            f" /var/tmp/p40fleet {LOG} {KNOB}",
        )
        assert reset.returncode == 0, reset.stderr
    # Another toolkit the role must not disturb: a tree and the system default link to it.
    prepared = sandbox.exec(
        "node2",
        f'mkdir -p {OTHER}/bin && echo \'{{"cuda": {{"version": "12.2.20230823"}}}}\' > {OTHER}/version.json'
        f" && ln -sfn {OTHER} /usr/local/cuda",
    )
    assert prepared.returncode == 0, prepared.stderr
    return sandbox


@pytest.fixture(scope="module")
def converge(fleet, run_playbook, tmp_path_factory):
    cache = tmp_path_factory.mktemp("controller-cache")

    def run(extra_vars: dict | None = None, **kwargs):
        # A private controller cache: the stand-in carries the real file name.
        variables = {"artifact_fetch_controller_cache_dir": str(cache), **(extra_vars or {})}
        kwargs.setdefault("tags", "cuda_toolkit")
        return run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=variables, **kwargs)

    return run


def sandbox_var(fleet: Sandbox, name: str) -> str:
    variables = yaml.safe_load((fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
    return str(variables[name])


def default_link(fleet: Sandbox, host: str) -> str | None:
    result = fleet.exec(host, "readlink /usr/local/cuda")
    if result.returncode == 0:
        return result.stdout.strip()
    assert not exists(fleet, host, "/usr/local/cuda"), f"{host}: /usr/local/cuda is not a link"
    return None


def assert_installed(fleet: Sandbox, host: str) -> None:
    assert '"version" : "11.8.20220929"' in sh(fleet, host, f"cat {HOME}/version.json")
    nvcc = sh(fleet, host, f". {ENV_FILE} && command -v nvcc && nvcc -V")
    assert nvcc.splitlines() == [f"{HOME}/bin/nvcc", *NVCC_11_8_BANNER]
    assert sh(fleet, host, f"readlink {HOME}/lib64/libcudart.so {HOME}/lib64/libcudart.so.11.0").split() == [
        "libcudart.so.11.0",
        "libcudart.so.11.8.89",
    ]
    assert not exists(fleet, host, MARKER)
    assert default_link(fleet, host) == DEFAULT_LINK[host]


def task_messages(result, task: str) -> dict[str, str]:
    """The msg each host's run of a task returned, read from the run's events."""
    return {
        e["event_data"]["host"]: str(e["event_data"]["res"].get("msg", ""))
        for e in result.events
        if e.get("event") == "runner_on_ok" and e["event_data"].get("task") == task
    }


def test_check_mode_on_fresh_hosts_reports_and_changes_nothing(fleet, converge):
    result = converge(check=True, diff=True)
    assert result.rc == 0, result.stdout
    planned = task_messages(result, "Report the installer run that check mode skips")
    assert planned == {
        host: f"{host}: would run sh {RUNFILE} --silent --toolkit --toolkitpath={HOME}"
        " --tmpdir=/var/tmp/p40fleet/cuda-installer.p40fleet --no-man-page --override"
        for host in HOSTS
    }
    for host in HOSTS:
        assert result.stats[host]["changed"] > 0
        for path in (HOME, ENV_FILE, MARKER, RUNFILE, "/var/tmp/p40fleet", LOG):
            assert not exists(fleet, host, path), f"{host}: check mode created {path}"
        assert default_link(fleet, host) == DEFAULT_LINK[host]


def test_fresh_install_is_complete_and_leaves_the_default_cuda_alone(fleet, converge):
    result = converge()
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert result.stats[host]["failures"] == 0
        assert_installed(fleet, host)
        # The installer ran unattended, toolkit only, with its temp dir off /tmp.
        arguments = sh(fleet, host, f"grep 'Arguments:' {LOG}")
        assert arguments.endswith(
            f"Arguments: --silent --toolkit --toolkitpath={HOME} "
            "--tmpdir=/var/tmp/p40fleet/cuda-installer.p40fleet --no-man-page --override"
        )
        # Runfile and extraction dir cleaned up; nothing registered system-wide.
        assert sh(fleet, host, "ls -A /var/tmp/p40fleet") == ""
        for path in ("/etc/profile.d/p40fleet-cuda-11.8.sh", "/etc/ld.so.conf.d/p40fleet-cuda-11.8.conf"):
            assert not exists(fleet, host, path)
        # nvcc 11.8 needs gcc <= 11: installed from Debian 12 and named in the env file.
        assert sh(fleet, host, "g++-11 --version").startswith("g++-11 (Debian 11.")
        assert "export CUDAHOSTCXX=/usr/bin/g++-11" in sh(fleet, host, f"cat {ENV_FILE}")
    assert sh(fleet, "node2", f"cat {OTHER}/version.json") == '{"cuda": {"version": "12.2.20230823"}}'


def test_converged_hosts_report_no_change_also_in_check_mode(converge):
    for kwargs in ({}, {"check": True, "diff": True}):
        result = converge(**kwargs)
        assert result.rc == 0, result.stdout
        assert {h: result.stats[h]["changed"] for h in HOSTS} == {"node1": 0, "node2": 0}, kwargs


def test_failed_and_killed_installs_name_the_log_and_are_redone(fleet, converge, run_playbook):
    # A half-finished tree from real state (no version.json), then an installer that fails again.
    sh(fleet, "node1", f"rm {HOME}/version.json && echo kill-midway > {KNOB}")
    sh(fleet, "node2", f"rm {HOME}/version.json && echo fail > {KNOB}")
    failed = converge()
    assert failed.rc != 0
    messages = {f.host: f.message for f in failed.failures}
    assert set(messages) == set(HOSTS)
    assert messages["node1"].startswith(
        f"node1: the CUDA 11.8 installer failed (exit -9) installing to {HOME}. Installer log: {LOG}."
    )
    assert "It was killed by signal 9." in messages["node1"]
    assert messages["node2"].startswith(
        f"node2: the CUDA 11.8 installer failed (exit 1) installing to {HOME}. Installer log: {LOG}."
    )
    assert "installation failed, as told by" in messages["node2"]
    for host in HOSTS:
        assert exists(fleet, host, f"{HOME}/bin/nvcc") and not exists(fleet, host, f"{HOME}/version.json")
        assert exists(fleet, host, MARKER)
        assert default_link(fleet, host) == DEFAULT_LINK[host]  # restored although the installer failed

    # The verify tag alone sees the unfinished install.
    verify = converge(tags="verify", skip_tags="host_prereqs,cudnn")
    assert verify.rc != 0
    assert sorted(f.host for f in verify.failures) == list(HOSTS)
    for failure in verify.failures:
        assert failure.message.startswith(
            f"{failure.host}: CUDA at {HOME} is not complete: version.json says nothing (missing),"
            " nvcc --version says release 11.8,"
        ), failure.message
        assert "unfinished-install marker present" in failure.message

    # As if Ansible itself had died before putting the link back: only the marker remembers node2's link.
    sh(fleet, "node2", f"ln -sfn {HOME} /usr/local/cuda")
    for host in HOSTS:
        sh(fleet, host, f"rm {KNOB}")
    redone = converge()
    assert redone.rc == 0, redone.stdout
    for host in HOSTS:
        assert redone.stats[host]["changed"] > 0
        assert_installed(fleet, host)


def test_tampered_runfile_fails_the_checksum_and_installs_nothing(fleet, converge):
    sh(fleet, "node1", f"rm -rf {HOME}")
    runs_before = sh(fleet, "node1", f"grep -c 'Arguments:' {LOG}")
    wrong = hashlib.sha256(b"a runfile someone tampered with").hexdigest()
    result = converge(extra_vars={"cuda_toolkit_runfile_sha256": wrong})
    assert result.rc != 0
    # The failed download is rescued into one message naming the host: the last failure event.
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1"}
    message = messages["node1"]
    assert message.startswith("node1: getting cuda_runfile through the controller cache"), message
    assert f"but the pin is {wrong}. Refused: nothing was kept at" in message, message
    assert result.stats["node2"]["changed"] == 0  # converged: nothing fetched, nothing checked against the pin
    assert not exists(fleet, "node1", HOME)
    assert not exists(fleet, "node1", MARKER)
    assert fleet.exec("node1", f"ls -A {STAGING} 2>/dev/null").stdout == ""
    assert sh(fleet, "node1", f"grep -c 'Arguments:' {LOG}") == runs_before


def test_runfile_swapped_after_its_download_is_refused_before_root_runs_it(fleet, converge):
    pinned = sandbox_var(fleet, "cuda_toolkit_runfile_sha256")
    swapped = b"#!/bin/sh\necho a runfile swapped in after the download was verified\n"
    sh(fleet, "node1", f"rm -rf {HOME}")
    runs_before = sh(fleet, "node1", f"grep -c 'Arguments:' {LOG}")
    # Between the download's verification and the installer: the in-progress marker is written then. The
    # swapper is root (the staging dir lets nobody else in); the real risk is an account that could write there.
    swapper = (
        f"for i in $(seq 1 6000); do if [ -e {MARKER} ]; then"
        f" echo {base64.b64encode(swapped).decode()} | base64 -d > {RUNFILE}.new && mv -f {RUNFILE}.new {RUNFILE};"
        " exit 0; fi; sleep 0.05; done"
    )
    sh(fleet, "node1", f"setsid sh -c {shlex.quote(swapper)} </dev/null >/dev/null 2>&1 &")
    result = converge()
    assert result.rc != 0
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1"}, messages
    message = messages["node1"]
    assert message.startswith(f"node1: refusing to run {RUNFILE}: it has sha256 {hashlib.sha256(swapped).hexdigest()}")
    assert f"the pinned sha256 is {pinned}" in message
    assert result.stats["node2"]["changed"] == 0
    # Refused before the installer ran: no new installer run, nothing installed.
    assert sh(fleet, "node1", f"grep -c 'Arguments:' {LOG}") == runs_before
    assert not exists(fleet, "node1", f"{HOME}/version.json")
    # The directory root runs the installer from is root's alone; the login user cannot even look in.
    assert sh(fleet, "node1", f"stat -c '%U %a' {STAGING}") == "root 700"
    assert fleet.exec("node1", f"touch {STAGING}/planted", user="ops").returncode != 0
    assert fleet.exec("node1", f"ls {STAGING}", user="ops").returncode != 0

    # The next run finds the wrong file, fetches the pinned one again and installs.
    redone = converge()
    assert redone.rc == 0, redone.stdout
    assert_installed(fleet, "node1")
    assert not exists(fleet, "node1", STAGING)


def test_a_staging_dir_another_account_owns_is_refused(fleet, converge):
    sh(fleet, "node1", f"rm -rf {HOME} && mkdir -p {STAGING} && chown ops {STAGING}")
    # node1 alone: node2, converged, would only add its pass (the tests above prove a converged bystander).
    result = converge(limit="node1")
    assert result.rc != 0
    message = {f.host: f.message for f in result.failures}["node1"]
    assert message.startswith(f"node1: root would run the CUDA installer from {STAGING}"), message
    assert f"{STAGING} is owned by uid " in message
    assert not exists(fleet, "node1", MARKER)
    sh(fleet, "node1", f"rm -rf {STAGING}")
    redone = converge(limit="node1")
    assert redone.rc == 0, redone.stdout
    assert_installed(fleet, "node1")
    assert default_link(fleet, "node1") is None


# The runfile is as strict as NVIDIA's: each case below breaks one thing through a role variable.
INSTALLER_ARGS = [
    "--silent",
    "--toolkit",
    f"--toolkitpath={HOME}",
    "--tmpdir=/var/tmp/p40fleet/cuda-installer.p40fleet",
    "--no-man-page",
    "--override",
]


def installer_runs(fleet: Sandbox, host: str) -> int:
    """How many installer runs got past the option check (each logs its arguments)."""
    return int(sh(fleet, host, f"grep -c 'Arguments:' {LOG} || true") or 0)


def installer_processes(fleet: Sandbox, host: str) -> str:
    # The bracket keeps this command's own command line from matching.
    return sh(fleet, host, "ps -eo pid,args | grep '[c]uda_11.8.0_520' || true")


def only_failure(result, host: str) -> str:
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {host}, result.stdout
    return messages[host]


def test_an_unknown_installer_flag_is_refused_and_installs_nothing(fleet, converge):
    sh(fleet, "node1", f"rm -rf {HOME}")
    runs_before = installer_runs(fleet, "node1")
    result = converge(extra_vars={"cuda_toolkit_installer_extra_args": ["--no-such-option"]}, limit="node1")
    assert result.rc != 0
    message = only_failure(result, "node1")
    assert message.startswith(
        f"node1: the CUDA 11.8 installer failed (exit 1) installing to {HOME}. Installer log: {LOG}."
    ), message
    assert "Arguments: " + " ".join([*INSTALLER_ARGS, "--no-such-option"]) + "." in message
    assert installer_runs(fleet, "node1") == runs_before
    assert not exists(fleet, "node1", HOME)
    assert default_link(fleet, "node1") is None


def test_an_installer_waiting_for_its_eula_is_stopped_by_the_timeout(fleet, converge):
    without_silent = [arg for arg in INSTALLER_ARGS if arg != "--silent"]
    result = converge(
        extra_vars={"cuda_toolkit_installer_args": without_silent, "cuda_toolkit_installer_timeout": 5},
        limit="node1",
    )
    assert result.rc != 0
    message = only_failure(result, "node1")
    assert message.startswith(
        f"node1: the CUDA 11.8 installer {RUNFILE} did not finish within 5 seconds and was stopped (exit 124)."
    ), message
    assert f"Arguments: {' '.join(without_silent)}. Installer log: {LOG}." in message
    assert installer_processes(fleet, "node1") == ""  # stopped on the host, not just abandoned
    assert not exists(fleet, "node1", f"{HOME}/version.json")
    assert default_link(fleet, "node1") is None


def test_an_installer_without_libxml2_exits_127_and_the_role_installs_it(fleet, converge):
    sh(fleet, "node1", "DEBIAN_FRONTEND=noninteractive apt-get remove -y -q libxml2 >/dev/null")
    assert sh(fleet, "node1", "/sbin/ldconfig -p | grep -c 'libxml2.so.2 ' || true") == "0"
    missing = converge(extra_vars={"cuda_toolkit_installer_packages": []}, limit="node1")
    assert missing.rc != 0
    message = only_failure(missing, "node1")
    assert message.startswith(f"node1: the CUDA 11.8 installer failed (exit 127) installing to {HOME}."), message
    assert "It could not start: a shared library it is linked against is missing" in message
    assert "libxml2.so.2: cannot open shared object file" in message
    assert default_link(fleet, "node1") is None

    # With the role's default list, libxml2 comes back from apt and the install completes.
    fixed = converge(limit="node1")
    assert fixed.rc == 0, fixed.stdout
    assert sh(fleet, "node1", "dpkg-query -W -f '${Status}' libxml2") == "install ok installed"
    assert_installed(fleet, "node1")

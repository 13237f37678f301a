"""Reads of files in the env owner's tree by root's probes, without hosts (docs/privileges.md): the conda probe's
marker and .condarc (roles/conda_env/tasks/probe.yml) and the Apex wheel check's wheel and build.log
(plugins/modules/apex_wheel_check.py). The owner can put a FIFO (which blocked `cat` and `open` for ever) or a link
to root's files in their place; each must be refused at once, never followed. (The state probe's own reads:
test_fleet_state.py.)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main

WHEEL_CHECK = load_module(REPO_ROOT / "plugins" / "modules" / "apex_wheel_check.py", "apex_wheel_check")


def conda_reader() -> str:
    """The conda probe's reader function, as the task's shell script defines it."""
    tasks = yaml.safe_load((REPO_ROOT / "roles" / "conda_env" / "tasks" / "probe.yml").read_text())
    (probe,) = [task for task in tasks if task.get("name") == "Probe Miniconda and the env on the host"]
    script = probe["ansible.builtin.shell"]["cmd"]
    return script[: script.index('echo "owner=')]


@pytest.fixture
def planted(tmp_path):
    """A regular file, a FIFO and a link to a file the owner may not read, side by side."""
    (tmp_path / "regular").write_text("abc\n")
    os.mkfifo(tmp_path / "fifo")
    secret = tmp_path / "secret"
    secret.write_text("root's\n")
    os.symlink(secret, tmp_path / "link")
    return tmp_path


def test_the_conda_probe_reads_regular_files_only_and_never_waits(planted):
    reader = conda_reader()
    lines = [f'echo "{name}=$(regular text {planted / name})"' for name in ("regular", "fifo", "link")]
    lines.append(f'echo "sha1=$(regular sha1 {planted / "regular"})"')
    done = subprocess.run(
        ["bash", "-c", reader + "\n".join(lines)], capture_output=True, text=True, timeout=30, check=True
    )
    digest = hashlib.sha1(b"abc\n").hexdigest()
    assert done.stdout.splitlines() == ["regular=abc", "fifo=", "link=", f"sha1={digest}"]


def wheel_check(wheel, log):
    """The module as Ansible runs it (AnsibleModule in this process): its result, `rc` its exit status."""
    return run_module_main(
        WHEEL_CHECK, {"wheel": str(wheel), "build_log": str(log), "modules": ["amp_C"], "host": "node1"}
    )


def test_the_wheel_check_refuses_a_fifo_or_a_link_for_the_wheel_or_its_log(planted):
    wheel = planted / "apex-0.1-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("amp_C.cpython-311-x86_64-linux-gnu.so", b"")
    (planted / "build.log").write_text("ninja ran\n")
    done = wheel_check(wheel, planted / "build.log")
    assert (done["rc"], done["missing"], done["built"], done["serial"]) == (0, [], ["amp_C"], False), done
    # A FIFO is opened without waiting and refused; a link is not opened at all (O_NOFOLLOW: ELOOP).
    for done in (wheel_check(wheel, planted / "fifo"), wheel_check(planted / "fifo", planted / "build.log")):
        assert done["rc"] == 1 and "node1: " in done["msg"] and "fifo is not a regular file: refused" in done["msg"]
    for done in (wheel_check(wheel, planted / "link"), wheel_check(planted / "link", planted / "build.log")):
        assert done["rc"] == 1 and "Too many levels of symbolic links" in done["msg"], done
    (planted / "build.log").write_text(
        "UserWarning: Attempted to use ninja as the BuildExtension backend but we could not find ninja.\n"
    )
    done = wheel_check(wheel, planted / "build.log")
    assert (done["rc"], done["serial"]) == (0, True), done

"""One run per inventory: a second `p40fleet run` against the same inventory is refused, naming the
one in progress; a run that was killed leaves no lock behind. Two real processes, a localhost play
(no containers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p40fleet import cli
from p40fleet.lock import RunLocked, inventory_lock
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT
from tests.local_hosts import local_inventory

WAIT_PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "local_wait.yml"
HOLD = """
import sys, time
from pathlib import Path
from p40fleet.lock import inventory_lock
with inventory_lock(Path(sys.argv[1]), Path(sys.argv[2]), command="holder for the test"):
    print("held", flush=True)
    time.sleep(600)
"""


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_a_second_run_is_refused_while_one_runs_and_a_killed_run_blocks_nothing(tmp_path, capsys):
    inventory = local_inventory(tmp_path)
    state = tmp_path / "state"
    release = tmp_path / "release"
    argv = ["run", "-i", str(inventory), "--state-dir", str(state), "--playbook", str(WAIT_PLAYBOOK)]
    first = subprocess.Popen(
        [sys.executable, "-m", "p40fleet.cli", *argv, "-e", f"p40fleet_test_release={release}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    lock = StateDir(state).inventory(inventory).lock_path
    try:
        # The first run holds the lock once it has written who it is.
        wait_for(lambda: lock.exists() and f'"pid": {first.pid}' in lock.read_text())
        wait_for(lambda: StateDir(state).inventory(inventory).runs() != [])
        assert cli.main([*argv, "-e", f"p40fleet_test_release={release}"]) == cli.EXIT_ERROR
        err = capsys.readouterr().err
        assert f"another p40fleet run against {inventory.resolve()} is in progress (pid {first.pid}, started 20" in err
        assert "cli.py run -i" in err and "wait for it to finish" in err
        assert len(StateDir(state).inventory(inventory).runs()) == 1  # the refused run started nothing

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        release.touch()  # lets the orphaned ansible-playbook of the killed run finish
        if first.poll() is None:
            first.kill()
    # The killed run's lock file is still there, with its pid; the kernel released the flock.
    assert f'"pid": {first.pid}' in lock.read_text()
    assert cli.main([*argv, "-e", f"p40fleet_test_release={release}"]) == cli.EXIT_OK


def test_the_lock_is_per_inventory_and_names_its_holder(tmp_path):
    lock_a = tmp_path / "a.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock_a), "/fleet/a.yml"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunLocked) as refused, inventory_lock(lock_a, Path("/fleet/a.yml")):
            pass
        assert refused.value.holder["pid"] == holder.pid
        assert refused.value.holder["command"] == "holder for the test"
        assert str(refused.value).startswith(
            f"another p40fleet run against /fleet/a.yml is in progress (pid {holder.pid}"
        )
        with inventory_lock(tmp_path / "b.lock", Path("/fleet/b.yml")) as mine:
            assert mine["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
    with inventory_lock(lock_a, Path("/fleet/a.yml")) as mine:
        assert mine["pid"] == os.getpid()


@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        (["p40fleet", "run", "-e", "hf_token=hf_SECRET", "-l", "node1"], "p40fleet run -e '<hidden>' -l node1"),
        (["p40fleet", "run", "-ehf_token=hf_SECRET"], "p40fleet run '-e<hidden>'"),
        (["p40fleet", "run", "--extra-vars", '{"t": "hf_SECRET"}'], "p40fleet run --extra-vars '<hidden>'"),
        (["p40fleet", "run", "--extra-vars=t=hf_SECRET"], "p40fleet run '--extra-vars=<hidden>'"),
        (
            ["p40fleet", "run", "--extra=t=hf_SECRET", "--ex", "t=hf_SECRET"],
            "p40fleet run '--extra=<hidden>' --ex '<hidden>'",
        ),
        (["p40fleet", "run", "-e", "@vault.yml", "-t", "apex"], "p40fleet run -e @vault.yml -t apex"),
    ],
)
def test_the_lock_records_no_extra_vars_value(tmp_path, argv, recorded, monkeypatch):
    # A regression: `p40fleet run -e token=...` left the token in the lock file's recorded command line.
    monkeypatch.setattr(sys, "argv", argv)
    with inventory_lock(tmp_path / "lock", tmp_path / "hosts.yml") as holder:
        assert holder["command"] == recorded
        text = (tmp_path / "lock").read_text()
    assert "hf_SECRET" not in text
    assert (tmp_path / "lock").stat().st_mode & 0o777 == 0o600

"""Ctrl-C during `p40fleet run` (no containers): a real p40fleet process and its real ansible-playbook against three
hosts of the controller itself. The run ends with its process group and its workers' (ansible's workers run in
sessions of their own), and the report keeps what the hosts did until then."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from p40fleet import fleet
from p40fleet.api import last_run_failed_hosts
from p40fleet.exit_codes import Exit
from p40fleet.run import _Interrupt, stats_from_events
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT

# h3 fails at once, h1 and h2 go on to a task that would outlast the test.
PLAYBOOK = """\
- hosts: all
  gather_facts: false
  tasks:
    - name: Start
      ansible.builtin.command: "true"
      changed_when: true
    - name: Fail h3
      ansible.builtin.fail:
        msg: h3 fails on purpose
      when: inventory_hostname == 'h3'
    - name: Outlast the test
      ansible.builtin.command: sleep 300
      changed_when: false
"""
INVENTORY = """\
all:
  hosts: {h1: {}, h2: {}, h3: {}}
  vars:
    ansible_connection: local
    ansible_python_interpreter: '{{ ansible_playbook_python }}'
"""


def stat(pid: int) -> tuple[int, str, str] | None:
    """(ppid, start time, name) of a live process, None once it has ended (a zombie has)."""
    try:
        name, rest = Path(f"/proc/{pid}/stat").read_text().split(" (", 1)[1].rsplit(")", 1)
    except (OSError, IndexError, ValueError):
        return None
    fields = rest.split()
    return None if fields[0] == "Z" else (int(fields[1]), fields[19], name)


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """Every live process under root, with its start time (so a reused pid is not taken for it) and name."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (seen := stat(int(entry.name))):
            parents[int(entry.name)] = seen
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, *_) in parents.items() if ppid in frontier and pid not in found}
        found.update({pid: parents[pid][1:] for pid in frontier})
    return found


def alive(processes: dict[int, tuple[str, str]]) -> list[str]:
    return [f"{pid} {name}" for pid, (started, name) in processes.items() if (now := stat(pid)) and now[1] == started]


def test_ctrl_c_ends_every_process_of_the_run_and_the_report_keeps_the_hosts(tmp_path):
    (tmp_path / "hosts.yml").write_text(INVENTORY)
    (tmp_path / "slow.yml").write_text(PLAYBOOK)
    report = tmp_path / "report.json"
    argv = ["run", "-i", "hosts.yml", "--playbook", "slow.yml", "--state-dir", "state", "--report", str(report)]
    # This checkout's p40fleet, whatever the environment's editable install points at.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python")}
    # Its own process group, as a shell's foreground job: Ctrl-C is SIGINT to that group.
    run = subprocess.Popen(
        [sys.executable, "-m", "p40fleet.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: dict[int, tuple[str, str]] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen.update(descendants(run.pid))
            sleeping = [pid for pid, (_, name) in seen.items() if name == "sleep"]
            if len(sleeping) >= 2 or run.poll() is not None:
                break
            time.sleep(0.2)
        assert run.poll() is None and len(sleeping) == 2, "the run did not reach its long task"
        seen.update(descendants(run.pid))
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    # ansible's workers end their commands before ansible-playbook ends; a moment for the kernel to reap them (on a
    # busy machine, seconds: a worker left running would hold its `sleep 300` for minutes).
    deadline = time.monotonic() + 20
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(seen), f"left running: {alive(seen)}"
    assert run.returncode == Exit.INTERRUPTED, err
    assert "exit 130: interrupted" in err

    entry = json.loads(report.read_text())["runs"][0]
    assert entry["status"] == "canceled" and entry["exit_code"] == Exit.INTERRUPTED
    hosts = entry["hosts"]
    assert {h: e["state"] for h, e in hosts.items()} == {"h1": "interrupted", "h2": "interrupted", "h3": "failed"}
    assert hosts["h1"]["stats"]["changed"] == 1 and hosts["h3"]["stats"]["failures"] == 1
    assert hosts["h3"]["failures"][0]["message"] == "h3 fails on purpose"
    # --retry-failed takes the interrupted hosts too.
    state = StateDir(tmp_path / "state")
    retried, _ = last_run_failed_hosts(state, (tmp_path / "hosts.yml").resolve())
    assert retried == ["h1", "h2", "h3"]
    # And `p40fleet report` says so, not "last run ok".
    records = fleet.host_records(state.inventory((tmp_path / "hosts.yml").resolve()).read_hosts())
    assert {r.host: r.status for r in records} == {"h1": "interrupted", "h2": "interrupted", "h3": "failed"}


def event(kind: str, host: str, **data) -> dict:
    return {"event": kind, "pid": 4242, "event_data": {"host": host, **data}}


def test_the_hosts_results_stand_for_the_recap_a_stopped_run_never_reached():
    events = [
        {"event": "playbook_on_start", "pid": 4242, "event_data": {}},
        event("runner_on_ok", "a", res={"changed": True}),
        event("runner_on_ok", "a", res={"changed": False}),
        event("runner_on_skipped", "a"),
        event("runner_on_failed", "b", res={}, ignore_errors=True),
        event("runner_on_failed", "b", res={}),
        event("runner_on_unreachable", "c", res={}),
        event("runner_on_start", "d"),
    ]
    stats = stats_from_events(events)
    assert set(stats) == {"a", "b", "c"}
    assert (stats["a"]["ok"], stats["a"]["changed"], stats["a"]["skipped"]) == (2, 1, 1)
    assert (stats["b"]["ok"], stats["b"]["ignored"], stats["b"]["failures"]) == (1, 1, 1)
    assert stats["c"]["unreachable"] == 1


def test_the_signal_is_passed_on_and_the_sigkill_waits_for_the_grace_period(monkeypatch):
    sent = []
    monkeypatch.setattr("p40fleet.run._is_our_child", lambda pid: True)
    monkeypatch.setattr(os, "kill", lambda pid, number: sent.append((pid, number)))
    interrupt = _Interrupt()
    assert not interrupt.cancel()
    interrupt.on_event({"event": "playbook_on_start", "pid": 4242})
    interrupt.on_signal(signal.SIGINT)
    assert sent == [(4242, signal.SIGINT)]
    # ansible-runner's SIGKILL of the group waits: ansible-playbook ends its workers first.
    assert not interrupt.cancel()
    assert sent == [(4242, signal.SIGINT)]
    # A second Ctrl-C: no more waiting.
    interrupt.on_signal(signal.SIGINT)
    assert interrupt.cancel() and sent == [(4242, signal.SIGINT)]


def test_a_signal_before_ansible_playbook_said_who_it_is_cancels_at_once(monkeypatch):
    monkeypatch.setattr(os, "kill", lambda pid, number: pytest_fail())
    interrupt = _Interrupt()
    interrupt.on_signal(signal.SIGTERM)
    assert interrupt.cancel()


def pytest_fail():
    raise AssertionError("nothing to signal yet")

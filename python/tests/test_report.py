"""The report and the exit codes, from results as ansible-runner hands them over."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from p40fleet import cli, report
from p40fleet.run import HostFailure, RunResult, _stats_from

RECAP = {
    "ok": {"node1": 12, "node2": 3, "node3": 1},
    "changed": {"node1": 4},
    "failures": {"node2": 1},
    "dark": {"node3": 1},
    "skipped": {"node1": 2},
    "processed": {"node1": 1, "node2": 1, "node3": 1},
}


def result_with(stats, failures=(), rc=2) -> RunResult:
    return RunResult(
        rc=rc,
        status="failed" if rc else "successful",
        stats=stats,
        failures=list(failures),
        stdout="",
        artifact_dir=Path("/tmp/none"),
    )


def test_recap_maps_dark_to_unreachable_and_fills_zeroes():
    stats = _stats_from(RECAP)
    assert stats["node3"]["unreachable"] == 1
    assert stats["node2"] == {
        "ok": 3,
        "changed": 0,
        "failures": 1,
        "unreachable": 0,
        "skipped": 0,
        "rescued": 0,
        "ignored": 0,
    }
    assert stats["node1"]["changed"] == 4


def test_exit_codes_rank_failure_over_unreachable():
    stats = _stats_from(RECAP)
    assert cli.exit_code_for(result_with(stats)) == cli.EXIT_HOSTS_FAILED
    del stats["node2"]
    assert cli.exit_code_for(result_with(stats)) == cli.EXIT_HOSTS_UNREACHABLE
    del stats["node3"]
    assert cli.exit_code_for(result_with(stats, rc=0)) == cli.EXIT_OK
    # ansible-playbook failing with no host to blame (a syntax error) is still a failure
    assert cli.exit_code_for(result_with({}, rc=4)) == cli.EXIT_HOSTS_FAILED


def test_report_names_each_failure_with_its_task(tmp_path):
    failure = HostFailure("node2", "Check the driver.", "gpu_preflight", "node2: driver 470.256.02 is too old")
    summary = report.build_report([("run", result_with(_stats_from(RECAP), [failure]))])
    hosts = summary["runs"][0]["hosts"]
    assert {h: e["state"] for h, e in hosts.items()} == {"node1": "changed", "node2": "failed", "node3": "unreachable"}
    assert hosts["node2"]["failures"] == [
        {
            "task": "Check the driver.",
            "role": "gpu_preflight",
            "message": "node2: driver 470.256.02 is too old",
            "unreachable": False,
        }
    ]
    path = tmp_path / "out" / "report.json"
    report.write_report(summary, path)
    assert json.loads(path.read_text())["schema"] == report.REPORT_SCHEMA

    console = Console(record=True, width=200)
    report.print_summary(console, summary)
    text = console.export_text()
    assert "node2" in text and "failed" in text and "driver 470.256.02 is too old" in text


def test_progress_prints_changes_and_failures_only():
    console = Console(record=True, width=200)
    progress = report.Progress(console, "first run")
    progress({"event": "runner_on_ok", "event_data": {"host": "node1", "task": "A", "res": {"changed": False}}})
    progress(
        {
            "event": "runner_on_ok",
            "event_data": {"host": "node1", "task": "B", "role": "cudnn", "res": {"changed": True}},
        }
    )
    progress({"event": "runner_on_failed", "event_data": {"host": "node2", "task": "C", "res": {"msg": "boom"}}})
    lines = console.export_text().splitlines()
    assert lines == ["  changed     node1      [cudnn] B", "  failed      node2      C: boom"]


def test_cli_refuses_unknown_profiles_without_touching_podman(capsys):
    assert cli.main(["sandbox", "up", "--name", "pytest-nothing", "--profiles", "p40,no-such-gpu"]) == cli.EXIT_ERROR

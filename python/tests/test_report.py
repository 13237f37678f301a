"""The report, the summary and the exit codes, from results as ansible-runner hands them over."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from p40fleet import api, cli, report
from p40fleet.run import HostFailure, RunResult, _stats_from, failure_from_event
from p40fleet_dev import cli as dev_cli

RECAP = {
    "ok": {"node1": 12, "node2": 3, "node3": 1},
    "changed": {"node1": 4},
    "failures": {"node2": 1},
    "dark": {"node3": 1},
    "skipped": {"node1": 2},
    "processed": {"node1": 1, "node2": 1, "node3": 1},
}
PREFLIGHT = (
    "gpu_preflight refused node2 (nothing was changed on it):\n"
    "- driver 470.256.02 is too old for CUDA 11.8; required: >= 520.61.05 (gpu_preflight_driver_min_version); "
    "do: upgrade the driver (e.g. 535 or 550)"
)


def result_with(stats, failures=(), rc=2) -> RunResult:
    return RunResult(
        rc=rc,
        status="failed" if rc else "successful",
        stats=stats,
        failures=list(failures),
        stdout="",
        artifact_dir=Path("/tmp/none/artifacts/r1"),
        run_id="r1",
    )


def provisioned(run: RunResult) -> api.ProvisionResult:
    return api.ProvisionResult(
        inventory=Path("/fleet/hosts.yml"),
        playbook=Path("/p40fleet/site.yml"),
        exit_code=api.exit_code_for(run),
        status=run.status,
        rc=run.rc,
        run_id=run.run_id,
        hosts=api._host_results(run),
        failures=run.failures,
        artifact_dir=run.artifact_dir,
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
    failure = HostFailure("node2", "Check the driver.", "gpu_preflight", PREFLIGHT)
    result = provisioned(result_with(_stats_from(RECAP), [failure]))
    assert result.hosts["node2"].stats.failures == 1 and result.hosts["node2"].first_failure is failure
    assert result.hosts_in("failed", "unreachable") == ["node2", "node3"]
    summary = report.build_report([("run", result)])
    run = summary["runs"][0]
    assert (run["run_id"], run["exit_code"], run["playbook"]) == ("r1", 2, "/p40fleet/site.yml")
    hosts = run["hosts"]
    assert {h: e["state"] for h, e in hosts.items()} == {"node1": "changed", "node2": "failed", "node3": "unreachable"}
    assert hosts["node2"]["failures"] == [
        {"task": "Check the driver.", "role": "gpu_preflight", "message": PREFLIGHT, "unreachable": False}
    ]
    path = tmp_path / "out" / "report.json"
    report.write_report(summary, path)
    assert json.loads(path.read_text())["schema"] == report.REPORT_SCHEMA

    console = Console(record=True, width=200, force_terminal=True)
    report.print_summary(console, summary)
    text = console.export_text()
    assert "node2" in text and "failed" in text and "driver 470.256.02 is too old" in text


def test_the_summary_keeps_every_column_and_word_when_not_a_terminal():
    failure = HostFailure("node2", "Check the driver.", "gpu_preflight", PREFLIGHT)
    unreachable = HostFailure("node3", "Probe.", "gpu_preflight", "Failed to connect to the host via ssh", True)
    summary = report.build_report([("run", provisioned(result_with(_stats_from(RECAP), [failure, unreachable])))])
    out = io.StringIO()
    report.print_summary(Console(file=out, width=80), summary)
    lines = out.getvalue().splitlines()
    assert lines[0] == "p40fleet · run · exit 2: hosts failed (failed, ansible-playbook rc 2)"
    node2 = next(line for line in lines if line.startswith("  node2:"))
    assert node2 == (
        "  node2: failed ok=3 changed=0 failures=1 unreachable=0 skipped=0 rescued=0 first failure: "
        "[gpu_preflight] Check the driver.: " + " | ".join(PREFLIGHT.splitlines())
    )
    node3 = next(line for line in lines if line.startswith("  node3:"))
    assert node3.startswith("  node3: unreachable ok=1") and node3.endswith("Failed to connect to the host via ssh")
    # and the multi-line failure once more, verbatim, line by line
    assert lines[-2:] == [f"    {line}" for line in PREFLIGHT.splitlines()]


def test_progress_prints_changes_and_failures_only():
    console = Console(file=io.StringIO(), width=200)
    progress = cli.make_progress(console, "first run")
    progress({"event": "runner_on_ok", "event_data": {"host": "node1", "task": "A", "res": {"changed": False}}})
    progress(
        {
            "event": "runner_on_ok",
            "event_data": {"host": "node1", "task": "B", "role": "cudnn", "res": {"changed": True}},
        }
    )
    progress({"event": "runner_on_failed", "event_data": {"host": "node2", "task": "C", "res": {"msg": "boom"}}})
    lines = console.file.getvalue().splitlines()
    assert lines == ["first run: node1 changed: [cudnn] B", "first run: node2 failed: C: boom"]


def test_cli_refuses_unknown_profiles_without_touching_podman(capsys):
    argv = ["sandbox", "up", "--name", "pytest-nothing", "--profiles", "p40,no-such-gpu"]
    assert dev_cli.main(argv) == cli.EXIT_ERROR


REFUSED = 'Field "serial" is not a valid field to query.'


def test_a_failed_commands_own_words_follow_ansibles_non_zero_return_code():
    event = {
        "event": "runner_on_failed",
        "event_data": {
            "host": "node1",
            "task": "Collect root's samples",
            "res": {"msg": "non-zero return code", "rc": 2, "stdout": REFUSED + "\n\n", "stderr": ""},
        },
    }
    failure = failure_from_event(event)
    assert failure.message == f"non-zero return code (rc 2): {REFUSED}"
    # A message of the task's own is kept as it is.
    event["event_data"]["res"]["msg"] = "node1: the driver is too old"
    assert failure_from_event(event).message == "node1: the driver is too old"


def test_qualify_says_where_its_verdicts_are_only_when_it_wrote_them(tmp_path):
    history = tmp_path / "gpu-qualify.json"
    result = api.ProvisionResult(inventory=tmp_path, playbook=tmp_path, exit_code=2, status="failed")
    before = cli._file_version(history)
    said = cli.qualify_outcome(history, before, result)
    assert (
        said == f"no verdict was written to {history}: no host reached the judging (failed); the failures above say why"
    )
    history.write_text("{}")
    assert (
        cli.qualify_outcome(history, before, result) == f"this run's verdicts and host failures are kept in {history}"
    )

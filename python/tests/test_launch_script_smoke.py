"""The smoke summary (roles/launch_script/files/launch_script_smoke.py): a pass only when every step ran.

Table tests on logs shaped like verl's console logger (one `step:N - key:value - ...` line per step, prefixed by
Ray's worker tag), without containers or a GPU.
"""

from __future__ import annotations

import json

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

smoke = load_module(REPO_ROOT / "roles" / "launch_script" / "files" / "launch_script_smoke.py", "launch_script_smoke")


def step_line(step: int, seconds: float = 10.0, reserved: float = 20.5) -> str:
    return (
        f"\x1b[36m(TaskRunner pid=42)\x1b[0m step:{step} - actor/pg_loss:0.001 - timing_s/step:{seconds:.3f}"
        f" - perf/max_memory_allocated_gb:13.032 - perf/max_memory_reserved_gb:{reserved:.3f} - critic/vf_loss:0.080"
    )


def val_line(score: float = 0.125) -> str:
    return f"(TaskRunner pid=42) step:0 - val-core/openai/gsm8k/reward/mean@1:{score} - val-aux/num_turns:1"


def resume_lines(step: int) -> list[str]:
    """What verl 0.4.1 prints when it resumes (ray_trainer.py:868-873), then the next step's line."""
    folder = f"/home/p40fleet/verl-runs/smoke-checkpoints/global_step_{step}"
    return [
        f"Load from checkpoint folder: {folder}",
        f"Setting global step to {step}",
        f"Resuming from {folder}",
        step_line(step + 1),
    ]


def checkpoint(root, step: int, parts=("actor", "critic"), latest=None):
    """A checkpoint directory as verl leaves it: the latest marker and the step's actor and critic folders."""
    for part in parts:
        (root / f"global_step_{step}" / part).mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(latest or step))
    return str(root)


OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.84 GiB."
CASES = {
    # name: (lines, steps wanted, rc, ok, why contains); every case but the last ones validates, saves and resumes.
    "all steps": ([val_line(), step_line(1, 17.5), step_line(2, 10.0), step_line(3, 12.0)], 3, 0, True, ""),
    "stops at step 1": ([step_line(1), "Traceback (most recent call last):", OOM], 3, 1, False, "after 1 of 3 steps"),
    "no step at all": (
        ["AttributeError: 'BaseShardingManager' object has no attribute 'timing'"],
        2,
        1,
        False,
        "after 0 of 2 steps: AttributeError",
    ),
    "exit 0 but a step missing": ([step_line(1), step_line(3)], 3, 0, False, "steps [2] printed no metrics line"),
    "no cuda": (["RuntimeError: Found no NVIDIA driver on your system."], 2, 1, False, "no CUDA GPU is usable"),
    "empty log": ([], 1, 1, False, "the trainer printed nothing"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_judge(name, tmp_path):
    lines, wanted, rc, ok, why = CASES[name]
    result = smoke.judge(lines, wanted, rc, {"0": 20000}, resume_lines(wanted), checkpoint(tmp_path, wanted))
    assert result["ok"] is ok
    assert why in result["why"]
    line = smoke.summary_line(result)
    assert line.startswith("smoke: PASS" if ok else "smoke: FAIL")


GOOD = [val_line(), step_line(1), step_line(2), step_line(3)]
# name: (lines, resume lines, checkpoint (parts, latest) or None, why contains): all steps ran, one check fails.
CHECKS = {
    "no validation": (GOOD[1:], resume_lines(3), (("actor", "critic"), 3), "no validation metrics"),
    "validation of another kind": (
        ["step:0 - val/other:1", *GOOD[1:]],
        resume_lines(3),
        (("actor", "critic"), 3),
        "no validation metrics",
    ),
    "no checkpoint": (GOOD, resume_lines(3), None, "no checkpoint of step 3"),
    "an older checkpoint marked latest": (GOOD, resume_lines(3), (("actor", "critic"), 2), "no checkpoint of step 3"),
    "no critic saved": (GOOD, resume_lines(3), (("actor",), 3), "no checkpoint of step 3"),
    "started from scratch": (
        GOOD,
        ["Training from scratch", step_line(1)],
        (("actor", "critic"), 3),
        "did not resume from global_step_3",
    ),
    "resumed but no further step": (GOOD, resume_lines(3)[:-1], (("actor", "critic"), 3), "run step 4"),
    "resumed another step": (GOOD, resume_lines(2), (("actor", "critic"), 3), "did not resume"),
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_each_check_can_fail_the_smoke(name, tmp_path):
    lines, resumed, saved, why = CHECKS[name]
    where = checkpoint(tmp_path, 3, saved[0], saved[1]) if saved else str(tmp_path / "none")
    result = smoke.judge(lines, 3, 0, {}, resumed, where)
    assert result["ok"] is False and why in result["why"]
    assert smoke.summary_line(result).startswith("smoke: FAIL")


def test_a_passing_smoke_reports_its_validation_score(tmp_path):
    result = smoke.judge(GOOD, 3, 0, {}, resume_lines(3), checkpoint(tmp_path, 3))
    assert result["ok"] and result["validated"] and result["saved"] and result["resumed"]
    assert result["val_score"] == 0.125
    assert "validation yes, save yes, resume yes" in smoke.summary_line(result)


def test_figures_of_a_passing_run(tmp_path):
    lines = [val_line(), step_line(1, 17.5, 20.1), step_line(2, 10.0, 22.3), step_line(3, 12.0, 22.0)]
    result = smoke.judge(lines, 3, 0, {"0": 21000, "1": 20500}, resume_lines(3), checkpoint(tmp_path, 3))
    # The first step (workers warming up) is left out of the mean where later steps exist.
    assert result["seconds_per_step"] == 11.0 and result["first_step_seconds"] == 17.5
    assert result["torch_peak_reserved_gib"] == 22.3
    assert result["last_metrics"]["step"] == 3 and result["last_metrics"]["critic/vf_loss"] == 0.08
    assert "gpu0 21000 MiB, gpu1 20500 MiB" in smoke.summary_line(result)


def test_main_writes_the_json_and_exits_by_the_verdict(tmp_path, capsys):
    log = tmp_path / "smoke.log"
    resume = tmp_path / "smoke.resume.log"
    samples = tmp_path / "gpu.csv"
    log.write_text("\n".join([val_line(), step_line(1), step_line(2)]) + "\n")
    resume.write_text("\n".join(resume_lines(2)) + "\n")
    samples.write_text("0, 100\n0, 20500\n1, 300\nnot, a sample\n")
    out = tmp_path / "last.json"
    checks = ["--resume-log", str(resume), "--checkpoints", checkpoint(tmp_path / "ckpt", 2)]
    argv = ["--log", str(log), "--steps", "2", "--rc", "0", *checks, "--gpu-samples", str(samples), "--json", str(out)]
    assert smoke.main(argv) == 0
    assert json.loads(out.read_text())["gpu_peak_mib"] == {"0": 20500, "1": 300}
    assert capsys.readouterr().out.startswith("smoke: PASS steps 2/2")
    assert smoke.main(["--log", str(log), "--steps", "3", "--rc", "0", *checks]) == 1
    assert smoke.main(["--log", str(log), "--steps", "2", "--rc", "0"]) == 1  # nothing shows a save or a resume
    assert smoke.main(["--log", str(tmp_path / "missing.log"), "--steps", "1", "--rc", "0"]) == 1


# --- The verdict playbooks/smoke.yml keeps (plugins/filter/launch_script.py) ----------------
verdict = load_module(
    REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_filters"
).launch_script_smoke_result


def script_output(result: dict) -> str:
    return f"Smoke run\n{smoke.summary_line(result)}\nsmoke-json: {json.dumps(result)}\n"


PASSING = {
    **smoke.judge([val_line(), step_line(1), step_line(2)], 2, 0, {"0": 20000}, resume_lines(2)),
    "saved": True,  # judged on a checkpoint directory by test_judge; here only the verdict's reading is tested
    "ok": True,
    "why": "",
}
VERDICTS = {
    # name: (stdout, rc, steps, ok, why contains)
    "pass": (script_output(PASSING), 0, 2, True, ""),
    "the script failed": (script_output(smoke.judge([step_line(1)], 2, 1, {})), 1, 2, False, "after 1 of 2"),
    "fewer steps than asked": (script_output(PASSING), 0, 3, False, ""),
    "exit 0 without a summary": ("Traceback\nsomething\n", 0, 2, False, "without a smoke summary"),
    "killed by the timeout": ("", 124, 2, False, "exited 124"),
    "forged json": (
        'smoke: PASS\nsmoke-json: {"ok": "yes", "steps_done": "2", "gpu_peak_mib": {"0": true}}',
        0,
        2,
        False,
        "",
    ),
    "not json": ("smoke: PASS\nsmoke-json: {ok", 0, 2, False, ""),
    "ok but not resumed": (script_output({**PASSING, "resumed": False}), 0, 2, False, ""),
    "ok but a forged save": (script_output({**PASSING, "saved": "yes"}), 0, 2, False, ""),
}


@pytest.mark.parametrize("name", list(VERDICTS))
def test_verdict(name):
    stdout, rc, steps, ok, why = VERDICTS[name]
    result = verdict(stdout, rc, steps, "2026-12-01T00:00:00+00:00")
    assert result["ok"] is ok
    assert why in result["why"]
    if not ok:
        assert result["why"], name
    # Only typed fields survive: a value of the wrong type becomes None, strings are cut short.
    assert all(isinstance(v, int) for v in result["gpu_peak_mib"].values())
    assert isinstance(result["summary"], str) and len(result["summary"]) <= 400


def test_a_passing_verdict_keeps_the_figures():
    result = verdict(script_output(PASSING), 0, 2, "2026-12-01T00:00:00+00:00")
    assert result["steps_done"] == 2 and result["seconds_per_step"] == 10.0
    assert result["gpu_peak_mib"] == {"0": 20000} and result["summary"].startswith("smoke: PASS steps 2/2")


def test_the_fleet_report_shows_each_host_s_smoke_verdict_escaped():
    from p40fleet.fleet import fleet_report, host_records, update_hosts
    from p40fleet.html_report import render_html

    hostile = dict(verdict(script_output(PASSING), 0, 2, "<b>soon</b>"), summary="smoke: PASS <script>x</script>")
    events = [
        {
            "event": "runner_on_ok",
            "event_data": {"host": "node1", "res": {"ansible_facts": {"launch_script_smoke_verdict": hostile}}},
        },
        {"event": "runner_on_ok", "event_data": {"host": "node2", "res": {"ansible_facts": {"other": 1}}}},
    ]
    state = update_hosts({}, {"run_id": "r1", "hosts": {}}, events)
    records = host_records(state)
    by_host = {r.host: r for r in records}
    assert by_host["node1"].smoke["ok"] is True and by_host["node1"].smoke["steps_done"] == 2
    assert "node2" not in state["hosts"] or by_host["node2"].smoke is None
    page = render_html(fleet_report(records, "inventory.yml"))
    assert "smoke run <b>passed</b>" in page
    assert "<script>x</script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "<b>soon</b>" not in page


def test_a_probed_host_with_a_smoke_verdict_shows_its_stack_not_the_unread_note():
    from p40fleet.html_report import render_html

    host = {"host": "node1", "status": "converged", "state_source": "fleet_state probe", "state_at": "", "smoke": {}}
    page = render_html({"hosts": [dict(host, smoke={"ok": False, "summary": "smoke: FAIL"})], "totals": {}})
    assert "smoke run <b>failed</b>" in page and "has not been read from this host" not in page
    unread = render_html({"hosts": [dict(host, state_source="gpu_preflight")], "totals": {}})
    assert "has not been read from this host" in unread

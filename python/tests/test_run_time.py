"""`p40fleet report`'s run time per host (python/p40fleet/run_time.py): measured where a smoke ran at the rendered
batch, else the estimate the launch script's filter made (docs/estimate.md), labelled as an estimate."""

from __future__ import annotations

import pytest

from p40fleet.run_time import run_time
from tests.test_launch_script_estimate import estimate

DEFAULT = estimate()  # the 1x P40 rendering: 435 steps, 16 validations, the cost model's estimate
PLAN, EST = DEFAULT["schedule"], DEFAULT["estimate"]
PASSED = {"ok": True, "seconds_per_step": 300.0, "schedule": PLAN, "estimate": EST}


def test_a_full_batch_smoke_gives_the_measured_step_and_the_run_s_duration():
    line = run_time({**PASSED, "full_batch": True, "batch": 256})
    total = 435 * 300.0 + 16 * EST["validation_seconds"]
    assert line.startswith("measured 300.0 s a step at the rendered batch (smoke run); the run: 435 steps x 300.0 s")
    assert f"+ 16 validations x {EST['validation_seconds'] / 60:.1f} minutes (estimated)" in line
    assert line.endswith(f"= {total / 3600:.1f} hours")


@pytest.mark.parametrize(
    ("smoke", "starts", "contains"),
    [
        # A tiny-batch smoke's seconds per step are not the run's: the estimate stays, and says what would measure.
        (
            {**PASSED, "full_batch": False, "batch": 8, "seconds_per_step": 13.1},
            "estimate (docs/estimate.md, not measured): 4.4 minutes a step, 33.8 hours for 435 steps and 16"
            " validations",
            "the smoke run measured 13.1 s a step at a batch of 8, not the run's batch",
        ),
        # A failed full-batch smoke measured nothing to trust.
        ({**PASSED, "ok": False, "full_batch": True}, "estimate (docs/estimate.md, not measured)", "300.0 s a step"),
        # No estimate (a card the model does not know): only what the smoke measured.
        ({**PASSED, "estimate": None, "batch": 8}, "the smoke run measured 300.0 s a step at a batch of 8", ""),
        # No validations: the steps alone.
        (
            {**PASSED, "full_batch": True, "schedule": {**PLAN, "validations": 0}},
            "measured 300.0 s a step",
            "435 steps x 300.0 s = 36.2 hours",
        ),
    ],
)
def test_otherwise_the_estimate_labelled_as_one(smoke, starts, contains):
    line = run_time(smoke)
    assert line.startswith(starts) and contains in line, line


@pytest.mark.parametrize(
    "smoke",
    [None, {}, {"ok": True, "full_batch": True, "seconds_per_step": "300"}, {"schedule": [], "estimate": "x"}],
)
def test_nothing_to_say_is_none_and_wrong_types_are_ignored(smoke):
    assert run_time(smoke) is None


def test_the_report_shows_it_in_html_and_plain_lines():
    from p40fleet.cli import _record_line
    from p40fleet.fleet import HostRecord
    from p40fleet.html_report import render_html

    smoke = {**PASSED, "full_batch": True, "summary": "smoke: PASS"}
    page = render_html({"hosts": [{"host": "node1", "status": "converged", "smoke": smoke}], "totals": {}})
    assert "<h3>run time</h3>measured 300.0 s a step at the rendered batch" in page
    line = _record_line(HostRecord(host="node1", status="converged", smoke=smoke))
    assert "run time measured 300.0 s a step" in line

"""How long a host's training run takes, as `p40fleet report` states it: measured where a smoke run at the rendered
batch sizes gave seconds per step, else the launch script's estimate (docs/estimate.md), labelled as one.

The smoke verdict (playbooks/smoke.yml) carries the run's schedule and estimate, which the controller derived when
it kept the verdict; the seconds per step are the smoke's own. Values of the wrong type are ignored.
"""

from __future__ import annotations


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return float(value)


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 60:.0f} minutes"


def run_time(smoke: dict | None) -> str | None:
    """One line: the measured step time and the run's expected duration, or the estimate; None without either."""
    if not isinstance(smoke, dict):
        return None
    plan = smoke.get("schedule") if isinstance(smoke.get("schedule"), dict) else {}
    estimate = smoke.get("estimate") if isinstance(smoke.get("estimate"), dict) else {}
    steps, validations = _number(plan.get("steps")), _number(plan.get("validations"))
    measured = _number(smoke.get("seconds_per_step"))
    validation = _number(estimate.get("validation_seconds"))
    if smoke.get("ok") is True and smoke.get("full_batch") is True and measured and steps is not None:
        line = f"measured {measured:.1f} s a step at the rendered batch (smoke run)"
        if validations and validation is not None:
            total = steps * measured + validations * validation
            return (
                f"{line}; the run: {steps:.0f} steps x {measured:.1f} s + {validations:.0f} validations x "
                f"{validation / 60:.1f} minutes (estimated) = {_duration(total)}"
            )
        if not validations:
            return f"{line}; the run: {steps:.0f} steps x {measured:.1f} s = {_duration(steps * measured)}"
        return f"{line}; the run: {steps:.0f} steps x {measured:.1f} s, and {validations:.0f} validations unestimated"
    parts = []
    step, total = _number(estimate.get("step_seconds")), _number(estimate.get("total_seconds"))
    if step is not None and total is not None and steps is not None:
        parts.append(
            f"estimate (docs/estimate.md, not measured): {step / 60:.1f} minutes a step, {_duration(total)} for "
            f"{steps:.0f} steps and {validations or 0:.0f} validations"
        )
    if measured:
        batch = _number(smoke.get("batch"))
        at = f" at a batch of {batch:.0f}" if batch else ""
        parts.append(
            f"the smoke run measured {measured:.1f} s a step{at}, not the run's batch "
            "(launch_script_smoke_full_batch=true measures it)"
        )
    return "; ".join(parts) or None

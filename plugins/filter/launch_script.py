"""launch_script's decisions: a run's settings digest, and a smoke run's verdict (playbooks/smoke.yml).

`overrides | launch_script_run_digest(schedule_keys)` is 8 hex digits of sha256 over the overrides that change
what a run trains (every override whose key is not a schedule key, in order): a run's name carries it, so verl's
automatic resume never picks up a checkpoint of other settings (test_launch_script.py). The smoke verdict is
table-tested in test_launch_script_smoke.py.

The output comes from a run as the env owner: it is data, read strictly. Only the typed fields below are kept,
strings are cut short, and a run counts as passed only when the script exited 0 and its own summary says every
step ran, it validated, saved and resumed (the script's helper, files/launch_script_smoke.py, decides that from
verl's logs and the checkpoint directory).
"""

import hashlib
import json
import re

KEPT = {
    "ok": bool,
    "steps_wanted": int,
    "steps_done": int,
    "rc": int,
    "seconds_per_step": float,
    "first_step_seconds": float,
    "torch_peak_reserved_gib": float,
    "torch_peak_allocated_gib": float,
    "validated": bool,
    "val_score": float,
    "saved": bool,
    "resumed": bool,
}
TEXT_LIMIT = 400
# Control characters a terminal acts on (python/p40fleet/progress.py's CONTROLS, the same class; a test holds them
# equal): removed from the owner's text before it is stored, shown in a failure or printed by `p40fleet report`.
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _text(value, limit=TEXT_LIMIT):
    return CONTROLS.sub("", value)[:limit]


def _typed(value, kind):
    if kind is bool:
        return value if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def override_key(override):
    """The config key of a Hydra override (`+key=value`, `key=value`)."""
    return str(override).split("=", 1)[0].lstrip("+~")


def launch_script_run_digest(overrides, schedule_keys):
    skipped = set(schedule_keys or [])
    kept = [str(o) for o in overrides or [] if override_key(o) not in skipped]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:8]


def launch_script_smoke_result(stdout, rc, steps, at=""):
    """{ok, steps_wanted, steps_done, seconds_per_step, peaks..., summary, why, at} from the script's output."""
    lines = (stdout or "").splitlines()
    summary = next((ln for ln in reversed(lines) if ln.startswith("smoke: ")), "")
    found = {}
    for line in reversed(lines):
        if line.startswith("smoke-json: "):
            try:
                found = json.loads(line[len("smoke-json: ") :])
            except ValueError:
                found = {}
            break
    if not isinstance(found, dict):
        found = {}
    result = {key: _typed(found.get(key), kind) for key, kind in KEPT.items()}
    peaks = found.get("gpu_peak_mib") if isinstance(found.get("gpu_peak_mib"), dict) else {}
    result["gpu_peak_mib"] = {
        _text(str(k), 8): int(v) for k, v in peaks.items() if isinstance(v, int) and not isinstance(v, bool)
    }
    why = found.get("why") if isinstance(found.get("why"), str) else ""
    passed = (
        int(rc) == 0
        and result["ok"] is True
        and result["steps_done"] == int(steps)
        and result["steps_wanted"] == int(steps)
        and result["validated"] is True
        and result["saved"] is True
        and result["resumed"] is True
    )
    if not passed and not why:
        why = f"the script exited {rc} without a smoke summary" if not summary else "the summary does not say PASS"
    result.update(
        {
            "ok": passed,
            "rc": int(rc),
            "steps_wanted": int(steps),
            "summary": _text(summary) or (_text(lines[-1]) if lines else ""),
            "why": _text(why),
            "at": _text(str(at), 40),
        }
    )
    return result


class FilterModule:
    def filters(self):
        return {
            "launch_script_smoke_result": launch_script_smoke_result,
            "launch_script_run_digest": launch_script_run_digest,
        }

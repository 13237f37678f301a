"""train_run's decisions: the run's unit and command, the host's boot identity, and a run's progress read from its
log. The log is the env owner's process talking: parsed as data, strictly; a line that is not exactly what verl
prints is skipped and counted, never trusted in part. Table-tested without hosts (python/tests/test_train_run.py).
"""

from __future__ import annotations

import math
import re

NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
# What systemd would expand or unquote in ExecStart= ($, %, quotes, backslashes) and anything unprintable.
UNSAFE_ARG = re.compile(r"[$%\"'\\\x00-\x1f\x7f]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# verl 0.4.1's console logger: `step:N` then ` - key:value` with numbers printed as {v:.3f}
# (verl/utils/logger/aggregate_logger.py:26-32).
STEP_LINE = re.compile(r"^step:(\d{1,8})((?: - [A-Za-z0-9_@/.\-]{1,200}:-?(?:\d{1,15}\.\d{1,12}|nan|inf))*)$")
FIELD = re.compile(r" - ([A-Za-z0-9_@/.\-]{1,200}):(-?(?:\d{1,15}\.\d{1,12}|nan|inf))")
TOTAL_LINE = re.compile(r"^Total training steps: (\d{1,8})$")
SAVE_LINE = re.compile(r"^local_global_step_folder: \S{1,4000}/global_step_(\d{1,8})$")
TRAIN_SCORE = "critic/score/mean"
STEP_TIME = "timing_s/step"
# verl 0.4.1 names validation scores val-core/<data source>/<reward key>/mean@N (ray_trainer.py:709).
VAL_SCORE = re.compile(r"^val-core/.+/reward/mean@\d+$")
HISTORY_POINTS = 200
LINE_LIMIT = 20000


class TrainRunError(ValueError):
    """An input the role cannot use: said with what was found and what to do."""


def train_run_unit(name, host="this host"):
    """The systemd unit of run `name`; refuses a name that is not one."""
    if not isinstance(name, str) or not NAME.match(name):
        raise TrainRunError(
            f"{host}: train_run_name {name!r} is not a run name (lower-case letters, digits and '-', 40 at most, "
            f"starting with a letter or digit); choose one"
        )
    return f"p40fleet-train-{name}.service"


def train_run_exec_start(argv, host="this host"):
    """ExecStart='s words for argv: each quoted; words systemd would rewrite are refused."""
    words = []
    for word in argv:
        word = str(word)
        if not word or UNSAFE_ARG.search(word):
            raise TrainRunError(
                f"{host}: the run's command word {word!r} is empty or holds $, %, a quote, a backslash or a control "
                f"character, which the unit cannot pass through unchanged; use plain KEY=VALUE overrides"
            )
        words.append(f'"{word}"')
    return " ".join(words)


def train_run_boot(text):
    """The host's boot identity: the kernel's boot id and PID 1's start (a container restarted is a host rebooted,
    on the same kernel). text: /proc/sys/kernel/random/boot_id then /proc/1/stat, as root reads them."""
    lines = str(text).splitlines()
    if len(lines) < 2 or not re.match(r"^[0-9a-f-]{36}$", lines[0].strip()):
        raise TrainRunError(f"not a boot id and PID 1's stat: {text!r:.120}")
    fields = lines[1].rsplit(")", 1)[-1].split()
    # /proc/PID/stat: starttime is field 22, the 20th after the command's closing parenthesis.
    if len(fields) < 20 or not fields[19].isdigit():
        raise TrainRunError(f"PID 1's stat has no start time: {lines[1]!r:.120}")
    return f"{lines[0].strip()}/{fields[19]}"


def _number(text):
    value = float(text)
    return value if math.isfinite(value) else None


def train_run_progress(text, now=0, started=0):
    """A run's progress from its log lines (the reader's selection of them): {step, total_steps, seconds_per_step,
    train_score, val_score, val_step, checkpoint_step, remaining_s, history: [[step, train, val]], skipped}.
    Numbers are numbers or None; a resumed run's steps follow on from its checkpoint and replace any they repeat."""
    steps = {}
    total = None
    checkpoint = None
    skipped = 0
    # verl prints the total once per start of its trainer: each one after the first is a resume, from the
    # checkpoint saved last before it.
    starts = 0
    resumed_from = []
    for raw in str(text).splitlines()[-LINE_LIMIT:]:
        line = CONTROL.sub("", raw).rstrip("\r")
        if not line:
            continue
        if line.startswith("step:"):
            match = STEP_LINE.match(line)
            if not match:
                skipped += 1
                continue
            step = int(match.group(1))
            fields = dict(FIELD.findall(match.group(2)))
            steps[step] = {k: _number(v) for k, v in fields.items()}
            continue
        match = TOTAL_LINE.match(line)
        if match:
            total = int(match.group(1))
            starts += 1
            if starts > 1:
                resumed_from.append(checkpoint)
            continue
        match = SAVE_LINE.match(line)
        if match:
            checkpoint = int(match.group(1))
            continue
        skipped += 1
    ordered = sorted(steps)
    last = ordered[-1] if ordered else None
    times = [steps[s][STEP_TIME] for s in ordered[-20:] if steps[s].get(STEP_TIME) is not None]
    per_step = sum(times) / len(times) if times else None
    val_step, val_score = None, None
    for step in ordered:
        for key, value in steps[step].items():
            if VAL_SCORE.match(key) and value is not None:
                val_step, val_score = step, value
    history = [
        [s, steps[s].get(TRAIN_SCORE), next((v for k, v in steps[s].items() if VAL_SCORE.match(k)), None)]
        for s in ordered
    ]
    if len(history) > HISTORY_POINTS:
        every = math.ceil(len(history) / HISTORY_POINTS)
        history = [p for i, p in enumerate(history) if i % every == 0 or p[2] is not None or i == len(history) - 1]
    remaining = None
    if per_step is not None and total is not None and last is not None:
        remaining = round(max(total - last, 0) * per_step, 1)
    return {
        "step": last,
        "total_steps": total,
        "seconds_per_step": round(per_step, 3) if per_step is not None else None,
        "train_score": steps[last].get(TRAIN_SCORE) if last is not None else None,
        "val_score": val_score,
        "val_step": val_step,
        "checkpoint_step": checkpoint,
        "remaining_s": remaining,
        "expected_end": round(now + remaining) if remaining is not None and now else None,
        "history": history,
        "skipped": skipped,
        "resumes": len(resumed_from),
        "resumed_from": resumed_from,
    }


def train_run_state(record, boot, active, progress, host="this host"):
    """What `p40fleet train status` says of one run: running, finished, stopped, failed, rebooted or none.
    record: what `start` kept ({} for no run); boot: the host's boot identity now; active: systemctl is-active."""
    if not record:
        return {"state": "none", "why": f"{host}: no run was started here"}
    if active in ("active", "activating"):
        return {"state": "running", "why": ""}
    step, total = progress.get("step"), progress.get("total_steps")
    if record.get("boot") and record["boot"] != boot and record.get("state") == "started":
        return {
            "state": "rebooted",
            "why": f"{host} rebooted under the run (boot identity changed since its start); "
            f"`p40fleet train start` resumes it from its checkpoint"
            + (f" (step {progress['checkpoint_step']})" if progress.get("checkpoint_step") else ""),
        }
    if record.get("state") == "stopped":
        return {"state": "stopped", "why": "stopped by `p40fleet train stop`; `start` resumes it"}
    if step is not None and total is not None and step >= total:
        return {"state": "finished", "why": ""}
    if step is None:
        at = "before its first step"
    else:
        at = f"at step {step} of {total}" if total is not None else f"at step {step} (no total steps logged)"
    log = f" {record['log']}" if record.get("log") else ""
    return {"state": "failed", "why": f"the run ended ({active}) {at}; see its log{log} on {host}"}


class FilterModule:
    def filters(self):
        return {
            "train_run_boot": train_run_boot,
            "train_run_exec_start": train_run_exec_start,
            "train_run_progress": train_run_progress,
            "train_run_state": train_run_state,
            "train_run_unit": train_run_unit,
        }

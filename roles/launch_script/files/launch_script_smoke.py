"""Judge a smoke run of the launch script: one summary line and a JSON record, exit 0 only if all of it passed.

Run by `train_gsm8k_ppo.sh --smoke` with the env's python, as the env owner, after verl's trainer exits. It reads
the trainer's logs (verl's console logger prints one `step:N - key:value - ...` line per PPO step, and the
validation before training as step 0) and, where nvidia-smi was sampled, the per-GPU memory samples. A smoke run
passes only when:
- the trainer exited 0 and every step 1..STEPS printed its metrics line (a run that stops early fails, whatever
  verl's exit status says);
- it validated before step 1 (step 0's line carries val-core/ metrics);
- it saved a checkpoint at step STEPS (latest_checkpointed_iteration.txt says STEPS, global_step_STEPS holds the
  actor's and the critic's directories);
- the second run resumed from that checkpoint (verl's "Resuming from .../global_step_STEPS") and printed step
  STEPS+1.

usage: launch_script_smoke.py --log LOG --steps N --rc RC [--resume-log LOG] [--checkpoints DIR]
                              [--gpu-samples FILE] [--json OUT]
"""

import argparse
import json
import math
import pathlib
import re
import sys

STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
PAIR = re.compile(r"([^\s:][^:]*?):(\S+)(?: - |$)")
# verl's metric names (0.4.1 and 0.5.0): the step's wall time, and the allocator's peak on the first worker.
STEP_SECONDS = "timing_s/step"
PEAK_RESERVED = "perf/max_memory_reserved_gb"
PEAK_ALLOCATED = "perf/max_memory_allocated_gb"
# Validation metrics (verl/trainer/ppo/ray_trainer.py:709-712 in 0.4.1): val-core/<data source>/<var>/<metric>.
VAL_CORE = "val-core/"
# What the log shows when torch sees no GPU: named in the summary instead of a bare failure.
NO_CUDA = re.compile(
    r"p40fleet: no usable CUDA GPU|Torch not compiled with CUDA|no CUDA GPUs are available|No CUDA GPUs|"
    r"Found no NVIDIA driver",
    re.IGNORECASE,
)


def number(text):
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_steps(lines):
    """{step: {metric: float}} from verl's console lines (the last line of a step wins)."""
    steps = {}
    for line in lines:
        found = STEP_LINE.search(line)
        if not found:
            continue
        metrics = {}
        for key, value in PAIR.findall(found.group(2)):
            parsed = number(value)
            if parsed is not None:
                metrics[key.strip()] = parsed
        steps[int(found.group(1))] = metrics
    return steps


def gpu_peaks(path):
    """{gpu index: peak MiB} from `nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l`."""
    peaks = {}
    if not path:
        return peaks
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return peaks
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            peaks[parts[0]] = max(peaks.get(parts[0], 0), int(parts[1]))
    return peaks


def last_error(lines):
    for line in reversed(lines):
        stripped = line.strip()
        if re.search(r"(Error|Exception|error:|Traceback|Killed|out of memory)", stripped):
            return stripped[:400]
    return lines[-1].strip()[:400] if lines else "the trainer printed nothing"


def validation(steps):
    """(validated, score) from step 0's line: the first val-core metric is the score verl reports (reward mean)."""
    found = {key: value for key, value in steps.get(0, {}).items() if key.startswith(VAL_CORE)}
    score = next((found[key] for key in sorted(found) if "/reward/mean" in key), None)
    return bool(found), score


def saved(checkpoints, step):
    """Whether verl's checkpoint of this step is there: the latest marker, the actor's and the critic's folders."""
    if not checkpoints:
        return False
    root = pathlib.Path(checkpoints)
    try:
        latest = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return False
    folder = root / f"global_step_{step}"
    return latest == str(step) and (folder / "actor").is_dir() and (folder / "critic").is_dir()


def resumed(lines, step):
    """Whether the second run loaded the checkpoint of `step` and then ran step + 1."""
    marker = re.compile(rf"Resuming from .*global_step_{step}\s*$")
    return any(marker.search(line) for line in lines) and step + 1 in parse_steps(lines)


def judge(lines, steps_wanted, rc, peaks, resume_lines=None, checkpoints=None):
    steps = parse_steps(lines)
    done = sorted(s for s in steps if 1 <= s <= steps_wanted)
    missing = [s for s in range(1, steps_wanted + 1) if s not in steps]
    seconds = [steps[s][STEP_SECONDS] for s in done if STEP_SECONDS in steps[s]]
    reserved = [steps[s][PEAK_RESERVED] for s in done if PEAK_RESERVED in steps[s]]
    allocated = [steps[s][PEAK_ALLOCATED] for s in done if PEAK_ALLOCATED in steps[s]]
    validated, val_score = validation(steps)
    was_saved = saved(checkpoints, steps_wanted)
    was_resumed = resumed(resume_lines or [], steps_wanted)
    ok = rc == 0 and not missing and validated and was_saved and was_resumed
    if ok:
        why = ""
    elif any(NO_CUDA.search(line) for line in lines):
        found = next(line for line in lines if NO_CUDA.search(line)).strip()[:300]
        why = f"no CUDA GPU is usable here, and a smoke run needs the host's GPU: {found}"
    elif rc != 0:
        where = lines if missing else (resume_lines or lines)  # every step ran: the resumed run failed
        why = f"the trainer exited {rc} after {len(done)} of {steps_wanted} steps: {last_error(where)}"
    elif missing:
        why = f"the trainer exited 0 but steps {missing[:5]} printed no metrics line"
    elif not validated:
        why = "the trainer printed no validation metrics (val-core/) before step 1"
    elif not was_saved:
        why = (
            f"no checkpoint of step {steps_wanted} in {checkpoints} (latest_checkpointed_iteration.txt, actor, critic)"
        )
    else:
        why = f"the second run did not resume from global_step_{steps_wanted} and run step {steps_wanted + 1}"
    last = {}
    if done:
        last = {"step": done[-1], **steps[done[-1]]}
    return {
        "ok": ok,
        "steps_wanted": steps_wanted,
        "steps_done": len(done),
        "rc": rc,
        # The first step includes the workers' start-up compile and warm-up: the mean is over the rest when any.
        "seconds_per_step": round(sum(seconds[1:] or seconds) / len(seconds[1:] or seconds), 2) if seconds else None,
        "first_step_seconds": round(seconds[0], 2) if seconds else None,
        "torch_peak_reserved_gib": round(max(reserved), 2) if reserved else None,
        "torch_peak_allocated_gib": round(max(allocated), 2) if allocated else None,
        "gpu_peak_mib": peaks,
        "validated": validated,
        "val_score": val_score,
        "saved": was_saved,
        "resumed": was_resumed,
        "why": why,
        "last_metrics": last,
    }


def summary_line(result):
    gpus = ", ".join(f"gpu{i} {mib} MiB" for i, mib in sorted(result["gpu_peak_mib"].items())) or "not sampled"
    reserved = result["torch_peak_reserved_gib"]
    line = (
        f"smoke: {'PASS' if result['ok'] else 'FAIL'} steps {result['steps_done']}/{result['steps_wanted']}, "
        f"validation {'yes' if result['validated'] else 'no'}, save {'yes' if result['saved'] else 'no'}, "
        f"resume {'yes' if result['resumed'] else 'no'}, "
        f"{result['seconds_per_step'] if result['seconds_per_step'] is not None else '?'} s/step, "
        f"peak memory per GPU: {gpus}; torch reserved (first worker) "
        f"{reserved if reserved is not None else '?'} GiB"
    )
    return line + (f" - {result['why']}" if result["why"] else "")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--resume-log")
    parser.add_argument("--checkpoints")
    parser.add_argument("--gpu-samples")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        lines = pathlib.Path(args.log).read_text(errors="replace").splitlines()
    except OSError as exc:
        lines = [f"the trainer's log {args.log} is unreadable: {exc}"]
    resume_lines = []
    if args.resume_log:
        try:
            resume_lines = pathlib.Path(args.resume_log).read_text(errors="replace").splitlines()
        except OSError:
            resume_lines = []  # no second run (the first failed): judged as not resumed
    result = judge(lines, args.steps, args.rc, gpu_peaks(args.gpu_samples), resume_lines, args.checkpoints)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, sort_keys=True) + "\n")
    print(summary_line(result))
    print("smoke-json: " + json.dumps(result, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

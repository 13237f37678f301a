"""Judge a smoke run of the launch script: one summary line and a JSON record, exit 0 only if every step ran.

Run by `train_gsm8k_ppo.sh --smoke` with the env's python, as the env owner, after verl's trainer exits. It reads
the trainer's log (verl's console logger prints one `step:N - key:value - ...` line per PPO step) and, where
nvidia-smi was sampled, the per-GPU memory samples. A smoke run passes only when the trainer exited 0 and every
step 1..STEPS printed its metrics line: a run that stops early, at step 1 or later, fails, whatever verl's exit
status says.

usage: launch_script_smoke.py --log LOG --steps N --rc RC [--gpu-samples FILE] [--json OUT]
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


def judge(lines, steps_wanted, rc, peaks):
    steps = parse_steps(lines)
    done = sorted(s for s in steps if 1 <= s <= steps_wanted)
    missing = [s for s in range(1, steps_wanted + 1) if s not in steps]
    seconds = [steps[s][STEP_SECONDS] for s in done if STEP_SECONDS in steps[s]]
    reserved = [steps[s][PEAK_RESERVED] for s in done if PEAK_RESERVED in steps[s]]
    allocated = [steps[s][PEAK_ALLOCATED] for s in done if PEAK_ALLOCATED in steps[s]]
    ok = rc == 0 and not missing
    if ok:
        why = ""
    elif any(NO_CUDA.search(line) for line in lines):
        found = next(line for line in lines if NO_CUDA.search(line)).strip()[:300]
        why = f"no CUDA GPU is usable here, and a smoke run needs the host's GPU: {found}"
    elif rc != 0:
        why = f"the trainer exited {rc} after {len(done)} of {steps_wanted} steps: {last_error(lines)}"
    else:
        why = f"the trainer exited 0 but steps {missing[:5]} printed no metrics line"
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
        "why": why,
        "last_metrics": last,
    }


def summary_line(result):
    gpus = ", ".join(f"gpu{i} {mib} MiB" for i, mib in sorted(result["gpu_peak_mib"].items())) or "not sampled"
    reserved = result["torch_peak_reserved_gib"]
    line = (
        f"smoke: {'PASS' if result['ok'] else 'FAIL'} steps {result['steps_done']}/{result['steps_wanted']}, "
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
    parser.add_argument("--gpu-samples")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        lines = pathlib.Path(args.log).read_text(errors="replace").splitlines()
    except OSError as exc:
        lines = [f"the trainer's log {args.log} is unreadable: {exc}"]
    result = judge(lines, args.steps, args.rc, gpu_peaks(args.gpu_samples))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, sort_keys=True) + "\n")
    print(summary_line(result))
    print("smoke-json: " + json.dumps(result, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

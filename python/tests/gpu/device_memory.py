"""What a run holds of the whole GPU: sampled from outside, with the run alone on the device (tests/gpu/run_check.py).

torch's allocator cap (run_check's sitecustomize) limits what torch reserves, not what a process holds beside it: the
CUDA context, NCCL's buffers, cuBLAS's workspaces and the kernels loaded. A P40 has to hold all of it. So the check:
- probes the GPU machine first (`PROBE`): what one process holds outside torch's allocator, bare (CUDA context) and
  working (a cuBLAS matmul and a one-rank NCCL all-reduce, as verl's worker does);
- caps torch at the emulated card's reported total less that working overhead (`cap_gib`);
- samples every process's device memory through each run (`Sampler`: `nvidia-smi --query-compute-apps` and the
  device's `memory.used`), one run at a time on the GPU, and keeps each process's peak and the device's;
- judges the run against the card (`budget`): the device's peak, less what the GPU machine's bare context holds
  beyond the emulated card's (per process seen), must stay within the card's reported total.

Figures in MiB, as nvidia-smi prints them. The parsers are pure and table-tested on a CPU (test_gpu_device_memory.py).
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import threading
import time

SAMPLE_SECONDS = 0.2
# What the GPU machine's bare CUDA context holds beyond the emulated card's, taken off each process's figure. A P40's
# context is smaller than an H100's (the stack's local memory scales with the SMs: 30 against 132, and CUDA 11.8's
# lazy loading keeps a context near 300 MB, pytorch/pytorch#107667), but no P40 figure is published
# (docs/facts-memory.md), so none is taken off: the H100's whole figure is held against the P40's reported total.
EXTRA_CONTEXT_MIB = 0
APPS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]
USED_QUERY = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]


def parse_apps(text: str) -> dict[str, tuple[str, int]]:
    """{pid: (process name, MiB)} from APPS_QUERY's output; lines of another shape (`[N/A]`, errors) are skipped."""
    found = {}
    for line in (text or "").splitlines():
        parts = [part.strip() for part in line.rsplit(",", 1)]
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        pid, _, name = parts[0].partition(",")
        if pid.strip().isdigit():
            found[pid.strip()] = (name.strip(), int(parts[1]))
    return found


def parse_used(text: str, index: str = "0") -> int | None:
    """MiB in use on GPU `index` from USED_QUERY's output, None when the line is missing."""
    for line in (text or "").splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0] == index and parts[1].isdigit():
            return int(parts[1])
    return None


def summarise(samples: list[dict], idle_mib: int | None) -> dict:
    """Peaks over samples [{"apps": {pid: (name, MiB)}, "used": MiB or None}]: each process's, their sum's, and the
    device's `memory.used` (what nvidia-smi counts for the whole card, idle_mib before the run included)."""
    processes: dict[str, dict] = {}
    sum_peak = used_peak = 0
    for sample in samples:
        apps = sample.get("apps") or {}
        for pid, (name, mib) in apps.items():
            entry = processes.setdefault(pid, {"name": name, "peak_mib": 0})
            entry["peak_mib"] = max(entry["peak_mib"], mib)
        sum_peak = max(sum_peak, sum(mib for _, mib in apps.values()))
        if sample.get("used") is not None:
            used_peak = max(used_peak, sample["used"])
    return {
        "samples": len(samples),
        "every_seconds": SAMPLE_SECONDS,
        "processes": processes,
        "process_peak_mib": max((p["peak_mib"] for p in processes.values()), default=0),
        "processes_sum_peak_mib": sum_peak,
        "device_used_peak_mib": used_peak,
        "device_idle_mib": idle_mib,
    }


def _query(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


class Sampler:
    """Samples APPS_QUERY and USED_QUERY in a thread until stop(), which returns summarise()'s figures."""

    def __init__(self, index: str = "0", enabled: bool = True, path: pathlib.Path | None = None):
        self.index = index
        self.enabled = enabled
        # Written every few seconds too: a call cut off at its time limit keeps the figures so far.
        self.path = path
        self.samples: list[dict] = []
        self.idle = parse_used(_query(USED_QUERY), index) if enabled else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append({"apps": parse_apps(_query(APPS_QUERY)), "used": parse_used(_query(USED_QUERY))})
            if self.path and len(self.samples) % 25 == 0:
                self.path.write_text(json.dumps(self.result()) + "\n")
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> Sampler:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
            if self.path:
                self.path.write_text(json.dumps(self.result()) + "\n")

    def result(self) -> dict:
        return summarise(self.samples, self.idle)


# Run by the probe's own python (the machine's torch): it prints one JSON line of torch's figures at each stage and
# waits for a line on stdin before the next, while the parent samples the device from outside.
PROBE = r"""
import json, os, sys
import torch
def say(stage):
    torch.cuda.synchronize()
    print(json.dumps({"stage": stage, "reserved_mib": torch.cuda.memory_reserved() / 2**20}), flush=True)
    sys.stdin.readline()
x = torch.ones(1, device="cuda")
say("bare")
a = torch.randn(4096, 4096, device="cuda")
b = a @ a
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
say("working")
dist.destroy_process_group()
"""


def probe(python: str, env: dict | None = None, settle: float = 1.0) -> dict:
    """What one process holds outside torch's allocator on this GPU: {bare_mib, working_mib, stages}. Per process
    where nvidia-smi lists processes (a container may not), else the device's memory.used less its idle figure."""
    idle = parse_used(_query(USED_QUERY))
    child = subprocess.Popen(
        [python, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    stages = {}
    try:
        for _ in range(2):
            line = child.stdout.readline()
            if not line:
                break
            stage = json.loads(line)
            time.sleep(settle)
            apps = parse_apps(_query(APPS_QUERY))
            used = parse_used(_query(USED_QUERY))
            mine = apps.get(str(child.pid))
            held = mine[1] if mine else (used - (idle or 0) if used is not None else None)
            stages[stage["stage"]] = {
                "torch_reserved_mib": round(stage["reserved_mib"], 1),
                "held_mib": held,
                "seen_as": "process" if mine else "device",
                "outside_allocator_mib": None if held is None else math.ceil(held - stage["reserved_mib"]),
            }
            child.stdin.write("\n")
            child.stdin.flush()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    return {
        "bare_mib": (stages.get("bare") or {}).get("outside_allocator_mib"),
        "working_mib": (stages.get("working") or {}).get("outside_allocator_mib"),
        "idle_mib": idle,
        "stages": stages,
        "rc": child.returncode,
    }


def cap_gib(card_total_mib: int, outside_mib: int) -> float:
    """torch's cap for a card: its reported total less what a process holds outside the allocator, in GiB, rounded
    down to a hundredth."""
    return math.floor((card_total_mib - outside_mib) / 1024 * 100) / 100


def budget(device: dict, card_total_mib: int, extra_context_mib: int) -> dict:
    """Whether a run fits the emulated card: the device's peak, less the GPU machine's extra context (its bare context
    beyond the emulated card's) for each process seen, within the card's reported total.

    The device's memory.used is the whole card (every process, every context); where the sampler saw no process list
    it is still the figure, and then nothing is taken off."""
    seen = len(device.get("processes") or {})
    peak = max(device.get("device_used_peak_mib") or 0, device.get("processes_sum_peak_mib") or 0)
    corrected = peak - max(extra_context_mib, 0) * seen
    return {
        "device_peak_mib": peak,
        "processes_seen": seen,
        "extra_context_mib": max(extra_context_mib, 0),
        "corrected_peak_mib": corrected,
        "card_total_mib": card_total_mib,
        "headroom_mib": card_total_mib - corrected,
        "fits": bool(device.get("samples")) and corrected <= card_total_mib,
    }

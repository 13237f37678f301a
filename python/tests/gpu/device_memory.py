"""What a run holds of the whole GPU: sampled from outside, with the run alone on the device (tests/gpu/run_check.py).

torch's allocator cap (run_check's sitecustomize) limits what torch reserves, not what a process holds beside it: the
CUDA context, NCCL's buffers, cuBLAS's workspaces and the kernels loaded. A P40 has to hold all of it. So the check:
- probes the GPU machine first (`PROBE`): what one process holds outside torch's allocator, bare (CUDA context),
  working (a cuBLAS matmul and a one-rank NCCL all-reduce) and model (a small Qwen2 trained under FSDP, as verl's
  worker does);
- caps torch at the emulated card's reported total less the largest of those, seen from the device, and a margin
  for kernels the probe does not load (`cap_gib`);
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


# Run by the probe's own python (the machine's torch, and the bundle's transformers on PYTHONPATH): it prints one JSON
# line of torch's figures at each stage and waits for a line on stdin before the next, while the parent samples the
# device from outside. The stages add what verl's worker loads beside torch's pool: a CUDA context (bare); cuBLAS's
# workspace and a one-rank NCCL communicator (working); then the kernels of the trainer's own work (model): a small
# Qwen2 of the real class with eager attention, wrapped in FSDP, a checkpointed forward and backward, AdamW,
# gradient clipping and sampled generation. Kernels load lazily and each holds device memory outside the pool: on
# 2026-12-07 verl's worker held 1,308 MiB beside torch's pool where the working stage had measured 1,240.
PROBE = r"""
import json, os, sys
import torch
device = os.environ.get("P40FLEET_PROBE_DEVICE", "cuda")
def say(stage):
    if device == "cuda":
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
    else:
        reserved = 0
    print(json.dumps({"stage": stage, "reserved_mib": reserved / 2**20}), flush=True)
    sys.stdin.readline()
x = torch.ones(1, device=device)
say("bare")
a = torch.randn(4096, 4096, device=device)
b = a @ a
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("P40FLEET_PROBE_PORT", "29531"))
if device == "cuda":
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
else:
    dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(1 << 20, device=device)
dist.all_reduce(t)
say("working")
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(
    vocab_size=1024, hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
)
config._attn_implementation = "eager"
model = Qwen2ForCausalLM(config).to(device)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as verl does
# FSDP needs an accelerator: on a CPU (the table tests' run of this script) the model trains unwrapped.
wrapped = FSDP(model, device_id=torch.device("cuda", 0), use_orig_params=True) if device == "cuda" else model
optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)
ids = torch.randint(0, 1024, (4, 64), device=device)
for _ in range(2):
    logits = wrapped(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.softmax(logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(-1)
    loss = -(logp.mean()) - 0.001 * entropy.mean()
    loss.backward()
    if device == "cuda":
        wrapped.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
import contextlib
full = FSDP.summon_full_params(wrapped, writeback=False) if device == "cuda" else contextlib.nullcontext()
with torch.no_grad(), full:
    model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=8, do_sample=True,
                   top_p=1.0, top_k=0, temperature=1.0, pad_token_id=0)
say("model")
dist.destroy_process_group()
"""
STAGES = ("bare", "working", "model")


def probe(python: str, env: dict | None = None, settle: float = 1.0) -> dict:
    """What one process holds outside torch's allocator on this GPU, stage by stage: {bare_mib, working_mib, stages}.
    Per process where nvidia-smi lists processes (a container may not), else the device's memory.used less its idle
    figure. working_mib, what the cap leaves room for, is the largest figure of the later stages seen from the
    device's side (memory.used less torch's pool): the whole device is what a run is judged by, idle and driver
    memory included."""
    idle = parse_used(_query(USED_QUERY))
    child = subprocess.Popen(
        [python, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    stages = {}
    try:
        for _ in STAGES:
            line = child.stdout.readline()
            if not line:
                break
            stage = json.loads(line)
            time.sleep(settle)
            apps = parse_apps(_query(APPS_QUERY))
            used = parse_used(_query(USED_QUERY))
            stages[stage["stage"]] = stage_figures(stage["reserved_mib"], apps.get(str(child.pid)), used, idle)
            child.stdin.write("\n")
            child.stdin.flush()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    return summarise_probe(stages, idle, child.returncode)


def stage_figures(reserved_mib: float, mine: tuple[str, int] | None, used: int | None, idle: int | None) -> dict:
    """One stage's figures: what the process holds (its own line, else the device's growth since idle), what of it
    is outside torch's pool, and what the device holds beside the pool (idle and driver memory included)."""
    held = mine[1] if mine else (used - (idle or 0) if used is not None else None)
    return {
        "torch_reserved_mib": round(reserved_mib, 1),
        "held_mib": held,
        "seen_as": "process" if mine else "device",
        "outside_allocator_mib": None if held is None else math.ceil(held - reserved_mib),
        "device_used_mib": used,
        "device_outside_mib": None if used is None else math.ceil(used - reserved_mib),
    }


def summarise_probe(stages: dict, idle: int | None, rc: int | None) -> dict:
    """The probe's figures from its stages. A probe that did not reach every stage (rc not 0, a stage missing)
    measured nothing the cap may use: working_mib is then None and the check stops."""
    complete = rc == 0 and all(name in stages for name in STAGES)
    later = [stages[name].get("device_outside_mib") for name in STAGES[1:] if name in stages]
    working = max(later) if complete and later and None not in later else None
    return {
        "bare_mib": (stages.get("bare") or {}).get("outside_allocator_mib"),
        "working_mib": working,
        "idle_mib": idle,
        "stages": stages,
        "rc": rc,
    }


# Left beside the probe's figure for kernels verl's worker loads and the probe does not: the probe's stages are a
# sample of the worker's work, not all of it. Stricter, never more forgiving: a smaller cap leaves torch less.
KERNEL_MARGIN_MIB = 64


def cap_gib(card_total_mib: int, outside_mib: int, margin_mib: int = KERNEL_MARGIN_MIB) -> float:
    """torch's cap for a card: its reported total less what a process holds outside the allocator and the margin, in
    GiB, rounded down to a hundredth."""
    return math.floor((card_total_mib - outside_mib - margin_mib) / 1024 * 100) / 100


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

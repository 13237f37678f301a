"""The step-time sweep (run on the GPU machine by run_check.py --sweep CASE): which settings make a step fastest.

Each configuration is the case's rendered script run as a host runs it (not --smoke), with overrides passed through
on top of the rendering: one PPO step at the rendered batch sizes (256 prompts), no validation, no checkpoint, under
the case's memory cap with TF32 off. Every configuration runs alone on the GPU, one after the other, in a fresh
process, so each first step pays the same start-up costs, and every process's device memory is sampled through it
(tests/gpu/device_memory.py). A configuration fits when it ran to the end and the device's peak (every process, CUDA
contexts, NCCL, less the GPU machine's extra context) stays within the emulated card's reported total: for the P40
22,888 MiB, the smallest total quoted for one with ECC on (docs/facts-memory.md).

What the sweep varies, on top of the rendering (the last sweep's winner under a 24,576 MiB card, whose allocator cap
left no room for what a process holds beside torch's allocator):
- the micro batches of the actor, the critic and the log-prob passes (the logits of a 151,936-token vocabulary in
  fp32 are the largest activations of an update);
- the prompts per HF generate call (the rollout micro batch: its KV cache);
- the critic's parameter offload (2 GB of fp32 parameters on the GPU or not).

The record (a sweep folder in docs/gpu-runs/, one file a case; tests.gpu.records) keeps each configuration's
effective overrides, its seconds per step, the seconds of each phase, tokens per second, torch's peaks and the
device's. test_gpu_sweep.py holds today's rendering to it: the rendered defaults must be one of the configurations,
fit, and be within 10% of the fastest one that fits.
"""

from __future__ import annotations

# Start from the rendering as it was when the sweep ran (the record keeps its overrides), then change one thing
# at a time. Names are the record's keys.
MICRO4 = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
]
ROLLOUT128 = ["actor_rollout_ref.rollout.micro_batch_size=128", "data.val_batch_size=128"]
CRITIC_OFFLOAD = ["critic.model.fsdp_config.param_offload=True"]

# Configurations that run another verl tree: {name: (tree suffix, {file: (old, new)})}.
SDPA_EDIT = {
    "verl/utils/model.py": ('attn_implementation="eager"', 'attn_implementation="sdpa"'),
    "verl/workers/fsdp_workers.py": ('attn_implementation="eager"', 'attn_implementation="sdpa"'),
}
# The key under which a configuration's attention kernel is compared (a patch-time setting, not an override).
ATTENTION = "(verl_patches) attn_implementation"
TREES: dict[str, tuple[str, dict]] = {}

# In the order they run (a call cut off at its limit keeps the first ones): the rendering, then one change each,
# the likeliest to fit first.
CONFIGS = {
    "rendered": [],
    "micro4": MICRO4,
    "rollout128": ROLLOUT128,
    "critic-offload": CRITIC_OFFLOAD,
    "micro4-rollout128": MICRO4 + ROLLOUT128,
}


# One step, alone: no validation, no checkpoint, a run name of its own per configuration.
def schedule(name: str, checkpoints: str) -> list[str]:
    return [
        "trainer.total_training_steps=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.experiment_name=sweep-{name}",
        f"trainer.default_local_dir={checkpoints}/sweep-{name}",
    ]


# Keys that say where and how long, not how a step runs: left out when a configuration is compared with a rendering.
NOT_COMPARED = (
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "trainer.experiment_name",
    "trainer.default_local_dir",
    "trainer.total_training_steps",
    "trainer.val_before_train",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.total_epochs",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
)


def effective(overrides: list[str]) -> dict:
    """{key: value} of an override list, the last one of a key winning, `+` dropped, NOT_COMPARED left out."""
    out = {}
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~").strip("'")
        value = value.rstrip("'")
        if key not in NOT_COMPARED:
            out[key] = value
    return out


def script_overrides(text: str) -> list[str]:
    """The OVERRIDES=( ... ) block of a rendered train_gsm8k_ppo.sh, one override a line, shell quotes removed."""
    lines = text.splitlines()
    start = lines.index("OVERRIDES=(") + 1
    end = lines.index(")", start)
    return [ln.strip().strip("'") for ln in lines[start:end]]


def measure(steps: dict, rc: int, log_tail: list[str]) -> dict:
    """A configuration's figures from its step metrics (launch_script_smoke.parse_steps)."""
    metrics = steps.get(1, {})
    out = {
        "rc": rc,
        "ran": rc == 0 and bool(metrics),
        "seconds_per_step": metrics.get("timing_s/step"),
        "phases_s": {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")},
        "tokens_per_second": metrics.get("perf/throughput"),
        "torch_peak_reserved_gib": metrics.get("perf/max_memory_reserved_gb"),
        "torch_peak_allocated_gib": metrics.get("perf/max_memory_allocated_gb"),
        "prompt_length_mean": metrics.get("prompt_length/mean"),
        "response_length_mean": metrics.get("response_length/mean"),
    }
    if not out["ran"]:
        errors = [ln for ln in log_tail if "Error" in ln or "error" in ln]
        out["error"] = (errors or log_tail or [""])[-1][-400:]
    return out


def attention_parity(model_dir: str, rows: int = 8, length: int = 96) -> dict:
    """Eager against SDPA on this GPU: the same fp32 model and left-padded batch, max |logit difference| at real
    tokens (padding positions carry no prediction verl uses)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 900, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        mask[row, : row * 7] = 0  # left padding, a different amount per row
    logits = {}
    for kind in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation=kind)
        model = model.cuda().eval()
        with torch.no_grad():
            out = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits
        logits[kind] = out.float().cpu()
        del model
        torch.cuda.empty_cache()
    real = mask.bool()
    diff = (logits["eager"] - logits["sdpa"]).abs()[real]
    scale = logits["eager"].abs()[real].max().item()
    worst = diff.max().item()
    return {"max_abs_diff": worst, "max_abs_logit": scale, "within_1e-5": worst <= 1e-5, "rows": rows, "length": length}

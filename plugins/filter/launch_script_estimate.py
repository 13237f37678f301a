"""launch_script's schedule and run-time estimate: what `train_gsm8k_ppo.sh --print` states besides the command.

`profile | launch_script_estimate(settings, run)` gives the schedule a run of the rendered settings follows (steps,
validations, checkpoints kept and their disk) and an estimate of its wall time on the profile's GPU from a cost model
(docs/estimate.md): FLOPs per training phase from the model's shape and the padded token counts, bytes per decode
step for generation, each divided by the card's datasheet rate or bandwidth (CARDS, docs/facts-datasheets.md) times an
efficiency calibrated on the GPU record of the 1x P40 rendering (docs/gpu-runs/p40-1x.json; `calibrate` recomputes
the constants below from it, and test_launch_script_estimate.py holds them equal). An estimate, never a measurement:
a host's smoke run replaces it (`p40fleet report`).
"""

import math
import re

# Datasheet figures: dense fp32 (non-tensor) and 16-bit (tensor-core or half-precision) TFLOPS, memory bandwidth
# in GB/s. The estimate uses the fp32 rate: every profile p40fleet renders for fp16 cards trains in fp32 (no loss
# scaler), and bf16 training is not calibrated. First match wins (the P40 before the P4). Sources: NVIDIA's
# datasheets, docs/facts-datasheets.md.
CARDS = [
    (r"P40\b", {"name": "Tesla P40", "fp32": 11.8, "fp16": 0.18, "bandwidth": 346}),
    (r"P100", {"name": "Tesla P100 (PCIe)", "fp32": 9.3, "fp16": 18.7, "bandwidth": 732}),
    (r"P4\b", {"name": "Tesla P4", "fp32": 5.5, "fp16": 0.09, "bandwidth": 192}),
    (r"T4\b", {"name": "Tesla T4", "fp32": 8.1, "fp16": 65.0, "bandwidth": 320}),
    (r"V100", {"name": "Tesla V100 (SXM2)", "fp32": 15.7, "fp16": 125.0, "bandwidth": 900}),
    (r"A100", {"name": "A100 (40 GB)", "fp32": 19.5, "fp16": 312.0, "bandwidth": 1555}),
    (r"H200", {"name": "H200 (SXM)", "fp32": 67.0, "fp16": 989.0, "bandwidth": 4800}),
    (r"H100", {"name": "H100 (SXM)", "fp32": 67.0, "fp16": 989.0, "bandwidth": 3350}),
]
# The card the P40 record ran on (docs/gpu-runs/p40-1x.json: "gpu": "NVIDIA H100 80GB HBM3", the SXM card; TF32 off).
CALIBRATION_CARD = "H100"

# Model shapes by the model directory's name: Qwen2.5-0.5B-Instruct's config.json (Hugging Face model card); the
# parameter count is the GPU record's (docs/gpu-runs/p40-1x.json, model.parameters). Embeddings are tied.
MODELS = {
    "Qwen2.5-0.5B-Instruct": {
        "parameters": 494032768,
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "head_dim": 64,
        "vocab": 151936,
    },
}

# Efficiencies calibrated by `calibrate` on docs/gpu-runs/p40-1x.json (fp32, TF32 off, H100): the share of the
# card's fp32 rate each training phase reached, the share of its bandwidth a decode step's traffic reached, and the
# host's time per decode step that neither explains (kernel launches and Python in HF generate), assumed the same
# on every host.
EFFICIENCY = {
    "old_log_prob": 0.524,
    "values": 0.535,
    "update_critic": 0.320,
    "update_actor": 0.391,
}
DECODE = {"memory_efficiency": 0.686, "host_seconds": 0.0191}
BYTES_PER_PARAMETER = 4
PPO_EPOCHS = 1


def find_card(gpu_name):
    for pattern, card in CARDS:
        if re.search(pattern, str(gpu_name or "")):
            return card
    return None


def model_of(model_path):
    return MODELS.get(str(model_path or "").rstrip("/").rsplit("/", 1)[-1])


def _kv_traffic_factor(model):
    """Traffic of one sequence's KV cache per decode step under eager attention, in multiples of the cache: read and
    rewritten by DynamicCache's torch.cat (2), read by repeat_kv, which writes a copy per query head that the two
    attention matmuls read again (1 + 2 x heads / kv_heads)."""
    return 2 + 1 + 2 * model["heads"] / model["kv_heads"]


def token_flops(model, context, head=True):
    """Forward FLOPs per token: the matmuls (2 per parameter; the critic has no LM head) and the eager attention's
    scores and weighted sum over `context` positions."""
    matmul = 2 * model["parameters"] - (0 if head else 2 * model["vocab"] * model["hidden"])
    return matmul + 4 * model["layers"] * context * model["heads"] * model["head_dim"]


def work(model, batch, prompt, response, rollout_micro, world_size=1):
    """What one PPO step does per GPU: FLOPs of each training phase, and generation's micro batches, decode steps
    and bytes per decode step. Sequences are padded (use_remove_padding is off): every one is prompt + response."""
    length = prompt + response
    tokens = batch * length / world_size
    actor, critic = token_flops(model, length), token_flops(model, length, head=False)
    per_gpu = math.ceil(batch / world_size)
    micro = max(1, min(rollout_micro, per_gpu))
    context = prompt + response / 2
    kv = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * context * BYTES_PER_PARAMETER
    return {
        "flops": {
            "old_log_prob": actor * tokens,
            "values": critic * tokens,
            "update_critic": 3 * critic * tokens * PPO_EPOCHS,
            "update_actor": 3 * actor * tokens * PPO_EPOCHS,
        },
        "prefill_flops": token_flops(model, prompt) * per_gpu * prompt,
        "generate_calls": math.ceil(per_gpu / micro),
        "decode_steps": response,
        "decode_bytes": model["parameters"] * BYTES_PER_PARAMETER + micro * kv * _kv_traffic_factor(model),
    }


def generation_seconds(model, card, prompts, prompt, response, rollout_micro, world_size=1):
    """Seconds to generate `response` tokens for `prompts` prompts spread over the GPUs (hf rollout)."""
    w = work(model, prompts, prompt, response, rollout_micro, world_size)
    step = DECODE["host_seconds"] + w["decode_bytes"] / (card["bandwidth"] * 1e9 * DECODE["memory_efficiency"])
    prefill = w["prefill_flops"] / (card["fp32"] * 1e12 * EFFICIENCY["old_log_prob"])
    return prefill + w["generate_calls"] * w["decode_steps"] * step


def step_phases(model, card, batch, prompt, response, rollout_micro, world_size=1):
    """Estimated seconds of each phase of one PPO step (fp32 training)."""
    w = work(model, batch, prompt, response, rollout_micro, world_size)
    phases = {"gen": generation_seconds(model, card, batch, prompt, response, rollout_micro, world_size)}
    for phase, flops in w["flops"].items():
        phases[phase] = flops / (card["fp32"] * 1e12 * EFFICIENCY[phase])
    return phases


def calibrate(record, shape):
    """The efficiencies above, from a GPU record of a full-batch and a smoke run (timing_s/* of their last step) of
    a rendering of `shape` ({batch, smoke_batch, prompt, response, rollout_micro})."""
    card = find_card(record["gpu"])
    model = dict(MODELS["Qwen2.5-0.5B-Instruct"], parameters=record["model"]["parameters"])
    full, smoke = record["runs"]["full_batch"], record["runs"]["smoke"]
    w = work(model, shape["batch"], shape["prompt"], shape["response"], shape["rollout_micro"])
    metrics = full["last_metrics"]
    out = {phase: flops / (card["fp32"] * 1e12) / metrics[f"timing_s/{phase}"] for phase, flops in w["flops"].items()}
    # Two decode runs (the smoke's one small generate call, the full batch's several larger ones) fix the host's time
    # per decode step and the bandwidth share; the prefill is taken at old_log_prob's efficiency.
    runs = []
    for run, batch in ((smoke, shape["smoke_batch"]), (full, shape["batch"])):
        g = work(model, batch, shape["prompt"], shape["response"], shape["rollout_micro"])
        prefill = g["prefill_flops"] / (card["fp32"] * 1e12 * out["old_log_prob"])
        per_step = (run["last_metrics"]["timing_s/gen"] - prefill) / (g["generate_calls"] * g["decode_steps"])
        runs.append((g["decode_bytes"], per_step))
    (small_bytes, small_step), (big_bytes, big_step) = runs
    seconds_per_byte = (big_step - small_step) / (big_bytes - small_bytes)
    out["memory_efficiency"] = 1 / (seconds_per_byte * card["bandwidth"] * 1e9)
    out["host_seconds"] = small_step - small_bytes * seconds_per_byte
    return out


def schedule(settings, run):
    """Steps, validations and checkpoints of a run of the rendered settings (verl drops a last partial batch)."""
    steps = run["total_epochs"] * (run["train_rows"] // run["train_batch_size"])
    test_freq = run["test_freq"]
    # Before the first step (val_before_train), every test_freq steps, and at the last step.
    validations = (1 + steps // test_freq + (1 if steps % test_freq else 0)) if test_freq > 0 else 0
    save_freq = settings["save_freq"]
    saves = (steps // save_freq + (1 if steps % save_freq else 0)) if save_freq > 0 else 0
    model = model_of(run["model_path"])
    # Actor and critic: fp32 parameters and Adam's two moments each (12 bytes a parameter).
    checkpoint_bytes = 2 * 12 * model["parameters"] if model else None
    kept = min(run["checkpoints_kept"], saves) if run["checkpoints_kept"] > 0 else saves
    return {
        "steps": steps,
        "validations": validations,
        "saves": saves,
        "kept": kept,
        "checkpoint_gib": round(checkpoint_bytes / 2**30, 1) if checkpoint_bytes else None,
        "disk_gib": round(kept * checkpoint_bytes / 2**30, 1) if checkpoint_bytes else None,
    }


def _count(n, noun):
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _duration(seconds):
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 60:.0f} minutes"


def launch_script_estimate(profile, settings, run):
    """{schedule, estimate (None where no model or card is known), why, lines}: the lines --print shows."""
    profile = profile if isinstance(profile, dict) else {}
    plan = schedule(settings, run)
    card, model = find_card(profile.get("gpu_name")), model_of(run["model_path"])
    lines = [
        f"schedule: {_count(plan['steps'], 'step')} ({_count(run['total_epochs'], 'epoch')} of "
        f"{run['train_rows']} rows at {run['train_batch_size']}), "
        f"{_count(plan['validations'], 'validation')} of {run['test_rows']} rows, "
        f"a checkpoint every {settings['save_freq']} steps and at the last: {plan['saves']} saved, "
        f"the last {plan['kept']} kept"
        + (f" ({plan['checkpoint_gib']} GiB each, {plan['disk_gib']} GiB on disk)" if plan["disk_gib"] else "")
    ]
    why = ""
    if settings.get("world_size", 0) < 1:
        why = "no GPU in the profile"
    elif not card:
        why = f"no datasheet figures for {profile.get('gpu_name') or 'this GPU'}"
    elif not model:
        why = f"no shape known for the model {run['model_path']}"
    elif settings.get("rollout_name") != "hf" or settings.get("use_remove_padding"):
        why = "the cost model covers the hf rollout on padded sequences only"
    elif settings.get("param_dtype") != "fp32":
        why = "the cost model is calibrated on fp32 training only"
    estimate = None
    if why:
        lines.append(f"estimate: none ({why}); a smoke run (--smoke) measures seconds per step")
    else:
        world = settings["world_size"]
        args = (run["max_prompt_length"], run["max_response_length"], settings["rollout_micro"], world)
        phases = step_phases(model, card, run["train_batch_size"], *args)
        step = sum(phases.values())
        validation = generation_seconds(model, card, run["test_rows"], *args)
        total = plan["steps"] * step + plan["validations"] * validation
        estimate = {
            "card": card["name"],
            "phases": {k: round(v, 1) for k, v in phases.items()},
            "step_seconds": round(step, 1),
            "validation_seconds": round(validation, 1),
            "total_seconds": round(total),
        }
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
        lines += [
            f"estimate for {world}x {card['name']}, from a cost model on its datasheet's fp32 rate and bandwidth "
            f"calibrated on an {CALIBRATION_CARD} (docs/estimate.md): {step / 60:.1f} minutes a step ({parts}), "
            f"{validation / 60:.1f} minutes a validation, {_duration(total)} in all",
            "a smoke run (--smoke) measures this host's seconds per step, and p40fleet report then shows that instead",
        ]
    return {"schedule": plan, "estimate": estimate, "why": why, "lines": lines}


class FilterModule:
    def filters(self):
        return {"launch_script_estimate": launch_script_estimate}

"""launch_script's decisions: the launch settings, a run's settings digest, a smoke run's verdict (playbooks/smoke.yml).

`profile | launch_script_settings(inputs)` turns gpu_preflight's profile and the role's variables (`inputs`: their
names less the `launch_script_` prefix) into the values the script renders: the memory tier is the one of
`memory_tiers` (launch_script_memory_tiers) the profile's memory per GPU reaches, and an empty variable takes the
tier's or the profile's value (test_launch_script_settings.py holds the table).

`overrides | launch_script_run_digest(schedule_keys)` is 8 hex digits of sha256 over the overrides that change
what a run trains (every override whose key is not a schedule key, in order): a run's name carries it, so verl's
automatic resume never picks up a checkpoint of other settings (test_launch_script.py). The smoke verdict is
table-tested in test_launch_script_smoke.py.

The batch rules (what verl 0.4.1 asserts about a world size, and the smallest sizes that pass) have their one home
in plugins/plugin_utils/verl_batches.py: `launch_script_settings` applies them to a host's GPUs, ray_cluster's
filter (plugins/filter/ray_cluster.py, ray_cluster_batches) to a cluster's ranks.

The output comes from a run as the env owner: it is data, read strictly. Only the typed fields below are kept,
strings are cut short, and a run counts as passed only when the script exited 0 and its own summary says every
step ran, it validated, saved and resumed (the script's helper, files/launch_script_smoke.py, decides that from
verl's logs and the checkpoint directory).
"""

import hashlib
import json
import re

from ansible_collections.p40fleet.fleet.plugins.plugin_utils.verl_batches import (
    BATCH_MINIMUMS,
    BATCH_MODES,
    judge_batches,
    worlds_that_split,
)

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


# FSDP parameter precision per profile dtype. Volta and Turing (float16) train with fp32 parameters:
# verl 0.4.1/0.5.0 FSDP training has no gradient scaler (dp_actor.py calls a bare loss.backward(),
# 0.4.1 verl/workers/actor/dp_actor.py:512, 0.5.0 :470; dp_critic.py 0.4.1 :255, 0.5.0 :240; no
# GradScaler anywhere in verl/), so fp16 parameters risk silent gradient underflow. fp16 FSDP training
# with a scaler arrives in verl 0.6.1 (PR #4036, docs/facts.md).
PARAM_DTYPE_BY_PROFILE_DTYPE = {"float32": "fp32", "float16": "fp32", "bfloat16": "bf16"}
# Ansible's `bool` filter's words (ansible.plugins.filter.core); anything else is a problem, not a guess.
TRUE_WORDS = {"true", "yes", "on", "1"}
FALSE_WORDS = {"false", "no", "off", "0"}


def _given(value):
    """Whether a variable that may be left empty was set ("" = derive it; false and 0 are settings)."""
    return value is not None and str(value) != ""


def _as_bool(value, name, problems):
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    problems.append(f"launch_script_{name} is {value!r}: true or false wanted")
    return False


def _as_number(value, name, problems, kind=int):
    if not isinstance(value, bool):
        try:
            number = kind(str(value).strip())
            if number >= 0:
                return number
        except ValueError:
            pass
    problems.append(f"launch_script_{name} is {value!r}: a {'whole ' if kind is int else ''}number >= 0 wanted")
    return kind(0)


def _as_freq(value, name, problems):
    """A step count, or -1: verl's "never" (no periodic validation)."""
    if str(value).strip() == "-1":
        return -1
    found = []
    number = _as_number(value, name, found)
    problems.extend(f"{problem} (or -1: never)" for problem in found)
    return number


def _judged_batches(world, batches, mode, gpus):
    """The run's and --smoke's batch sizes as verl splits them at `world` ranks (judge_batches, in `mode`), with
    the note of what was derived and why, or the refusal naming the GPU counts per node that work."""
    nnodes = world // gpus if gpus else 1
    shape = f"{gpus} GPU(s)" + (f" x {nnodes} nodes = {world} ranks" if nnodes > 1 else "")
    run = judge_batches(world, batches, mode)
    # --smoke's batch: two micro batches per GPU, the train batch one mini batch, judged by the same rules (at the
    # run's validation batch, which --smoke keeps).
    smoke_size = 2 * batches["ppo_micro_batch_size_per_gpu"] * max(world, 1)
    smoke_input = {
        **batches,
        "train_batch_size": smoke_size,
        "ppo_mini_batch_size": smoke_size,
        "val_batch_size": run["val_batch_size"],
    }
    smoke = judge_batches(world, smoke_input, mode)
    notes, faults = [], []
    if run["why"]:
        faults.append(run["why"])
        notes.append(", ".join(run["changed"]))
    if smoke["why"]:
        faults.append(f"--smoke's batch of {smoke_size}: {smoke['why']}")
        notes.append("--smoke's " + ", ".join(smoke["changed"]))
    note = refusal = ""
    if faults and mode == "derive":
        note = f"{shape}: {'; '.join(faults)}; derived (launch_script_batch_sizes: derive): {'; '.join(notes)}"
    elif faults:
        counts = range(1, max(gpus, 8) + 1)
        fits = [w // nnodes for w in worlds_that_split([k * nnodes for k in counts], batches)]
        refusal = (
            f"{shape}, which verl cannot split: {'; '.join(faults)}. GPU counts per node that train with these batch "
            f"sizes: {', '.join(map(str, fits)) or 'none up to 8'}. Train on those (launch_script_gpus_per_node and "
            f"launch_script_cuda_visible_devices), set launch_script_train_batch_size / "
            f"launch_script_ppo_mini_batch_size, or set launch_script_batch_sizes: derive to train with the smallest "
            f"sizes that split"
        )
    return {
        "train_batch_size": run["train_batch_size"],
        "ppo_mini_batch_size": run["ppo_mini_batch_size"],
        "val_batch_size": run["val_batch_size"],
        "smoke_batch": smoke["train_batch_size"],
        "smoke_mini_batch": smoke["ppo_mini_batch_size"],
        "batch_note": note,
        "batch_refusal": refusal,
    }


def memory_tier(memory_mib, tiers):
    """The tier of `tiers` with the largest min_memory_mib not above `memory_mib` (MiB per GPU); {} where none is."""
    fits = [t for t in tiers or [] if isinstance(t, dict) and int(t.get("min_memory_mib", 0)) <= int(memory_mib or 0)]
    return max(fits, key=lambda t: int(t.get("min_memory_mib", 0))) if fits else {}


def launch_script_settings(profile, inputs):
    """The launch settings from the profile, its memory tier and the role's inputs (empty = derived).

    The tier is the one of the inputs' memory_tiers that the profile's memory_mib reaches (memory_tier). Returns
    {gpus, world_size, visible_devices, micro, log_prob_micro, rollout_micro, param_offload, actor_param_offload,
    optimizer_offload, gpu_memory_utilization, rollout_name, rollout_dtype, param_dtype, use_torch_compile,
    use_remove_padding, train_batch_size, ppo_mini_batch_size, val_batch_size, save_freq, test_freq, smoke_batch,
    smoke_mini_batch, batch_note, batch_refusal, tier_refusal, problems}: problems lists inputs that are no setting
    (roles/launch_script/tasks/inputs.yml stops with them). The batch sizes are the ones verl can split across the
    world size (judge_batches): derived where the inputs do not split (batch_sizes derive, said in batch_note), or
    kept and refused (refuse, batch_refusal names the GPU counts that work)."""
    profile = profile if isinstance(profile, dict) else {}
    tier = memory_tier(profile.get("memory_mib", 0), inputs.get("memory_tiers"))
    problems = []

    def pick(name, fallback, convert):
        value = inputs.get(name, "")
        return convert(value if _given(value) else fallback, name, problems)

    def number(value, name, problems):
        return _as_number(value, name, problems)

    def flag(value, name, problems):
        return _as_bool(value, name, problems)

    def batch(value, name, problems):
        """A batch size: at least BATCH_MINIMUMS' (verl and the batch rules divide by it); 1 where it is less."""
        found = len(problems)
        size = _as_number(value, name, problems)
        if size < BATCH_MINIMUMS[name] and len(problems) == found:
            problems.append(f"launch_script_{name} is {size}: at least {BATCH_MINIMUMS[name]} wanted")
        return max(size, BATCH_MINIMUMS[name])

    gpus = pick("gpus_per_node", profile.get("gpu_count", 0), number)
    world_size = gpus * _as_number(inputs.get("nnodes", 1), "nnodes", problems)
    micro = pick("ppo_micro_batch_size_per_gpu", tier.get("ppo_micro_batch_size_per_gpu", 1), batch)
    rollout_micro = pick("rollout_micro_batch_size", tier.get("rollout_micro_batch_size", 8), batch)
    rollout_name = inputs.get("rollout_name") or (
        profile.get("rollout_name", "hf")
        if _as_bool(inputs.get("vllm_installed", False), "vllm_installed", problems)
        else "hf"
    )
    # FSDP on one GPU shards nothing, so a single-GPU host offloads parameters whatever its tier unless told.
    param_offload = pick("param_offload", tier.get("param_offload", True), flag) or (
        not _given(inputs.get("param_offload", ""))
        and _as_bool(inputs.get("single_gpu_param_offload", True), "single_gpu_param_offload", problems)
        and world_size == 1
    )
    mode = str(inputs.get("batch_sizes") or "derive")
    if mode not in BATCH_MODES:
        problems.append(f"launch_script_batch_sizes is {mode!r}: one of {', '.join(BATCH_MODES)} wanted")
        mode = "refuse"
    batches = _judged_batches(
        world_size,
        {
            "train_batch_size": batch(inputs.get("train_batch_size", 1), "train_batch_size", problems),
            "ppo_mini_batch_size": batch(inputs.get("ppo_mini_batch_size", 1), "ppo_mini_batch_size", problems),
            "ppo_micro_batch_size_per_gpu": micro,
            # Only the hf rollout cuts a rank's share into generate calls.
            "rollout_micro_batch_size": rollout_micro if rollout_name == "hf" else 0,
            # One hf generate call per rank: any test set splits into it (vars/main.yml says why a whole-set batch
            # can't).
            "val_batch_size": (
                batch(inputs["val_batch_size"], "val_batch_size", problems)
                if _given(inputs.get("val_batch_size"))
                else rollout_micro * world_size
            ),
        },
        mode,
        gpus,
    )
    train_batch = batches["train_batch_size"]
    rows = _as_number(inputs.get("train_rows", 0), "train_rows", problems)
    refusals = tier.get("refuse") or {}
    allow_refused = _as_bool(inputs.get("allow_refused_tier", False), "allow_refused_tier", problems)
    # Steps an epoch: verl's train dataloader drops the last partial batch.
    epoch_steps = max(1, rows // train_batch) if train_batch else 1
    return {
        "gpus": gpus,
        "world_size": world_size,
        "visible_devices": inputs.get("cuda_visible_devices") or profile.get("cuda_visible_devices", ""),
        "micro": micro,
        "log_prob_micro": pick(
            "log_prob_micro_batch_size_per_gpu", tier.get("log_prob_micro_batch_size_per_gpu", 1), batch
        ),
        "rollout_micro": rollout_micro,
        "param_offload": param_offload,
        # The hf rollout generates with the actor's FSDP module as it is: verl 0.4.1/0.5.0 offload the actor at
        # init (verl/workers/fsdp_workers.py:542) and only the vLLM/SGLang sharding managers load it back, so
        # generate_sequences meets parameters on the CPU (`Expects tensor to be on the compute device`,
        # FSDP.summon_full_params). Under hf the actor keeps its parameters on the GPU; the critic's parameters and
        # both optimizers still offload.
        "actor_param_offload": param_offload and rollout_name != "hf",
        "optimizer_offload": pick("optimizer_offload", tier.get("optimizer_offload", True), flag),
        "gpu_memory_utilization": pick(
            "gpu_memory_utilization",
            tier.get("gpu_memory_utilization", 0.3),
            lambda v, n, p: _as_number(v, n, p, float),
        ),
        "rollout_name": rollout_name,
        "rollout_dtype": inputs.get("rollout_dtype") or profile.get("dtype", ""),
        "param_dtype": inputs.get("param_dtype")
        or PARAM_DTYPE_BY_PROFILE_DTYPE.get(profile.get("dtype", "float32"), "fp32"),
        "use_torch_compile": pick("use_torch_compile", profile.get("torch_compile", False), flag),
        # Packed sequences rely on FlashAttention-2's varlen path.
        "use_remove_padding": pick(
            "use_remove_padding", profile.get("attn_implementation", "") == "flash_attention_2", flag
        ),
        **batches,
        # One checkpoint an epoch, and one at the last step.
        "save_freq": pick("save_freq", epoch_steps, number),
        # One validation an epoch too (and verl's before step 1 and at the last step).
        "test_freq": pick("test_freq", epoch_steps, _as_freq),
        # Why this card cannot train the default model (launch_script_memory_tiers); empty = it can.
        "tier_refusal": "" if allow_refused else refusals.get(profile.get("dtype", "float32"), ""),
        "problems": problems,
    }


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
            "launch_script_settings": launch_script_settings,
        }

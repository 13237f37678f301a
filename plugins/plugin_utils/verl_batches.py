"""What verl 0.4.1 asserts about a world size, and the smallest batch sizes that pass: the one home of that fact.

launch_script's filter (plugins/filter/launch_script.py, launch_script_settings) applies these rules to a host's
GPUs, ray_cluster's (plugins/filter/ray_cluster.py, ray_cluster_batches) to a cluster's ranks; both import them
as ansible_collections.p40fleet.fleet.plugins.plugin_utils.verl_batches. Standard library only.
"""

# --- What verl 0.4.1 asserts about a world size (python/tests/test_launch_script_batches.py) ---
# The checks a job would otherwise meet at start-up, each with the line of verl that makes it; tests/cpu/
# startup_checks.py runs those lines of verl on a CPU against the renderings for 1 to 8 GPUs.
VERL_SPLITS = {
    "train": "verl/trainer/ppo/ray_trainer.py:377, verl/protocol.py:662",
    "mini": "verl/workers/fsdp_workers.py:156-166",
    "rollout": "verl/workers/rollout/hf_rollout.py:47-48",
    "val": "verl/trainer/ppo/ray_trainer.py:649, verl/workers/rollout/hf_rollout.py:47-48",
}
BATCH_MODES = ("refuse", "derive")
BATCH_KEYS = ("train_batch_size", "ppo_mini_batch_size", "val_batch_size")
# The least each batch size input may be (less is refused: verl and the rules below divide by them). The one home of
# these ranges: p40fleet's check before contact (python/p40fleet/inputs.py) reads them from this file.
BATCH_MINIMUMS = {
    "train_batch_size": 1,
    "ppo_mini_batch_size": 1,
    "val_batch_size": 1,
    "ppo_micro_batch_size_per_gpu": 1,
    "log_prob_micro_batch_size_per_gpu": 1,
    "rollout_micro_batch_size": 1,
}


def _hf_chunks_split(share, rollout_micro):
    """HFRollout.generate_sequences: max(share // micro, 1) chunks of one size (DataProto.chunk asserts it)."""
    if not rollout_micro or share < 1:
        return True
    return share % max(share // rollout_micro, 1) == 0


def batch_faults(world, batches):
    """What verl would refuse about `batches` at `world` ranks: [(check, reason)], empty when it runs.

    batches: {train_batch_size, ppo_mini_batch_size, ppo_micro_batch_size_per_gpu, rollout_micro_batch_size
    (0 when the rollout is not hf), val_batch_size, rollout_n (default 1)}."""
    n = int(batches.get("rollout_n", 1) or 1)
    train, mini = int(batches["train_batch_size"]), int(batches["ppo_mini_batch_size"])
    micro, rollout_micro = (
        int(batches["ppo_micro_batch_size_per_gpu"]),
        int(batches.get("rollout_micro_batch_size") or 0),
    )
    val = int(batches.get("val_batch_size") or 0)
    faults = []
    if (train * n) % world:
        faults.append(("train", f"train_batch_size {train} does not split across {world} ranks"))
    normalized = mini * n // world
    if normalized < 1 or normalized % micro:
        faults.append(
            (
                "mini",
                f"ppo_mini_batch_size {mini} // {world} ranks = {normalized}, "
                f"not a multiple of ppo_micro_batch_size_per_gpu {micro}",
            )
        )
    if not (train * n) % world and not _hf_chunks_split(train // world, rollout_micro):
        faults.append(
            ("rollout", f"each rank's {train // world} prompts do not cut into generate calls of {rollout_micro}")
        )
    if val and not _hf_chunks_split(-(-val // world), rollout_micro):
        faults.append(
            (
                "val",
                f"val_batch_size {val} gives each of {world} ranks {-(-val // world)} prompts, which do not cut "
                f"into generate calls of {rollout_micro}",
            )
        )
    return faults


def derived_batches(world, batches):
    """The smallest batch sizes at or above the configured ones that verl runs at `world` ranks: the mini batch a
    multiple of world x micro, the train batch a multiple of the mini batch (each update a whole mini batch), the
    validation batch one generate call per rank where the configured one does not split."""
    n = int(batches.get("rollout_n", 1) or 1)
    micro = int(batches["ppo_micro_batch_size_per_gpu"])
    mini = int(batches["ppo_mini_batch_size"])
    while (mini * n // world) < 1 or (mini * n // world) % micro or (mini * n) % world:
        mini += 1
    train = max(int(batches["train_batch_size"]), mini)
    train = -(-train // mini) * mini
    derived = {**batches, "ppo_mini_batch_size": mini, "train_batch_size": train}
    # A share that is a whole number of generate calls always cuts evenly: found within that many steps.
    for _ in range(int(batches.get("rollout_micro_batch_size") or 0) + 1):
        if not any(check == "rollout" for check, _ in batch_faults(world, derived)):
            break
        train += mini
        derived["train_batch_size"] = train
    if any(c == "val" for c, _ in batch_faults(world, derived)):
        derived["val_batch_size"] = int(batches.get("rollout_micro_batch_size") or 1) * world
    return derived


def worlds_that_split(worlds, batches):
    """The world sizes among `worlds` at which verl runs `batches`, the validation batch at its default (one generate
    call per rank, which splits at any world size)."""
    unvalidated = {**batches, "val_batch_size": 0}
    return [w for w in worlds if not batch_faults(w, unvalidated)]


def judge_batches(world, batches, mode):
    """`batches` as verl runs them at `world` ranks: {train_batch_size, ppo_mini_batch_size, val_batch_size,
    derived: bool, why: what verl would assert ('' when they split), changed: ['key old -> new']}. Mode derive
    replaces sizes that do not split by the smallest that do; refuse keeps them (the caller refuses with `why`)."""
    if mode not in BATCH_MODES:
        raise ValueError(f"batch sizes mode {mode!r} is not one of {', '.join(BATCH_MODES)}")
    result = {k: int(batches.get(k) or 0) for k in BATCH_KEYS}
    result.update(derived=False, why="", changed=[])
    faults = batch_faults(world, batches) if world >= 1 else []
    result["why"] = "; ".join(f"{reason} (verl asserts it at {VERL_SPLITS[check]})" for check, reason in faults)
    if faults and mode == "derive":
        derived = {k: int(v or 0) for k, v in derived_batches(world, batches).items() if k in BATCH_KEYS}
        result["changed"] = [f"{k} {result[k]} -> {derived[k]}" for k in BATCH_KEYS if derived[k] != result[k]]
        result.update(derived, derived=True)
    return result

"""ray_cluster's judgement of a cluster job's batch sizes at its world size, table-tested without hosts: verl
0.4.1's batch rules (plugins/plugin_utils/verl_batches.py, whose table is
test_launch_script_batches.py) applied to the cluster's ranks, the refusal that names the node counts that work, the
sizes derived instead, and launch_script_environment names that verl's ray.init or the job sets again."""

from __future__ import annotations

import re

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_batches")
# The rules' home (plugins/plugin_utils), whose table is test_launch_script_batches.py.
BATCH_RULES = load_module(REPO_ROOT / "plugins" / "plugin_utils" / "verl_batches.py", "ray_cluster_batch_rules")
# Batch sizes of a P40 launch script (micro 4 and hf generate calls of 64: the 24 GB tier before the sweep), the
# validation batch one generate call per rank. The table holds the rules, not the defaults.
P40 = {"train_batch_size": 256, "ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 4}


def sizes(world, **changes):
    return {**P40, "rollout_micro_batch_size": 64, "val_batch_size": 64 * world, **changes}


def plan(nnodes, gpus=1):
    members = [f"n{i}" for i in range(1, nnodes + 1)]
    return {"cluster": "demo", "head": "n1", "members": members, "nnodes": nnodes, "gpus_per_node": gpus}


def test_three_ranks_are_refused_naming_the_members_and_the_node_counts_that_work():
    judged = RULES.ray_cluster_batches(plan(3), sizes(3))
    assert judged["world"] == 3 and not judged["derived"]
    assert judged["refusal"].startswith("cluster demo (n1, n2, n3): 3 node(s) x 1 GPU(s) = 3 ranks, which verl cannot")
    assert (
        "train_batch_size 256 does not split across 3 ranks (verl asserts it at verl/trainer/ppo/ray_trainer.py:377"
        in (judged["refusal"])
    )
    assert (
        "ppo_mini_batch_size 64 // 3 ranks = 21, not a multiple of ppo_micro_batch_size_per_gpu 4" in judged["refusal"]
    )
    counts = re.search(r"Node counts of 1 GPU\(s\) that train with these batch sizes: ([^.]*)\.", judged["refusal"])
    assert counts.group(1) == "1 (1 ranks), 2 (2 ranks), 4 (4 ranks), 8 (8 ranks)"
    assert "ray_cluster_batch_sizes: derive" in judged["refusal"]
    # The sizes it trains with are the configured ones: nothing derived behind the refusal.
    assert (judged["train_batch_size"], judged["ppo_mini_batch_size"]) == (256, 64)


def test_node_counts_that_work_are_counted_in_gpus_per_node():
    judged = RULES.ray_cluster_batches(plan(3, gpus=2), sizes(6))
    assert "3 node(s) x 2 GPU(s) = 6 ranks" in judged["refusal"]
    assert "1 (2 ranks), 2 (4 ranks), 4 (8 ranks), 8 (16 ranks)." in judged["refusal"]


@pytest.mark.parametrize(
    ("nnodes", "gpus", "changes", "want"),
    [
        (3, 1, {}, (288, 72, 192)),
        (5, 1, {}, (320, 80, 320)),  # 80 // 5 = 16; 320 = 4 mini batches
        (6, 1, {}, (288, 72, 384)),
        (7, 1, {}, (336, 84, 448)),
        (3, 1, {"val_batch_size": 393}, (288, 72, 192)),  # 131 per rank in 2 calls: one call per rank instead
        (32, 1, {}, (256, 128, 2048)),  # the mini batch grows to one micro batch per rank
        # 96 per rank in 96 // 19 = 5 calls does not cut: 120 per rank, 6 calls; validation 64 per rank in 3 neither
        (3, 1, {"rollout_micro_batch_size": 19}, (360, 72, 57)),
    ],
)
def test_derived_sizes_split(nnodes, gpus, changes, want):
    world = nnodes * gpus
    batches = sizes(world, **changes)
    judged = RULES.ray_cluster_batches(plan(nnodes, gpus), batches, "derive")
    got = (judged["train_batch_size"], judged["ppo_mini_batch_size"], judged["val_batch_size"])
    assert got == want
    assert judged["derived"] and not judged["refusal"]
    assert judged["note"].startswith(f"cluster demo ({', '.join(plan(nnodes)['members'])}): ")
    assert "derived (ray_cluster_batch_sizes: derive): " in judged["note"]
    again = {**batches, "train_batch_size": got[0], "ppo_mini_batch_size": got[1], "val_batch_size": got[2]}
    assert BATCH_RULES.batch_faults(world, again) == []


def test_sizes_that_split_are_kept_in_either_mode():
    for mode in ("refuse", "derive"):
        judged = RULES.ray_cluster_batches(plan(2), sizes(2), mode)
        assert (judged["train_batch_size"], judged["ppo_mini_batch_size"], judged["val_batch_size"]) == (256, 64, 128)
        assert not judged["derived"] and judged["note"] == judged["refusal"] == ""


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="ray_cluster_batch_sizes is 'guess'; it is one of refuse, derive"):
        RULES.ray_cluster_batches(plan(2), sizes(2), "guess")


VERL_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "VLLM_LOGGING_LEVEL": "WARN"}
JOB = ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]


@pytest.mark.parametrize(
    ("environment", "parts"),
    [
        ({}, []),
        ({"WANDB_MODE": "offline", "NCCL_IB_DISABLE": "1"}, []),
        (
            {"NCCL_DEBUG": "INFO"},
            ["launch_script_environment sets NCCL_DEBUG: verl's own ray.init sets NCCL_DEBUG=WARN", "Remove it"],
        ),
        (
            {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "INFO", "X": "1"},
            [
                "sets TOKENIZERS_PARALLELISM, VLLM_LOGGING_LEVEL:",
                "TOKENIZERS_PARALLELISM=true, VLLM_LOGGING_LEVEL=WARN",
            ],
        ),
        ({"NCCL_SOCKET_IFNAME": "eth1"}, ["the cluster's job sets NCCL_SOCKET_IFNAME for every node"]),
    ],
)
def test_environment_collisions(environment, parts):
    message = RULES.ray_cluster_env_collisions(environment, VERL_ENV, JOB)
    assert (message == "") == (not parts)
    for part in parts:
        assert part in message


def test_the_roles_list_is_verls_own():
    """The names ray_cluster refuses are the ones verl 0.4.1's main_ppo.py passes to ray.init, read from its wheel."""
    import zipfile

    import yaml

    from p40fleet_dev.paths import UPSTREAM_DIR

    with zipfile.ZipFile(sorted((UPSTREAM_DIR / "wheel").glob("verl-0.4.1-*.whl"))[0]) as wheel:
        source = wheel.read("verl/trainer/main_ppo.py").decode()
    line = next(x for x in source.splitlines() if "runtime_env=" in x and "env_vars" in x)
    verl = dict(re.findall(r'"(\w+)": "(\w+)"', line))
    listed = yaml.safe_load((REPO_ROOT / "roles" / "ray_cluster" / "vars" / "main.yml").read_text())
    assert listed["ray_cluster_verl_runtime_env"] == verl

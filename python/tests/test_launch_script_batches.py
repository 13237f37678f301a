"""verl 0.4.1's batch rules (plugins/filter/launch_script.py, their one home; ray_cluster's filter loads them) and the
launch settings they give a host of 1 to 8 GPUs, table-tested without hosts: what verl asserts before the first step
(the train batch split across ranks, ray_trainer.py:377 and protocol.py:662; the mini batch per rank a multiple of
the micro batch, fsdp_workers.py:156-166; each rank's share cut into equal hf generate calls, hf_rollout.py:47-48, for
training and validation), the sizes derived where they do not split (launch_script_batch_sizes: derive, the
default) and the refusal naming the GPU counts that work (refuse). test_cpu_verl.py runs verl's own checks on the
renderings; ray_cluster's use of the rules is test_ray_cluster_batches.py."""

from __future__ import annotations

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_batch_rules")
# Batch sizes of a P40 launch script (micro 4 and hf generate calls of 64: the 24 GB tier before the sweep), the
# validation batch one generate call per rank. The table holds the rules, not the defaults.
SIZES = {"train_batch_size": 256, "ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 4}


def sizes(world, **changes):
    return {**SIZES, "rollout_micro_batch_size": 64, "val_batch_size": 64 * world, **changes}


@pytest.mark.parametrize(
    ("world", "changes", "checks"),
    [
        (1, {}, []),
        (2, {}, []),
        (3, {}, ["train", "mini"]),
        (4, {}, []),
        (5, {}, ["train"]),  # 64 // 5 = 12 is a multiple of 4: only the train batch fails
        (6, {}, ["train", "mini"]),
        (7, {}, ["train", "mini"]),
        (8, {}, []),
        (32, {}, ["mini"]),  # 64 // 32 = 2 < micro 4
        (128, {}, ["mini"]),  # 64 // 128 = 0
        (2, {"rollout_micro_batch_size": 42}, ["rollout"]),  # 128 per rank in 128 // 42 = 3 calls
        (2, {"rollout_micro_batch_size": 0}, []),  # vLLM: no hf generate calls to cut
        (2, {"val_batch_size": 262}, ["val"]),  # 131 per rank in 2 calls
        (2, {"val_batch_size": 100}, []),  # 50 per rank: one call
        (4, {"rollout_n": 2, "ppo_mini_batch_size": 8}, []),  # 8 x 2 // 4 = 4
        (4, {"rollout_n": 1, "ppo_mini_batch_size": 8}, ["mini"]),  # 8 // 4 = 2
    ],
)
def test_faults(world, changes, checks):
    assert [check for check, _ in RULES.batch_faults(world, sizes(world, **changes))] == checks


def test_judge_keeps_sizes_that_split_and_says_why_it_changes_others():
    kept = RULES.judge_batches(4, sizes(4), "derive")
    assert (kept["derived"], kept["why"], kept["changed"]) == (False, "", [])
    refused = RULES.judge_batches(3, sizes(3), "refuse")
    assert not refused["derived"] and (refused["train_batch_size"], refused["ppo_mini_batch_size"]) == (256, 64)
    assert refused["why"].startswith(
        "train_batch_size 256 does not split across 3 ranks (verl asserts it at verl/trainer/ppo/ray_trainer.py:377"
    )
    derived = RULES.judge_batches(3, sizes(3), "derive")
    assert derived["changed"] == ["train_batch_size 256 -> 288", "ppo_mini_batch_size 64 -> 72"]
    assert derived["why"] == refused["why"]
    with pytest.raises(ValueError, match="batch sizes mode 'guess' is not one of refuse, derive"):
        RULES.judge_batches(3, sizes(3), "guess")

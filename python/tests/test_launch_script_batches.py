"""verl 0.4.1's batch rules (plugins/plugin_utils/verl_batches.py, their one home; the launch settings and
ray_cluster import them) and the
launch settings they give a host of 1 to 8 GPUs, table-tested without hosts: what verl asserts before the first step
(the train batch split across ranks, ray_trainer.py:377 and protocol.py:662; the mini batch per rank a multiple of
the micro batch, fsdp_workers.py:156-166; each rank's share cut into equal hf generate calls, hf_rollout.py:47-48, for
training and validation), the sizes derived where they do not split (launch_script_batch_sizes: derive, the
default) and the refusal naming the GPU counts that work (refuse). test_cpu_verl.py runs verl's own checks on the
renderings; ray_cluster's use of the rules is test_ray_cluster_batches.py."""

from __future__ import annotations

import re

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module
from tests.test_launch_script_settings import INPUTS, P40
from tests.test_launch_script_settings import settings as rendered_settings

RULES = load_module(REPO_ROOT / "plugins" / "plugin_utils" / "verl_batches.py", "launch_script_batch_rules")
ESTIMATE = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script_estimate.py", "launch_script_batch_estimate")
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


def p40(gpus, **changes):
    profile = {**P40, "gpu_count": gpus, "cuda_visible_devices": ",".join(map(str, range(gpus)))}
    return rendered_settings(profile, **changes)


KEYS = ("train_batch_size", "ppo_mini_batch_size", "val_batch_size", "smoke_batch", "smoke_mini_batch", "save_freq")
# A P40 host of 1 to 8 GPUs at the role's defaults (256 / 64, the 24 GB tier's micro batch 8 and hf generate calls of
# 256): (train, mini, validation, smoke train, smoke mini, save frequency = 7473 rows // train). The smoke batch (two
# micro batches per GPU) splits at every count; the run's grows at 3, 5, 6 and 7 to the smallest that splits.
HOSTS = [
    (1, (256, 64, 256, 16, 16, 29)),
    (2, (256, 64, 512, 32, 32, 29)),
    (3, (288, 72, 768, 48, 48, 25)),
    (4, (256, 64, 1024, 64, 64, 29)),
    (5, (320, 80, 1280, 80, 80, 23)),
    (6, (288, 96, 1536, 96, 96, 25)),
    (7, (336, 112, 1792, 112, 112, 22)),
    (8, (256, 64, 2048, 128, 128, 29)),
]


@pytest.mark.parametrize(("gpus", "want"), HOSTS)
def test_every_gpu_count_derives_sizes_verl_splits(gpus, want):
    got = p40(gpus)
    assert tuple(got[k] for k in KEYS) == want
    assert got["batch_refusal"] == "" and got["problems"] == []
    # What the script renders splits, the run's and the smoke's; the configured sizes only where nothing was derived.
    assert not RULES.batch_faults(gpus, batch_input(got))
    assert not RULES.batch_faults(
        gpus, {**batch_input(got), "train_batch_size": want[3], "ppo_mini_batch_size": want[4]}
    )
    configured = RULES.batch_faults(gpus, {**batch_input(got), "train_batch_size": 256, "ppo_mini_batch_size": 64})
    assert bool(configured) == ((want[0], want[1]) != (256, 64))
    if (want[0], want[1]) == (256, 64):
        assert got["batch_note"] == ""
    else:
        assert got["batch_note"] == (
            f"{gpus} GPU(s): train_batch_size 256 does not split across {gpus} ranks (verl asserts it at "
            f"{RULES.VERL_SPLITS['train']}); ppo_mini_batch_size 64 // {gpus} ranks = {64 // gpus}, not a multiple of "
            f"ppo_micro_batch_size_per_gpu 8 (verl asserts it at {RULES.VERL_SPLITS['mini']}); derived "
            f"(launch_script_batch_sizes: derive): train_batch_size 256 -> {want[0]}, ppo_mini_batch_size 64 -> "
            f"{want[1]}"
        )


def batch_input(got):
    return {
        "train_batch_size": got["train_batch_size"],
        "ppo_mini_batch_size": got["ppo_mini_batch_size"],
        "ppo_micro_batch_size_per_gpu": got["micro"],
        "rollout_micro_batch_size": got["rollout_micro"],
        "val_batch_size": got["val_batch_size"],
    }


@pytest.mark.parametrize(("gpus", "want"), HOSTS)
def test_refuse_keeps_the_sizes_and_names_the_counts_that_work(gpus, want):
    got = p40(gpus, batch_sizes="refuse")
    assert (got["train_batch_size"], got["ppo_mini_batch_size"], got["batch_note"]) == (256, 64, "")
    if (want[0], want[1]) == (256, 64):
        assert got["batch_refusal"] == ""
        return
    assert got["batch_refusal"].startswith(f"{gpus} GPU(s), which verl cannot split: train_batch_size 256 does not")
    counts = re.search(r"GPU counts per node that train with these batch sizes: ([^.]*)\.", got["batch_refusal"])
    assert counts.group(1) == "1, 2, 4, 8"
    assert "or set launch_script_batch_sizes: derive" in got["batch_refusal"]


def test_the_counts_named_are_counted_per_node_on_several_nodes():
    got = p40(3, nnodes=2, batch_sizes="refuse")
    assert got["batch_refusal"].startswith("3 GPU(s) x 2 nodes = 6 ranks, which verl cannot split")
    # 256 / 64 split at 2, 4 and 8 ranks (1, 2 and 4 GPUs on each of 2 nodes); 16 ranks get 4 each, under micro 8.
    assert "GPU counts per node that train with these batch sizes: 1, 2, 4." in got["batch_refusal"]


# The smoke batch by the same rules: micro 8 on one GPU is a smoke batch of 16, which hf generate calls of 5 cut into
# 16 // 5 = 3 unequal chunks, while the run's 240 cut into 48 calls of 5.
SMOKE_CUT = {"rollout_micro_batch_size": 5, "train_batch_size": 240}


def test_a_smoke_batch_that_does_not_split_is_derived_too():
    got = p40(1, **SMOKE_CUT)
    assert (got["train_batch_size"], got["smoke_batch"], got["smoke_mini_batch"]) == (240, 80, 16)
    assert got["batch_note"] == (
        "1 GPU(s): --smoke's batch of 16: each rank's 16 prompts do not cut into generate calls of 5 (verl asserts "
        f"it at {RULES.VERL_SPLITS['rollout']}); derived (launch_script_batch_sizes: derive): --smoke's "
        "train_batch_size 16 -> 80"
    )


def test_a_smoke_batch_that_does_not_split_is_refused_too():
    got = p40(1, batch_sizes="refuse", **SMOKE_CUT)
    assert got["smoke_batch"] == 16
    assert got["batch_refusal"].startswith("1 GPU(s), which verl cannot split: --smoke's batch of 16: each rank's 16")


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"batch_sizes": "guess"}, "launch_script_batch_sizes is 'guess': one of refuse, derive wanted"),
        ({"ppo_micro_batch_size_per_gpu": 0}, "launch_script_ppo_micro_batch_size_per_gpu is 0: at least 1 wanted"),
    ],
)
def test_a_mode_or_micro_batch_that_is_no_setting_is_a_problem(changes, problem):
    assert p40(3, **changes)["problems"] == [problem]


def test_the_role_derives_by_default():
    assert INPUTS["batch_sizes"] == "derive"


def test_the_schedule_counts_the_derived_train_batch():
    """--print's schedule and estimate take the settings' train batch (roles/launch_script/vars/main.yml)."""
    got = p40(3)
    run = {
        "train_batch_size": got["train_batch_size"],
        "max_prompt_length": 256,
        "max_response_length": 256,
        "total_epochs": 15,
        "train_rows": 7473,
        "test_rows": 1319,
        "test_freq": got["test_freq"],
        "checkpoints_kept": 2,
        "model_path": "/srv/models/Qwen2.5-0.5B-Instruct",
    }
    estimate = ESTIMATE.launch_script_estimate({**P40, "gpu_count": 3}, got, run)
    assert estimate["schedule"]["steps"] == 15 * (7473 // 288)
    wiring = (REPO_ROOT / "roles" / "launch_script" / "vars" / "main.yml").read_text()
    assert "'train_batch_size': launch_script_settings.train_batch_size," in wiring


def test_the_sandbox_host_of_three_p40s_gets_sizes_verl_splits():
    """The sandbox's 3-GPU P40 host (fixtures/standins/host/gpu_profiles.yml, p40x3) as preflight publishes it from
    the nvidia-smi stand-in's answers, through the launch settings: whatever its memory tier, sizes that split."""
    from tests.test_gpu_preflight_rules import ASSESS, sandbox_report
    from tests.test_gpu_preflight_rules import settings as preflight_settings

    verdict = ASSESS(sandbox_report("p40x3"), preflight_settings("p40x3", {}))
    assert verdict["errors"] == []
    profile = verdict["facts"]["gpu_preflight_profile"]
    assert (profile["gpu_count"], profile["memory_mib"], profile["cuda_visible_devices"]) == (3, 23040, "0,1,2")
    got = rendered_settings(profile)
    assert got["world_size"] == 3 and got["batch_refusal"] == "" and got["problems"] == []
    assert got["batch_note"].startswith("3 GPU(s): train_batch_size 256 does not split across 3 ranks")
    assert got["train_batch_size"] > 256 and not RULES.batch_faults(3, batch_input(got))
    smoke = {**batch_input(got), "train_batch_size": got["smoke_batch"], "ppo_mini_batch_size": got["smoke_mini_batch"]}
    assert not RULES.batch_faults(3, smoke)

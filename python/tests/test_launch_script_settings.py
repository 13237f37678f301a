"""The launch settings (plugins/filter/launch_script.py, `launch_script_settings`): what the
script renders from gpu_preflight's profile, the memory tier its memory per GPU reaches (launch_script_memory_tiers)
and the role's variables, as a table.

The renderings themselves (test_launch_script.py, test_gpu_records.py) show the role wires these values into the
overrides; here each rule is a row.
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import preflight_profile
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "launch_script"
FILTERS = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_settings_filters")
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
# The role's own defaults for the inputs the filter reads (vars/main.yml passes them under these names).
INPUTS = {
    name: DEFAULTS[f"launch_script_{name}"]
    for name in (
        "gpus_per_node",
        "nnodes",
        "cuda_visible_devices",
        "ppo_micro_batch_size_per_gpu",
        "log_prob_micro_batch_size_per_gpu",
        "rollout_micro_batch_size",
        "param_offload",
        "single_gpu_param_offload",
        "optimizer_offload",
        "gpu_memory_utilization",
        "rollout_name",
        "rollout_dtype",
        "param_dtype",
        "use_torch_compile",
        "use_remove_padding",
        "val_batch_size",
        "save_freq",
        "test_freq",
        "train_rows",
        "train_batch_size",
        "ppo_mini_batch_size",
        "batch_sizes",
        "allow_refused_tier",
        "memory_tiers",
    )
}
INPUTS["vllm_installed"] = False

P40 = preflight_profile("Tesla P40", "6.1", 24576, 1)
P40X2 = preflight_profile("Tesla P40", "6.1", 24576, 2)
P4 = preflight_profile("Tesla P4", "6.1", 7680, 1)
T4 = preflight_profile("Tesla T4", "7.5", 15360, 1)
V100 = preflight_profile("Tesla V100-SXM2-32GB", "7.0", 32768, 1)
A100 = preflight_profile("NVIDIA A100-SXM4-40GB", "8.0", 40960, 1)


def settings(profile, **changes):
    return FILTERS.launch_script_settings(profile, {**INPUTS, **changes})


def test_the_filter_reads_every_variable_vars_main_passes():
    wiring = (ROLE / "vars" / "main.yml").read_text()
    for name in INPUTS:
        # Booleans pass through `| bool` (`-e name=false` is the string "false"): test_role_contracts.py.
        passed = [f"'{name}': launch_script_{name}{tail}" for tail in (",", "}", " | bool,", " | bool}")]
        # The world's sizes pass through launch_script_world: the host's own inputs, or a tasks_from: plan caller's.
        world = f"'{name}': launch_script_world.{name}," in wiring
        assert any(text in wiring for text in passed) or (
            world and f'  {name}: "{{{{ launch_script_{name} }}}}"' in wiring
        ), name


# (profile, variables, expected settings): empty variables take the tier's and the profile's values.
ROWS = [
    # A 1x P40 (24 GB tier, fp32): the tier's micro batches (the sweep's winner); the critic on the GPU, the actor
    # too under hf; one checkpoint and one validation an epoch (7473 // 256); validation in one generate call.
    (
        P40,
        {},
        {
            "gpus": 1,
            "world_size": 1,
            "visible_devices": "0",
            "micro": 8,
            "log_prob_micro": 16,
            "rollout_micro": 256,
            "param_offload": False,
            "actor_param_offload": False,
            "optimizer_offload": True,
            "gpu_memory_utilization": 0.5,
            "rollout_name": "hf",
            "rollout_dtype": "float32",
            "param_dtype": "fp32",
            "use_torch_compile": False,
            "use_remove_padding": False,
            "val_batch_size": 256,
            "save_freq": 29,
            "test_freq": 29,
            "smoke_batch": 16,
            "tier_refusal": "",
            "problems": [],
        },
    ),
    # Two P40s shard: the tier's no-offload holds; the validation and smoke batches span both GPUs.
    (
        P40X2,
        {},
        {"gpus": 2, "visible_devices": "0,1", "param_offload": False, "val_batch_size": 512, "smoke_batch": 32},
    ),
    # Two nodes of two GPUs: the world is four.
    (P40X2, {"nnodes": 2}, {"world_size": 4, "param_offload": False, "val_batch_size": 1024, "smoke_batch": 64}),
    # The single-GPU rule can be switched on, and an explicit false wins over it.
    (P40, {"single_gpu_param_offload": True}, {"param_offload": True, "actor_param_offload": False}),
    (P40, {"single_gpu_param_offload": True, "param_offload": False}, {"param_offload": False}),
    (P40, {"param_offload": False}, {"param_offload": False, "actor_param_offload": False}),
    (P40, {"param_offload": "false"}, {"param_offload": False}),
    # Offload asked explicitly reaches the actor only under an engine that reloads it.
    (P40X2, {"param_offload": True}, {"param_offload": True, "actor_param_offload": False}),
    (P40X2, {"param_offload": True, "rollout_name": "vllm"}, {"actor_param_offload": True, "rollout_name": "vllm"}),
    # The profile's vLLM only where the env has it; explicit values as given, strings included.
    (V100, {}, {"rollout_name": "hf", "rollout_dtype": "float16", "param_dtype": "fp32", "use_torch_compile": True}),
    (V100, {"vllm_installed": True}, {"rollout_name": "vllm"}),
    (V100, {"vllm_installed": "true", "gpu_memory_utilization": "0.55"}, {"gpu_memory_utilization": 0.55}),
    (
        P40,
        {
            "ppo_micro_batch_size_per_gpu": 3,
            "log_prob_micro_batch_size_per_gpu": "6",
            "rollout_micro_batch_size": 16,
            "val_batch_size": 32,
            "save_freq": 7,
            "gpus_per_node": "1",
            "cuda_visible_devices": "2",
            "use_torch_compile": True,
            "use_remove_padding": "yes",
            "optimizer_offload": False,
            "rollout_dtype": "float16",
            "param_dtype": "bf16",
        },
        {
            "micro": 3,
            "log_prob_micro": 6,
            "rollout_micro": 16,
            "val_batch_size": 32,
            "save_freq": 7,
            "visible_devices": "2",
            "use_torch_compile": True,
            "use_remove_padding": True,
            "optimizer_offload": False,
            "rollout_dtype": "float16",
            "param_dtype": "bf16",
            "smoke_batch": 6,
        },
    ),
    # bf16 cards train bf16 parameters; the 40 GB tier offloads nothing but the single GPU's parameters. Packed
    # sequences only where the profile attends with FlashAttention-2 (no profile does on this stack, docs/facts.md).
    (A100, {}, {"param_dtype": "bf16", "use_remove_padding": False, "micro": 8, "optimizer_offload": False}),
    ({**A100, "attn_implementation": "flash_attention_2"}, {}, {"use_remove_padding": True}),
    # A save and a validation every step at least, whatever the split's size; -1 is verl's "never validate".
    (P40, {"train_rows": 100, "train_batch_size": 512}, {"save_freq": 1, "test_freq": 1}),
    (P40, {"test_freq": 10}, {"test_freq": 10, "save_freq": 29}),
    (P40, {"test_freq": "-1"}, {"test_freq": -1, "problems": []}),
    (
        P40,
        {"test_freq": "-2"},
        {"problems": ["launch_script_test_freq is '-2': a whole number >= 0 wanted (or -1: never)"]},
    ),
    # Tiers that cannot train say why, unless the switch renders them on purpose.
    (P4, {"allow_refused_tier": True}, {"tier_refusal": "", "micro": 1, "rollout_micro": 8}),
    # A profile without its memory gets the smallest tier's batches, offloads, and cannot train.
    ({"gpu_count": 1, "dtype": "float32"}, {}, {"micro": 1, "rollout_micro": 8, "optimizer_offload": True}),
    # No tier at all (an operator's empty list): the smallest batches, offloaded, and no refusal.
    (P40, {"memory_tiers": []}, {"micro": 1, "log_prob_micro": 1, "rollout_micro": 8, "tier_refusal": ""}),
    # An operator's own tiers are the ones read.
    (
        P40,
        {"memory_tiers": [{"min_memory_mib": 0, "ppo_micro_batch_size_per_gpu": 4, "refuse": {}}]},
        {"micro": 4, "log_prob_micro": 1},
    ),
]

TIERS = DEFAULTS["launch_script_memory_tiers"]


# (memory per GPU in MiB, the tier's min_memory_mib): the largest not above the memory wins; a P40 reports 22919 or
# 23040 MiB with ECC on, 24451 or 24576 off (docs/facts-gpu.md), all in the 24 GB tier.
@pytest.mark.parametrize(
    ("memory_mib", "tier"),
    [
        (0, 0),
        (7680, 0),
        (14999, 0),
        (15000, 15000),
        (15360, 15000),
        (22499, 15000),
        (22500, 22500),
        (22888, 22500),
        (22919, 22500),
        (23040, 22500),
        (24576, 22500),
        (39999, 22500),
        (40000, 40000),
        (81920, 40000),
    ],
)
def test_the_memory_tier_is_the_largest_the_memory_reaches(memory_mib, tier):
    assert FILTERS.memory_tier(memory_mib, TIERS)["min_memory_mib"] == tier
    assert FILTERS.memory_tier(memory_mib, list(reversed(TIERS)))["min_memory_mib"] == tier


def test_no_tier_the_memory_reaches_is_none():
    assert FILTERS.memory_tier(8000, [{"min_memory_mib": 15000}]) == {}
    assert FILTERS.memory_tier(8000, []) == {}
    assert FILTERS.memory_tier(8000, None) == {}


@pytest.mark.parametrize(("profile", "changes", "expected"), ROWS)
def test_settings_table(profile, changes, expected):
    got = settings(profile, **changes)
    assert {key: got[key] for key in expected} == expected
    # The rendered text of each value is what verl's Hydra reads (Python's True/False, plain numbers).
    assert all(type(got[key]) is type(value) for key, value in expected.items()), got


def test_refused_tiers_carry_the_tiers_reason_per_dtype():
    assert "Adam states" in settings(P4)["tier_refusal"]
    assert "docs/gpu-runs/t4-1x-hf.json" in settings(T4)["tier_refusal"]
    assert settings(P40)["tier_refusal"] == ""


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"param_offload": "maybe"}, "launch_script_param_offload is 'maybe': true or false wanted"),
        ({"ppo_micro_batch_size_per_gpu": "four"}, "launch_script_ppo_micro_batch_size_per_gpu is 'four'"),
        ({"gpu_memory_utilization": "-0.5"}, "launch_script_gpu_memory_utilization is '-0.5'"),
        ({"use_torch_compile": 2}, "launch_script_use_torch_compile is 2"),
        ({"save_freq": True}, "launch_script_save_freq is True"),
    ],
)
def test_a_value_that_is_no_setting_is_a_problem_naming_the_variable(changes, named):
    problems = settings(P40, **changes)["problems"]
    assert len(problems) == 1 and problems[0].startswith(named), problems


@pytest.mark.parametrize("name", sorted(FILTERS.BATCH_MINIMUMS))
@pytest.mark.parametrize("value", [0, -8])
def test_a_batch_size_under_its_minimum_is_refused_not_divided_by(name, value):
    # batch 0 once crashed the filter (integer division or modulo by zero); now it is a problem the role stops with.
    problems = settings(P40X2, **{name: value})["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"launch_script_{name} is {value}:"), problems

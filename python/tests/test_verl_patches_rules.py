"""verl_patches' lists for root (plugins/filter/verl_patches.py), without hosts.

Root copies pristine files into its state directory; the list it copies comes from the patch set on the
controller, never from the probe the env owner's Python ran (a forged `new_copies` with `..` through a
link in the checkout wrote an owner file into /etc/sudoers.d/).
"""

from __future__ import annotations

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "verl_patches"
rules = load_module(REPO_ROOT / "plugins" / "filter" / "verl_patches.py", "verl_patches_filters")


def patch_set(*files):
    return {"id": "verl-0.4.1-test", "entries": [{"id": f"e{i}", "file": f} for i, f in enumerate(files)]}


def test_every_shipped_patch_set_names_plain_relative_files():
    for path in sorted((ROLE / "vars" / "main" / "patchsets").glob("*.yml")):
        for value in yaml.safe_load(path.read_text()).values():
            files = rules.verl_patches_root_files(value)
            assert files, path
            assert all(not f.startswith("/") and ".." not in f.split("/") for f in files)


def test_root_files_are_the_patch_sets_own_sorted_once():
    files = rules.verl_patches_root_files(patch_set("verl/b.py", "verl/a/x.py", "verl/b.py"))
    assert files == ["verl/a/x.py", "verl/b.py"]


@pytest.mark.parametrize(
    "bad", ["/etc/sudoers.d/p40fleet", "verl/../../etc/sudoers.d/x", "verl//x.py", "./verl/x.py", "", "verl/.."]
)
def test_a_patch_set_file_outside_the_checkout_is_refused(bad):
    with pytest.raises(AnsibleFilterError, match=r"entry e1 names the file .*plain paths relative"):
        rules.verl_patches_root_files(patch_set("verl/ok.py", bad))


def test_parent_directories_come_parents_first():
    assert rules.verl_patches_parent_dirs(["verl/workers/fsdp.py", "verl/models/x/y.py", "top.py"]) == [
        "verl",
        "verl/models",
        "verl/workers",
        "verl/models/x",
    ]


@pytest.mark.parametrize(
    ("forged", "kept"),
    [
        # The probe's output is the owner's: what it adds is dropped, what it leaves out is only not copied.
        (["verl/a.py", "../../../etc/sudoers.d/p40fleet"], ["verl/a.py"]),
        (["verl/a.py/../../../../etc/shadow", "/etc/passwd"], []),
        (["verl/b.py"], ["verl/b.py"]),
        ("not a list", []),
    ],
)
def test_a_forged_probe_list_cannot_name_a_file_the_patch_set_does_not(forged, kept):
    files = rules.verl_patches_root_files(patch_set("verl/a.py", "verl/b.py"))
    assert rules.verl_patches_only(forged if isinstance(forged, list) else [], files) == kept


def test_a_forged_manifest_keeps_only_the_patch_sets_files():
    files = ["verl/a.py"]
    assert rules.verl_patches_only({"verl/a.py": "1" * 64, "../../etc/x": "2" * 64}, files) == {"verl/a.py": "1" * 64}


def test_the_pristine_batch_removes_the_record_makes_parents_first_then_the_copies_then_the_manifest():
    batch = rules.verl_patches_pristine_batch(
        ["verl/workers/a.py", "verl/b.py"],
        "/var/lib/p40fleet/verl_patches",
        {"verl/workers/a.py": "QQ==", "verl/b.py": "Qg=="},
        '{"files": {}}',
    )
    state = "/var/lib/p40fleet/verl_patches"
    assert batch == [
        {"path": f"{state}/applied.json", "state": "absent"},
        *(
            {"path": path, "state": "directory", "mode": "0755"}
            for path in (
                "/var/lib/p40fleet",
                state,
                f"{state}/pristine",
                f"{state}/pristine/verl",
                f"{state}/pristine/verl/workers",
            )
        ),
        {"path": f"{state}/pristine/verl/workers/a.py", "state": "file", "mode": "0644", "content_base64": "QQ=="},
        {"path": f"{state}/pristine/verl/b.py", "state": "file", "mode": "0644", "content_base64": "Qg=="},
        {"path": f"{state}/pristine.json", "state": "file", "mode": "0644", "content": '{"files": {}}\n'},
    ]


def test_the_pristine_batch_takes_only_the_named_copies_and_refuses_one_without_content():
    # A forged probe output with more content than the patch set names writes nothing more.
    batch = rules.verl_patches_pristine_batch(["verl/a.py"], "/s", {"verl/a.py": "QQ==", "../../etc/x": "QQ=="}, "{}")
    assert [item["path"] for item in batch if item["state"] == "file"] == ["/s/pristine/verl/a.py", "/s/pristine.json"]
    with pytest.raises(AnsibleFilterError, match=r"gave no content for verl/a\.py"):
        rules.verl_patches_pristine_batch(["verl/a.py"], "/s", {}, "{}")


# --- What a GPU profile asks of the patch sets (verl_patches_plan) -------------------------------------------------

SETTINGS = {"attn_implementation": "", "fallback_defaults": True, "triton_smem_required": 81920}
PASCAL = {
    "name": "pascal",
    "dtype": "float32",
    "attn_implementation": "eager",
    "needs_patches": True,
    "shared_memory_per_block": 49152,
}
OFF = "dtype=torch.float32, enabled=False"

# case -> (profile, settings over SETTINGS, (dtype, attn, torch dtype, precision, autocast, active needs))
PLANS = {
    "pascal": (
        PASCAL,
        {},
        ("float32", "eager", "torch.float32", "fp32", OFF, ["dtype", "fallback", "attn", "triton", "hf_rollout"]),
    ),
    # fp16 spells fp16 but keeps the autocast off: verl 0.4.1/0.5.0 have no loss scaler.
    "volta": (
        dict(PASCAL, name="volta", dtype="float16", attn_implementation="sdpa", shared_memory_per_block=98304),
        {},
        (
            "float16",
            "sdpa",
            "torch.float16",
            "fp16",
            "dtype=torch.float16, enabled=False",
            ["dtype", "fallback", "attn", "hf_rollout"],
        ),
    ),
    "modern_bf16_sdpa": (
        dict(PASCAL, name="modern", dtype="bfloat16", attn_implementation="sdpa", shared_memory_per_block=101376),
        {},
        ("bfloat16", "sdpa", "torch.bfloat16", "bf16", "dtype=torch.bfloat16", ["attn", "hf_rollout"]),
    ),
    # The input wins over the profile's kernel; flash_attention_2 is verl's own, so no attn edit.
    "attn_input_wins": (
        PASCAL,
        {"attn_implementation": "flash_attention_2"},
        ("float32", "flash_attention_2", "torch.float32", "fp32", OFF, ["dtype", "fallback", "triton", "hf_rollout"]),
    ),
    "no_fallbacks": (
        PASCAL,
        {"fallback_defaults": False},
        ("float32", "eager", "torch.float32", "fp32", OFF, ["dtype", "attn", "triton", "hf_rollout"]),
    ),
    # A profile that needs no patches activates nothing, whatever its dtype.
    "needs_none": (dict(PASCAL, needs_patches=False), {}, ("float32", "eager", "torch.float32", "fp32", OFF, [])),
    # No profile (state absent, a role used alone): verl's own bf16 and FlashAttention-2, nothing to edit.
    "empty": ({}, {}, ("bfloat16", "flash_attention_2", "torch.bfloat16", "bf16", "dtype=torch.bfloat16", [])),
    # A dtype the sets cannot spell is not known: the probe's check refuses it.
    "unknown_dtype": (
        dict(PASCAL, dtype="float8"),
        {},
        ("float8", "eager", "", "", "", ["dtype", "fallback", "attn", "triton", "hf_rollout"]),
    ),
}


@pytest.mark.parametrize("case", PLANS)
def test_the_plan_spells_the_profiles_dtype_and_kernel_and_picks_the_needs(case):
    profile, settings, (dtype, attn, torch_dtype, precision, autocast, active) = PLANS[case]
    plan = rules.verl_patches_plan(profile, dict(SETTINGS, **settings))
    assert (plan["dtype"], plan["attn_implementation"], plan["torch_dtype"], plan["precision"]) == (
        dtype,
        attn,
        torch_dtype,
        precision,
    )
    assert (plan["autocast"], plan["active_needs"]) == (autocast, active)
    assert plan["known"] == (case != "unknown_dtype")
    assert plan["identity"] == {
        "name": profile.get("name", ""),
        "dtype": dtype,
        "attn_implementation": attn,
        "needs_patches": bool(profile.get("needs_patches", False)),
    }


def test_every_need_a_shipped_profile_activates_is_one_the_patch_sets_carry():
    profiles = yaml.safe_load((REPO_ROOT / "roles/gpu_preflight/defaults/main.yml").read_text())
    carried = set()
    for path in (ROLE / "vars" / "main" / "patchsets").glob("*.yml"):
        for value in yaml.safe_load(path.read_text()).values():
            carried |= {entry["needs"] for entry in value["entries"]}
    for profile in profiles["gpu_preflight_profiles"]:
        plan = rules.verl_patches_plan(profile, SETTINGS)
        assert plan["known"] and set(plan["active_needs"]) <= carried, profile["name"]

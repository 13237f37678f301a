"""verl's and transformers' real code on a CPU, in the CPU venv (p40fleet_dev/cpu_venv.py): what no stand-in shows.

- The hf rollout's sampling: verl 0.4.1's HFRollout, patched as a Pascal host's verl_patches patches it, generates
  greedily from left-padded prompts with transformers 4.52.4 and torch 2.6.0; each decode step's positions must
  advance, and teacher forcing on the tensors verl trains on must reproduce every sampled token
  (tests/cpu/rollout_positions.py). The same rollout without the patch set's hf-rollout-positions entry must fail
  both, or the check could not fail.
- The validation batch: the launch script's rendered data.val_batch_size for 1 to 8 GPUs, through verl's own
  padding, dispatch split and HFRollout chunking over GSM8K's 1319 test rows (tests/cpu/validation_chunks.py); the
  unset batch (verl's default, what the script rendered before) stops with verl's own assertion.
- The start-up checks: every profile the GPU check knows (tests/gpu/cases.py) rendered for 1 to 8 GPUs on one host,
  its run's and its --smoke's overrides through verl's own RayPPOTrainer._validate_config, FSDP workers'
  normalisation and HFRollout chunking (tests/cpu/startup_checks.py); with launch_script_batch_sizes: refuse the
  counts verl cannot split are refused, naming the counts that work. The configured sizes put back on the 3-GPU
  script (today's rendering before the rules) must fail verl's checks, or the check could not fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile

import jinja2
import pytest
import yaml

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.gpu.cases import CASES
from tests.launch_render import printed, render
from tests.source_modules import load_module

CPU_DIR = REPO_ROOT / "python" / "tests" / "cpu"
PATCHSET = REPO_ROOT / "roles" / "verl_patches" / "vars" / "main" / "patchsets" / "verl-0.4.1.yml"
HF_ROLLOUT = "verl/workers/rollout/hf_rollout.py"
# GSM8K's test split (openai/gsm8k, main), as training_data converts it.
TEST_ROWS = 1319
edit = load_module(REPO_ROOT / "owner_scripts" / "verl_patches_edit.py", "verl_patches_edit")
plan = load_module(REPO_ROOT / "plugins" / "filter" / "verl_patches.py", "verl_patches_filters").verl_patches_plan


@pytest.fixture(scope="module")
def python():
    return str(cpu_venv.python())


def patched_verl(root, skip=()):
    """verl 0.4.1's sdist with the Pascal profile's entries for hf_rollout.py applied by the role's own edit code."""
    with tarfile.open(UPSTREAM_DIR / "sdist" / "verl-0.4.1.tar.gz") as sdist:
        sdist.extractall(root, filter="data")
    tree = root / "verl-0.4.1"
    entries = next(iter(yaml.safe_load(PATCHSET.read_text()).values()))["entries"]
    values = {"verl_patches_autocast_args": plan({"dtype": "float32"}, {})["autocast"]}
    path = tree / HF_ROLLOUT
    data = path.read_bytes()
    applied = []
    for entry in entries:
        if entry["file"] != HF_ROLLOUT or entry["needs"] not in ("dtype", "hf_rollout") or entry["id"] in skip:
            continue
        entry = dict(entry, replace=jinja2.Template(entry["replace"]).render(values))
        data = edit.EDITS[entry["module"]](data, entry)
        applied.append(entry["id"])
    path.write_bytes(data)
    return tree, applied


def run_cpu(python, tree, script, *args):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tree), "HOME": str(tree), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [python, str(CPU_DIR / script), *args], capture_output=True, text=True, env=env, cwd=tree, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_patched_hf_rollout_samples_at_the_positions_it_trains_on(python, tmp_path):
    tree, applied = patched_verl(tmp_path)
    assert applied == ["hf-rollout-autocast", "hf-rollout-positions"]
    found = run_cpu(python, tree, "rollout_positions.py")
    assert found["forward_passes"] > 5
    assert found["stuck_steps"] == []
    assert found["tokens_checked"] >= 20 and found["tokens_differ"] == []


def test_without_the_positions_entry_every_decode_step_reuses_the_last_prompt_position(python, tmp_path):
    tree, applied = patched_verl(tmp_path, skip={"hf-rollout-positions"})
    assert applied == ["hf-rollout-autocast"]
    found = run_cpu(python, tree, "rollout_positions.py")
    # transformers slices the caller's position_ids to their last column at every step and never advances them.
    assert found["decode_positions"] and all(p == found["decode_positions"][0] for p in found["decode_positions"])
    assert len(found["stuck_steps"]) == found["forward_passes"] - 1  # every decode step after the prefill
    assert len(found["tokens_differ"]) > found["tokens_checked"] // 2


# Each profile the GPU check renders (one per memory tier and precision), with its variables; a tier that refuses
# the default model is rendered as for a smaller one (launch_script_allow_refused_tier), its batch sizes still the
# tier's. The P40's 2-GPU case is the 1-GPU profile at another count.
STARTUP_PROFILES = {
    name: case for name, case in CASES.items() if not (name.endswith("-2x") and name.replace("-2x", "-1x") in CASES)
}
GPU_COUNTS = range(1, 9)
# What verl 0.4.1 asserts at its first check of a train batch that does not split (ray_trainer.py:377).
TRAIN_SPLIT = "real_train_batch_size (256) must be divisible by minimal possible batch size (3)"


# The cluster launch's renderings: 2 to 4 nodes of 2 P40s (launch_script_nnodes).
NODES = "p40-2x-nodes"


@pytest.fixture(scope="module")
def renderings(tmp_path_factory):
    """{(profile, GPUs, mode): Rendered}, in one run of the role: every profile at 1 to 8 GPUs of one host (derive,
    the default), the P40 with launch_script_batch_sizes: refuse, and {(NODES, nodes, derive): ...}."""
    hosts, keys = {}, {}
    base = CASES["p40-1x"].profile
    for nodes in (2, 3, 4):
        keys[f"nodes{nodes}"] = (NODES, nodes, "derive")
        hosts[f"nodes{nodes}"] = {"profile": {**base, "gpu_count": 2}, "launch_script_nnodes": nodes}
    for name, case in STARTUP_PROFILES.items():
        modes = ("derive", "refuse") if name == "p40-1x" else ("derive",)
        for count in GPU_COUNTS:
            for mode in modes:
                host = f"{name.replace('-', '_')}_{count}_{mode}"
                keys[host] = (name, count, mode)
                hosts[host] = {
                    "profile": {
                        **case.profile,
                        "gpu_count": count,
                        "cuda_visible_devices": ",".join(map(str, range(count))),
                    },
                    **case.variables,
                    "launch_script_allow_refused_tier": True,
                    "launch_script_batch_sizes": mode,
                }
    out, result = render(hosts, tmp_path_factory.mktemp("render"))
    assert result.rc in (0, 2), result.stdout[-3000:]
    return {keys[host]: rendered for host, rendered in out.items()}


@pytest.fixture(scope="module")
def rendered_val_batches(renderings):
    """{host: (world size, rollout micro batch, data.val_batch_size)} as the launch script renders them for 1 to 8
    P40s (one host), and for 2 to 4 nodes of 2 (the cluster launch's nnodes)."""
    found = {}
    for (name, count, mode), item in renderings.items():
        if name in ("p40-1x", NODES) and mode == "derive":
            keys = dict(o.split("=", 1) for o in item.overrides)
            world = int(keys["trainer.n_gpus_per_node"]) * int(keys["trainer.nnodes"])
            micro = int(keys["+actor_rollout_ref.rollout.micro_batch_size"])
            found[f"{name} x{count}"] = (world, micro, int(keys["data.val_batch_size"]))
    return found


def test_the_rendered_validation_batch_splits_for_every_world_size(python, tmp_path, rendered_val_batches):
    assert sorted({w for w, _, _ in rendered_val_batches.values()}) == [1, 2, 3, 4, 5, 6, 7, 8]
    cases = [
        {"world_size": world, "micro_batch_size": micro, "val_batch_size": batch}
        for world, micro, batch in rendered_val_batches.values()
    ]
    tree, _ = patched_verl(tmp_path)
    results = run_cpu(python, tree, "validation_chunks.py", str(TEST_ROWS), json.dumps(cases))
    assert [r["result"] for r in results] == ["ok"] * len(cases), results
    # Each rank's share is one generate call: the batch is the micro batch times the world size.
    assert all(batch == micro * world for world, micro, batch in rendered_val_batches.values())


def test_verl_s_default_validation_batch_stops_the_run(python, tmp_path, rendered_val_batches):
    cases = [
        {"world_size": world, "micro_batch_size": micro, "val_batch_size": None}
        for world, micro, _ in rendered_val_batches.values()
    ]
    tree, _ = patched_verl(tmp_path)
    results = run_cpu(python, tree, "validation_chunks.py", str(TEST_ROWS), json.dumps(cases))
    failed = {r["world_size"]: r["result"] for r in results if r["result"] != "ok"}
    # One P40 takes the whole test set and cuts it into 1319 // 256 = 5 chunks, which 1319 rows do not fill evenly.
    assert "only support equal chunk. Got size of DataProto 1319 and chunk 5" in failed[1], results


def run_startup_checks(python, tmp_path, cases):
    """tests/cpu/startup_checks.py over `cases`, handed over in a file (their overrides outgrow a command line)."""
    tree, _ = patched_verl(tmp_path / "verl")
    listed = tmp_path / "cases.json"
    listed.write_text(json.dumps(cases))
    return run_cpu(python, tree, "startup_checks.py", str(listed))


def startup_cases(renderings):
    cases = []
    for (name, count, mode), rendered in sorted(renderings.items()):
        if not rendered.refused:
            label = f"{name} x{count} {mode}"
            cases.append({"name": label, "overrides": rendered.overrides})
            cases.append({"name": f"{label} --smoke", "overrides": rendered.smoke_overrides})
    return cases


def test_every_rendering_for_1_to_8_gpus_passes_verl_s_start_up_checks(python, tmp_path, renderings):
    derived = {key: r for key, r in renderings.items() if key[2] == "derive"}
    assert not [key for key, r in derived.items() if r.refused], "derive renders every count"
    assert len(derived) == len(STARTUP_PROFILES) * len(GPU_COUNTS) + 3
    results = run_startup_checks(python, tmp_path, startup_cases(derived))
    assert len(results) == 2 * len(derived)
    assert [r for r in results if r["result"] != "ok"] == []
    assert {r["world_size"] for r in results} == set(GPU_COUNTS)
    # verl's workers ran at the script's world size: each normalised the mini batch to its share per rank.
    for r in results:
        share = r["ppo_mini_batch_size"] // r["world_size"]
        assert r["actor_mini_per_rank"] == r["critic_mini_per_rank"] == share, r
    # The batch sizes grew only where the configured ones do not split: 3, 5, 6 and 7 GPUs.
    grown = {r["world_size"] for r in results if r["train_batch_size"] != 256 and "--smoke" not in r["name"]}
    assert grown == {3, 5, 6, 7}


def test_refuse_names_the_gpu_counts_whose_renderings_pass(renderings):
    refused = {count: r.refused for (_, count, mode), r in renderings.items() if mode == "refuse"}
    assert sorted(c for c, message in refused.items() if message) == [3, 5, 6, 7]
    kept = {
        c
        for (name, c, mode), r in renderings.items()
        if (name, mode) == ("p40-1x", "derive") and "data.train_batch_size=256" in r.overrides
    }
    for count in (3, 5, 6, 7):
        assert f"{count} GPU(s), which verl cannot split: train_batch_size 256 does not split" in refused[count]
        named = re.search(r"GPU counts per node that train with these batch sizes: ([^.]*)\.", refused[count])
        assert named.group(1) == "1, 2, 4, 8"
        # The counts named are those whose rendering trains the configured sizes (and passed verl above).
        assert {int(c) for c in named.group(1).split(", ")} <= kept


def test_the_configured_sizes_on_three_gpus_fail_verl_s_checks(python, tmp_path, renderings):
    """The negative control: the 3-GPU P40 script with 256 / 64 put back (what it rendered before the rules), and
    with only the mini batch put back, as an operator's passed-through overrides."""
    script = renderings[("p40-1x", 3, "derive")].script
    mini = "actor_rollout_ref.actor.ppo_mini_batch_size=64"
    cases = [
        {"name": "today", "overrides": printed(script, "data.train_batch_size=256", mini)},
        {"name": "mini", "overrides": printed(script, mini)},
    ]
    today, mini_only = run_startup_checks(python, tmp_path, cases)
    assert today["world_size"] == 3 and today["result"].startswith("RayPPOTrainer._validate_config: AssertionError")
    assert TRAIN_SPLIT in today["result"]
    assert mini_only["result"] == (
        "fsdp_workers normalisation: AssertionError: normalized ppo_mini_batch_size 21 should be divisible by "
        "ppo_micro_batch_size_per_gpu 8"
    )


def test_print_states_the_derived_sizes_and_schedules_them(renderings):
    script = renderings[("p40-1x", 3, "derive")].script
    done = subprocess.run([str(script), "--print"], capture_output=True, text=True, check=True)
    assert "batch sizes: 3 GPU(s): train_batch_size 256 does not split across 3 ranks" in done.stderr
    assert "derived (launch_script_batch_sizes: derive): train_batch_size 256 -> 288, ppo_mini_batch_size 64 -> 72" in (
        done.stderr
    )
    # 7473 rows // 288 = 25 steps an epoch, 15 epochs.
    assert "schedule: 375 steps (15 epochs of 7473 rows at 288)" in done.stderr
    assert "# Batch sizes: 3 GPU(s): train_batch_size 256" in script.read_text()

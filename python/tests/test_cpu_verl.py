"""verl's and transformers' real code on a CPU, in the CPU venv (p40fleet_dev/cpu_venv.py): what no stand-in shows.

- The hf rollout's sampling: verl 0.4.1's HFRollout, patched as a Pascal host's verl_patches patches it, generates
  greedily from left-padded prompts with transformers 4.52.4 and torch 2.6.0; each decode step's positions must
  advance, and teacher forcing on the tensors verl trains on must reproduce every sampled token
  (tests/cpu/rollout_positions.py). The same rollout without the patch set's hf-rollout-positions entry must fail
  both, or the check could not fail.
- The validation batch: the launch script's rendered data.val_batch_size for 1 to 8 GPUs, through verl's own
  padding, dispatch split and HFRollout chunking over GSM8K's 1319 test rows (tests/cpu/validation_chunks.py); the
  unset batch (verl's default, what the script rendered before) stops with verl's own assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

import jinja2
import pytest
import yaml

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.gpu.cases import CASES
from tests.launch_render import render
from tests.source_modules import load_module

CPU_DIR = REPO_ROOT / "python" / "tests" / "cpu"
PATCHSET = REPO_ROOT / "roles" / "verl_patches" / "vars" / "main" / "patchsets" / "verl-0.4.1.yml"
PATCH_VARS = REPO_ROOT / "roles" / "verl_patches" / "vars" / "main" / "main.yml"
HF_ROLLOUT = "verl/workers/rollout/hf_rollout.py"
# GSM8K's test split (openai/gsm8k, main), as training_data converts it.
TEST_ROWS = 1319
edit = load_module(REPO_ROOT / "roles" / "verl_patches" / "files" / "verl_patches_edit.py", "verl_patches_edit")


@pytest.fixture(scope="module")
def python():
    return str(cpu_venv.python())


def patched_verl(root, skip=()):
    """verl 0.4.1's sdist with the Pascal profile's entries for hf_rollout.py applied by the role's own edit code."""
    with tarfile.open(UPSTREAM_DIR / "sdist" / "verl-0.4.1.tar.gz") as sdist:
        sdist.extractall(root, filter="data")
    tree = root / "verl-0.4.1"
    entries = next(iter(yaml.safe_load(PATCHSET.read_text()).values()))["entries"]
    table = yaml.safe_load(PATCH_VARS.read_text())["verl_patches_dtype_table"]
    values = {"verl_patches_autocast_args": table["float32"]["autocast"]}
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


@pytest.fixture(scope="module")
def rendered_val_batches(tmp_path_factory):
    """{world size: (rollout micro batch, data.val_batch_size)} as the launch script renders them for 1 to 8 P40s
    (one host), and for 2 to 4 nodes of 2 (the cluster launch's nnodes)."""
    base = CASES["p40-1x"]
    hosts = {f"gpus{n}": {"profile": {**base.profile, "gpu_count": n}} for n in range(1, 9)}
    hosts |= {f"nodes{n}": {"profile": {**base.profile, "gpu_count": 2}, "launch_script_nnodes": n} for n in (2, 3, 4)}
    out, result = render(hosts, tmp_path_factory.mktemp("render"))
    assert result.rc == 0, result.stdout[-3000:]
    found = {}
    for name, item in out.items():
        keys = dict(o.split("=", 1) for o in item.overrides)
        world = int(keys["trainer.n_gpus_per_node"]) * int(keys["trainer.nnodes"])
        micro = int(keys["+actor_rollout_ref.rollout.micro_batch_size"])
        found[name] = (world, micro, int(keys["data.val_batch_size"]))
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

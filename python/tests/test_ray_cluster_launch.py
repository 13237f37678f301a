"""The cluster's launch script (p40fleet-ray-submit, ray_cluster's launch.yml) rendered on this machine for the head
of a planned three-node P40 cluster: its job is the launch script's own overrides rendered for three nodes (the
same list train_gsm8k_ppo.sh --print shows with launch_script_nnodes 3), then the cluster's, and the whole of it
composes against verl 0.4.1's Hydra config with the launch script's compose helper. verl cannot split the launch
script's batch sizes (256, mini 64, micro 8) across three ranks: the plan derives 288 and 72
(ray_cluster_batch_sizes: derive), which the launch script then renders for three nodes; the default refuses."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import subprocess
import sys
import zipfile

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.launch_render import INPUTS, preflight_profile, render, render_ray_submit
from tests.pins import CUDA_HOME

COMPOSE = REPO_ROOT / "roles" / "launch_script" / "files" / "launch_script_compose.py"
P40 = preflight_profile("Tesla P40", "6.1", 24576, 1)
PLAN = {
    "cluster": "demo",
    "head": "head",
    "members": ["head", "w1", "w2"],
    "nnodes": 3,
    "gpus_per_node": 1,
    "refusals": [],
}


@pytest.fixture(scope="module")
def submit(tmp_path_factory):
    work = tmp_path_factory.mktemp("ray-submit")
    result = render_ray_submit(work, PLAN, pwd.getpwuid(os.getuid()).pw_name, ray_cluster_batch_sizes="derive")
    assert result.rc == 0, result.stdout[-3000:]
    return work / "p40fleet-ray-submit"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The launch script's overrides for the same host with launch_script_nnodes 3, plain and --smoke."""
    derived = {"launch_script_train_batch_size": 288, "launch_script_ppo_mini_batch_size": 72}
    out, _ = render({"head": {"profile": P40, "launch_script_nnodes": 3, **derived}}, tmp_path_factory.mktemp("launch"))
    return out["head"]


def printed(script, *args):
    shown = subprocess.run([str(script), "--print", *args], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(": ", 1) for line in shown.strip().splitlines())
    return shlex.split(fields["entrypoint"]), json.loads(fields["runtime env"]), fields["address"]


CLUSTER = [
    "trainer.nnodes=3",
    "trainer.n_gpus_per_node=1",
    "trainer.ray_wait_register_center_timeout=600",
    "ray_init.num_cpus=null",
]


# The entrypoint's words before the trainer: the launch environment read from the owner's file, the work directory.
def prefix(work):
    env_file = str(work / "train_gsm8k_ppo.env")
    return [
        *["set", "-a", "&&", "{", "[", "!", "-e", env_file, "]", "||", ".", env_file + ";", "}", "&&", "set", "+a"],
        *["&&", "mkdir", "-p", "/srv/verl-runs", "&&", "cd", "/srv/verl-runs", "&&", "exec"],
    ]


TRAINER = len(prefix(REPO_ROOT)) + 3


def test_the_job_is_the_launch_scripts_overrides_then_the_clusters(submit, launch):
    argv, env, address = printed(submit, "trainer.total_epochs=2")
    assert argv[: TRAINER - 3] == prefix(submit.parent)
    assert argv[TRAINER - 3 : TRAINER] == [INPUTS["p40fleet_conda_python"], "-m", "verl.trainer.main_ppo"]
    assert argv[TRAINER:] == [*launch.overrides, *CLUSTER, "trainer.total_epochs=2"]
    assert "trainer.nnodes=3" in launch.overrides
    assert env == {
        "env_vars": {
            "NCCL_SOCKET_IFNAME": "eth0",
            "GLOO_SOCKET_IFNAME": "eth0",
            "CUDA_HOME": CUDA_HOME,
            "LD_LIBRARY_PATH": f"{CUDA_HOME}/lib64",
        }
    }
    # The head's dashboard on loopback: the firewall admits only the owner's and root's connections there.
    assert address == "http://127.0.0.1:8265"


def test_smoke_is_the_launch_scripts_smoke_for_three_nodes(submit, launch):
    argv, _, _ = printed(submit, "--smoke", "3")
    # The launch script's smoke ends with its schedule: the steps, then a save at the last of them.
    *smoke, steps, save = launch.smoke_overrides
    assert (steps, save) == ("trainer.total_training_steps=5", "trainer.save_freq=5")
    assert argv[TRAINER:] == [*smoke, "trainer.total_training_steps=3", "trainer.save_freq=3", *CLUSTER]
    batch = int(dict(a.split("=", 1) for a in argv[TRAINER:])["data.train_batch_size"])
    micro = int(dict(a.split("=", 1) for a in argv[TRAINER:])["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
    assert batch == 2 * micro * 1 * 3


def test_nodes_job_and_refusals(submit):
    argv, _, _ = printed(submit, "--nodes")
    assert argv == [INPUTS["p40fleet_conda_python"], str(submit.parent / "libexec" / "ray_nodes_job.py")]
    for bad in (["--full-batch"], ["--smoke", "0"], ["--bogus"]):
        done = subprocess.run([str(submit), *bad, "--print"], capture_output=True, text=True, check=False)
        assert done.returncode == 2 and re.search(r"(goes with --smoke|at least 1 step|unknown option)", done.stderr)


def test_the_whole_job_composes_against_verls_config(submit, tmp_path):
    argv, _, _ = printed(submit, "--smoke")
    with zipfile.ZipFile(sorted((UPSTREAM_DIR / "wheel").glob("verl-0.4.1-*.whl"))[0]) as wheel:
        wheel.extractall(tmp_path, [n for n in wheel.namelist() if n.startswith("verl/trainer/config/")])
    keys = yaml.safe_load((REPO_ROOT / "roles" / "launch_script" / "vars" / "main.yml").read_text())
    command = [sys.executable, str(COMPOSE), "--config-dir", str(tmp_path / "verl" / "trainer" / "config")]
    for entry in keys["launch_script_added_keys"]:
        command += ["--added-key", entry["key"]]
    done = subprocess.run([*command, "--", *argv[TRAINER:]], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    composed = yaml.safe_load(done.stdout)
    assert composed["trainer"]["nnodes"] == 3 and composed["trainer"]["n_gpus_per_node"] == 1
    assert composed["trainer"]["ray_wait_register_center_timeout"] == 600
    assert composed["ray_init"]["num_cpus"] is None


def test_three_ranks_are_refused_by_default_and_the_environment_collision_too(tmp_path):
    owner = pwd.getpwuid(os.getuid()).pw_name
    refused = render_ray_submit(tmp_path, PLAN, owner)
    assert refused.rc != 0
    message = refused.failures[0].message
    assert "cluster demo (head, w1, w2): 3 node(s) x 1 GPU(s) = 3 ranks, which verl cannot split" in message
    assert "ppo_mini_batch_size 64 // 3 ranks = 21, not a multiple of ppo_micro_batch_size_per_gpu 8" in message
    assert "Node counts of 1 GPU(s) that train with these batch sizes: 1 (1 ranks), 2 (2 ranks), 4 (4 ranks)" in message
    assert not (tmp_path / "p40fleet-ray-submit").exists()
    work = tmp_path / "collision"
    work.mkdir()
    collided = render_ray_submit(
        work,
        {**PLAN, "members": ["head", "w1"], "nnodes": 2},
        owner,
        launch_script_environment={"NCCL_DEBUG": "INFO", "WANDB_MODE": "offline"},
    )
    assert collided.rc != 0
    message = collided.failures[0].message
    assert "launch_script_environment sets NCCL_DEBUG: verl's own ray.init sets NCCL_DEBUG=WARN" in message
    assert "Remove it from launch_script_environment" in message
    assert not (work / "p40fleet-ray-submit").exists()

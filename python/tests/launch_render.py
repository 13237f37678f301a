"""Render the launch_script role for GPU profiles on this machine, the way a host's run renders it.

One home for what test_launch_script.py, the GPU check (tests/gpu/) and the record test (test_gpu_records.py)
need: the profile gpu_preflight publishes for a GPU, and the role run over a local connection (ansible-playbook
with python/tests/playbooks/launch_script.yml), whose script's --print gives the overrides.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT
from tests.local_hosts import ROOT_PLAYS_OWNER
from tests.pins import CUDA_HOME

PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "launch_script.yml"
PREFLIGHT = yaml.safe_load((REPO_ROOT / "roles" / "gpu_preflight" / "defaults" / "main.yml").read_text())

# The inputs the earlier stages publish, fixed so that a rendering is the same wherever it is made: the GPU check
# replaces these paths with its own on the GPU machine, and nothing else.
ENV_PREFIX = "/opt/miniconda3/envs/verl-env"
INPUTS = {
    "p40fleet_conda_env_dir": ENV_PREFIX,
    "p40fleet_conda_python": f"{ENV_PREFIX}/bin/python",
    "p40fleet_cuda_home": CUDA_HOME,
    "p40fleet_cuda_env_file": "/etc/p40fleet/cuda-11.8.sh",
    "p40fleet_verl_version": "0.4.1",
    "training_data_train_file": "/srv/data/gsm8k/train.parquet",
    "training_data_test_file": "/srv/data/gsm8k/test.parquet",
    "training_data_model_path": "/srv/models/Qwen2.5-0.5B-Instruct",
}


def preflight_profile(gpu_name: str, compute_cap: str, memory_mib: int, count: int) -> dict:
    """What gpu_preflight publishes for such a host: the profile of its compute capability and its memory per GPU
    (the launch script picks the memory tier from it, launch_script_memory_tiers)."""

    def as_tuple(text):
        return tuple(int(x) for x in text.split("."))

    cap = as_tuple(compute_cap)
    match = next(
        p
        for p in PREFLIGHT["gpu_preflight_profiles"]
        if as_tuple(p["min_compute_cap"]) <= cap <= as_tuple(p["max_compute_cap"])
    )
    return {
        "name": match["name"],
        "compute_cap": compute_cap,
        "gpu_name": gpu_name,
        "gpu_count": count,
        "cuda_visible_devices": ",".join(str(i) for i in range(count)),
        "memory_mib": memory_mib,
        "dtype": match["dtype"],
        "attn_implementation": match["attn_implementation"],
        "vllm_supported": match["vllm_supported"],
        "rollout_name": "vllm" if match["vllm_supported"] else "hf",
        "torch_compile": match["torch_compile"],
        "shared_memory_per_block": match["shared_memory_per_block"],
        "needs_patches": match["needs_patches"],
    }


@dataclass
class Rendered:
    """One host's rendering: the script, its --print overrides (plain and --smoke), or why it was refused."""

    script: Path | None
    overrides: list[str]
    smoke_overrides: list[str]
    refused: str


def parse_printed(printed: str) -> list[str]:
    """The overrides --print shows, one per line, shell-quoted; read back with the shell itself."""
    lines = printed.strip().splitlines()
    assert lines[0].endswith("-m verl.trainer.main_ppo \\"), lines[0]
    quoted = " ".join(line.strip().removesuffix("\\").strip() for line in lines[1:])
    done = subprocess.run(["bash", "-c", f'printf "%s\\n" {quoted}'], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def printed(script: Path, *args: str) -> list[str]:
    done = subprocess.run([str(script), "--print", *args], capture_output=True, text=True, check=True)
    return parse_printed(done.stdout)


def render(hosts: dict[str, dict], work: Path, idempotent: bool = False) -> tuple[dict[str, Rendered], object]:
    """Run the role for {host: {"profile": ..., **launch_script vars}} under `work`; ({host: Rendered}, result).

    Refused hosts (the play failed for them) come back with `refused` holding the failure's message. With
    `idempotent`, a second run must change nothing."""
    me = pwd.getpwuid(os.getuid()).pw_name
    inventory_hosts = {}
    for name, spec in hosts.items():
        spec = dict(spec)
        (work / name).mkdir(parents=True, exist_ok=True)
        inventory_hosts[name] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            # The role's tasks become the env owner; here the owner is whoever renders.
            "ansible_become": False,
            "p40fleet_env_owner": me,
            **INPUTS,
            "gpu_preflight_profile": spec.pop("profile"),
            "launch_script_path": str(work / name / "train_gsm8k_ppo.sh"),
            "launch_script_work_dir": "/srv/verl-runs",
            # --dry-run needs verl in an env; the tests compose with the role's helper themselves.
            "launch_script_verify_dry_run": False,
            **spec,
        }
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": inventory_hosts}}))
    envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work / "facts"), **ROOT_PLAYS_OWNER}
    # The firewall of the script's own Ray is this machine's to keep, not the test's to load.
    cmdline = ["--skip-tags", "launch_script_firewall"]
    result = run_playbook(PLAYBOOK, inventory, cmdline=cmdline, envvars=envvars)
    failed = {f.host: f.message for f in result.failures}
    if idempotent:
        again = run_playbook(PLAYBOOK, inventory, cmdline=cmdline, envvars=envvars)
        assert {f.host for f in again.failures} == set(failed), again.stdout[-3000:]
        changed = {h: again.stats[h]["changed"] for h in hosts if h not in failed}
        assert not any(changed.values()), changed
    out = {}
    for name in hosts:
        if name in failed:
            out[name] = Rendered(None, [], [], failed[name])
            continue
        script = work / name / "train_gsm8k_ppo.sh"
        assert script.exists(), result.stdout[-3000:]
        out[name] = Rendered(script, printed(script), printed(script, "--smoke"), "")
    return out, result


def overrides_digest(rendered: Rendered) -> str:
    """sha256 of what a run of the script passes to verl: the overrides, plain and with --smoke (or the refusal)."""
    body = {"overrides": rendered.overrides, "smoke_overrides": rendered.smoke_overrides, "refused": rendered.refused}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


RAY_SUBMIT_PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "ray_submit.yml"


def render_ray_submit(work: Path, plan: dict, owner: str, cmdline: tuple[str, ...] = (), **extra):
    """Render ray_cluster's p40fleet-ray-submit for the head of `plan` into `work` (python/tests/playbooks/
    ray_submit.yml over a local connection), the earlier stages' facts given as host variables. Returns the run."""
    (work / "libexec").mkdir(exist_ok=True)
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_env_owner": owner,
        **INPUTS,
        "gpu_preflight_profile": preflight_profile("Tesla P40", "6.1", 24576, 1),
        "gpu_preflight_cpu_count": 8,
        "launch_script_path": str(work / "train_gsm8k_ppo.sh"),
        "launch_script_work_dir": "/srv/verl-runs",
        "ray_cluster_plan": plan,
        "ray_cluster_head_address": "10.0.0.1",
        "ray_cluster_iface": {"name": "eth0", "address": "10.0.0.1", "error": ""},
        "ray_cluster_config_dir": str(work),
        "ray_cluster_node_script": str(work / "libexec" / "p40fleet-ray-node"),
        "ray_cluster_submit_script": str(work / "p40fleet-ray-submit"),
        **extra,
    }
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {plan["head"]: host}}}))
    inventory.chmod(0o600)
    envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(work / "facts"), **ROOT_PLAYS_OWNER}
    return run_playbook(RAY_SUBMIT_PLAYBOOK, inventory, cmdline=list(cmdline), envvars=envvars)

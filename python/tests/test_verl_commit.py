"""verl is pinned by commit, not by tag: the role refuses a clone whose HEAD is not verl_expected_commit. The clone,
with the URL's credentials, is made by a throwaway account with root's git configuration: nothing of the env
owner's (its ~/.gitconfig, hooks, processes) sees the credentials; the owner fetches the pinned commit from root's
bundle.

Runs the verl role on the controller itself (a local connection, git repositories in a temporary directory, one
served over loopback HTTP behind basic auth), so a tag can be moved without a sandbox. The same check runs over any
transport: it reads the commit the ref resolved to. Each run names its own throwaway account: tests of other
checkouts may run beside it on this machine.
"""

from __future__ import annotations

import pwd
import shutil
import subprocess
import tempfile
import threading
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.local_hosts import account_exists, free_uid, run_verl_role, throwaway_name
from tests.pins import VERL_COMMIT, role_defaults
from tests.test_git_credentials import AuthHandler

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


def run_verl(run_playbook, tmp_path, repo, expected: str, owner: str = "nobody", account: str = ""):
    """The role, cloning REPO as a throwaway account of its own name (ACCOUNT)."""
    extra = {
        # The system Python, which the owner can run (the test's venv lies under root's 0700 home); the probe needs
        # only its standard library.
        "p40fleet_conda_python": "/usr/bin/python3",
        "p40fleet_env_owner": owner,
        "p40fleet_python_version": "3.11",
        "verl_git_url": str(repo),
        "verl_expected_commit": expected,
        "verl_checkout_dir": str(tmp_path / "checkout"),
        "verl_flash_attn_shim_dir": str(tmp_path / "shim"),
        "verl_fetch_account": account or throwaway_name(),
        "verl_fetch_account_uid": free_uid(),
        "p40fleet_state_dir": str(tmp_path / "state"),
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


def test_a_moved_tag_is_refused_before_anything_is_installed(run_playbook, shared, serving) -> None:
    tmp_path = shared
    repo, released, moved = make_repo(tmp_path)
    served = serving(repo)
    account = throwaway_name()
    result = run_verl(run_playbook, tmp_path, served["url"], released, account=account)
    assert result.rc != 0
    (failure,) = result.failures
    # Refused as the throwaway account's clone resolves the tag: the owner's checkout never gets it.
    assert failure.task == "Ensure the ref the throwaway account fetched is the pinned commit", failure.message
    assert failure.message.startswith(f"node9: {served['base']}verl.git ref v0.4.1 is commit '{moved}'.")
    assert SECRET not in failure.message and served["seen"]["authorized"] > 0
    assert f"Required: verl 0.4.1 at commit {released}" in failure.message and "Refused" in failure.message
    assert not (tmp_path / "checkout" / ".git").exists()
    assert not (tmp_path / "env" / "p40fleet-verl-dependencies.lock.txt").exists()
    # The account and root's staging went with the failure.
    assert not account_exists(account)
    assert not (tmp_path / "state" / "verl-fetch").exists() and not (tmp_path / "state" / "verl-stage").exists()


def test_no_commit_pin_is_refused_a_tag_alone_is_never_trusted(run_playbook, shared) -> None:
    tmp_path = shared
    repo, _, _ = make_repo(tmp_path)
    result = run_verl(run_playbook, tmp_path, repo, "")
    assert result.rc != 0
    (failure,) = result.failures
    assert failure.task == "Ensure the verl inputs and the env they need are usable"
    assert "a tag alone is never trusted" in failure.message
    assert not (tmp_path / "checkout" / ".git").exists()


# --- The clone's credentials and the env owner ----------------------------------------------------------------------
SECRET = "pa55w0rd"  # tests.test_git_credentials.AuthHandler's


def serve(handler) -> tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def hostile_owner(shared):
    """An env owner of its own with a home (plant_gitconfig writes its ~/.gitconfig), hooks that write their
    environment out, and a server of its own that asks for basic auth (AuthHandler, over an empty directory) and
    counts the requests that bring the clone's credentials."""
    name = throwaway_name()
    home = shared / "owner-home"
    made = ["useradd", "--uid", free_uid(), "--home-dir", str(home), "--create-home", "--shell", "/bin/sh", name]
    subprocess.run(made, check=True)
    seen = {"command_lines": [], "authorized": 0}
    (shared / "owner-served").mkdir()
    server, thread = serve(partial(AuthHandler, seen=seen, directory=str(shared / "owner-served")))
    try:
        hooks = home / "hooks"
        hooks.mkdir()
        for hook in ("reference-transaction", "post-checkout", "post-merge"):
            (hooks / hook).write_text(f"#!/bin/sh\nenv >> {home}/captured\n")
            (hooks / hook).chmod(0o755)
        yield {"name": name, "home": home, "seen": seen, "port": server.server_address[1]}
    finally:
        server.shutdown()
        thread.join()
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", name], check=False)


def plant_gitconfig(owner: dict, real_base: str, vector: str) -> None:
    """The owner's ~/.gitconfig, by VECTOR: hooks (run in git's environment, where the credential helper's
    variables are) or a url.insteadOf sending the clone to the owner's server."""
    home = owner["home"]
    lines = {
        "hooks": ["[core]", f"\thooksPath = {home}/hooks"],
        "insteadof": [f'[url "http://127.0.0.1:{owner["port"]}/"]', f"\tinsteadOf = {real_base}"],
    }[vector]
    (home / ".gitconfig").write_text("\n".join(lines) + "\n")
    subprocess.run(["chown", "-R", owner["name"], str(home)], check=True)


@pytest.fixture
def serving(shared):
    """Serves a repository over git's dumb HTTP behind basic auth (tests.test_git_credentials.AuthHandler: 401
    without the credentials, as a private mirror answers): the throwaway account cannot read a local repository
    of another account's ("dubious ownership"), and a mirror is what has credentials."""
    servers = []

    def serve_repo(repo: Path) -> dict:
        served = shared / "served"
        served.mkdir()
        git("clone", "-q", "--bare", str(repo), str(served / "verl.git"), cwd=shared)
        git("update-server-info", cwd=served / "verl.git")
        seen = {"command_lines": [], "authorized": 0}
        servers.append(serve(partial(AuthHandler, seen=seen, directory=str(served))))
        base = f"http://127.0.0.1:{servers[-1][0].server_address[1]}/"
        return {"base": base, "url": base.replace("http://", f"http://fleet:{SECRET}@") + "verl.git", "seen": seen}

    yield serve_repo
    for server, thread in servers:
        server.shutdown()
        thread.join()


# Each fails on the code before the throwaway account: the owner's clone ran its hooks with the credential helper's
# variables in their environment, and followed its insteadOf to its server with the credentials. (A helper of the
# owner's own was already cleared by fleet_state_git_checkout.sh's `-c credential.helper=`.)
@pytest.mark.parametrize("vector", ["hooks", "insteadof"])
def test_the_owners_gitconfig_hooks_and_servers_never_see_the_clones_credentials(
    run_playbook, shared, hostile_owner, serving, vector
) -> None:
    repo, released, _ = make_repo(shared)
    git("tag", "-f", "v0.4.1", released, cwd=repo)  # the tag where it belongs
    served_verl = {**serving(repo), "commit": released}
    plant_gitconfig(hostile_owner, served_verl["base"], vector)
    account = throwaway_name()
    result = run_verl(run_playbook, shared, served_verl["url"], served_verl["commit"], hostile_owner["name"], account)
    # No process, file or server of the owner's got the credentials: no hook ran with them in its environment, its
    # server was never sent them ...
    captured = hostile_owner["home"] / "captured"
    assert not captured.exists() or SECRET not in captured.read_text()
    assert hostile_owner["seen"]["authorized"] == 0
    assert not [line for line in served_verl["seen"]["command_lines"] if SECRET in line]
    # ... yet the clone used them (the server let it in).
    assert served_verl["seen"]["authorized"] > 0
    # The owner's checkout is the pinned commit, the owner's, with the bare URL as its origin and no credentials.
    checkout = shared / "checkout"
    assert (checkout / ".git" / "HEAD").read_text().strip() == served_verl["commit"]  # detached at it
    assert checkout.stat().st_uid == pwd.getpwnam(hostile_owner["name"]).pw_uid
    config = (checkout / ".git" / "config").read_text()
    assert SECRET not in config and f"url = {served_verl['base']}verl.git" in config
    # The role went on past the checkout and its check (the env is no real one: the lock is where it stops).
    assert [f.task for f in result.failures] != [] and all(
        f.task
        not in (
            "Ensure the checkout is the pinned verl release",
            "Ensure the ref the throwaway account fetched is the pinned commit",
        )
        for f in result.failures
    ), [(f.task, f.message) for f in result.failures]
    assert not account_exists(account)
    assert not (shared / "state" / "verl-fetch").exists() and not (shared / "state" / "verl-stage").exists()

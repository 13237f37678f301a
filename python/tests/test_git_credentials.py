"""Credentials in a git URL (apex's and verl's checkouts): in no command line, no file others can read, no message.

The filter (plugins/filter/fleet_state.py) splits the URL; the checkout script (fleet_state_git_checkout.sh) takes
the bare URL on its command line and the credentials on stdin. Here the real script and the real git clone from a
local HTTP server that asks for basic auth, while every process's command line on this machine is read at each
request: the password must be in none, nor in the checkout's files, yet the server must have received it.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import subprocess
import tempfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main
from tests.test_pip_credentials import rendered, walk_tasks

rules = load_module(REPO_ROOT / "plugins" / "filter" / "fleet_state.py", "fleet_state_filters")
SCRIPT = REPO_ROOT / "owner_scripts" / "fleet_state_git_checkout.sh"
SECRET = "pa55w0rd"


@pytest.mark.parametrize(
    ("url", "bare", "stdin"),
    [
        ("https://github.com/NVIDIA/apex.git", "https://github.com/NVIDIA/apex.git", ""),
        (
            f"https://fleet:{SECRET}@mirror.internal/git/apex.git",
            "https://mirror.internal/git/apex.git",
            f"fleet\n{SECRET}\n",
        ),
        # A token as the user, a port, percent-encoding (git decodes it too), an @ in the password.
        ("http://ghp_T0KEN@mirror.internal:8080/v.git", "http://mirror.internal:8080/v.git", "ghp_T0KEN\n\n"),
        ("https://a%40b:p%3Aw@h/r.git", "https://h/r.git", "a@b\np:w\n"),
        ("https://u:p@ss@h/r.git", "https://h/r.git", "u\np@ss\n"),
        # ssh's user is a login name, not a secret; local paths and scp-like addresses pass unchanged.
        ("ssh://git@github.com/NVIDIA/apex.git", "ssh://git@github.com/NVIDIA/apex.git", ""),
        ("git@github.com:NVIDIA/apex.git", "git@github.com:NVIDIA/apex.git", ""),
        ("/srv/git/apex.git", "/srv/git/apex.git", ""),
    ],
)
def test_the_url_is_split_into_what_is_shown_and_what_goes_on_stdin(url, bare, stdin):
    assert rules.fleet_state_git_remote(url, "node7") == {"url": bare, "stdin": stdin}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            f"ssh://git:{SECRET}@h/r.git",
            "node7: the git URL ssh://h/r.git carries a password, which git reads only over http(s).",
        ),
        (
            "https://u:a%0Ab@h/r.git",
            "node7: the credentials of the git URL https://h/r.git hold a line break or NUL,",
        ),
        ("https://[::1/r.git", "node7: the git URL cannot be read ("),
    ],
)
def test_a_url_whose_credentials_cannot_be_kept_apart_is_refused_without_showing_them(url, message):
    with pytest.raises(AnsibleFilterError) as raised:
        rules.fleet_state_git_remote(url, "node7")
    assert str(raised.value).startswith(message)
    assert SECRET not in str(raised.value) and "a%0Ab" not in str(raised.value)


def test_every_checkout_takes_the_bare_url_and_its_credentials_on_stdin_as_a_throwaway_account():
    found = []
    for role, tasks, account in (
        ("apex", "build.yml", "apex_build_account"),
        ("verl", "checkout.yml", "verl_fetch_account"),
    ):
        for task in walk_tasks(yaml.safe_load((REPO_ROOT / "roles" / role / "tasks" / tasks).read_text())):
            run = task.get("p40fleet.fleet.fleet_state_owner_run") or {}
            if "fleet_state_git_checkout.sh" in str(run.get("argv")) and "stdin" in run:
                assert run["argv"][4] == f"{{{{ {role}_git_remote.url }}}}", role
                assert run["stdin"] == f"{{{{ {role}_git_remote.stdin }}}}", role
                # Never the env owner, whose git configuration and processes could read them.
                assert run["owner"] == f"{{{{ {account} }}}}", role
                found.append(role)
            elif "fleet_state_git_checkout.sh" in str(run.get("argv")):
                # verl's owner fetches from root's bundle, with no credentials, keeping the bare URL as origin.
                assert (role, run["owner"]) == ("verl", "{{ verl_owner }}")
                assert run["argv"][4] == "{{ verl_fetch_stage_dir }}/verl.bundle"
                assert run["argv"][-1] == "{{ verl_git_remote.url }}"
    assert found == ["apex", "verl"]


def test_the_roles_pass_the_bare_url_and_the_credentials_apart(tmp_path):
    found = rendered(
        tmp_path,
        {
            "apex_git_url": f"https://fleet:{SECRET}@mirror.internal/git/apex.git",
            "verl_git_source": "mirror",
            "verl_mirror_url": f"https://fleet:{SECRET}@mirror.internal/",
        },
    )
    assert found["apex_remote"] == {"url": "https://mirror.internal/git/apex.git", "stdin": f"fleet\n{SECRET}\n"}
    assert found["verl_remote"] == {"url": "https://mirror.internal/git/verl.git", "stdin": f"fleet\n{SECRET}\n"}


class AuthHandler(SimpleHTTPRequestHandler):
    """Git's dumb HTTP protocol from a directory, behind basic auth; every process's command line read per request."""

    def __init__(self, *args, seen, **kwargs):
        self.seen = seen
        super().__init__(*args, **kwargs)

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.seen["command_lines"].extend(command_lines())
        expected = "Basic " + base64.b64encode(f"fleet:{SECRET}".encode()).decode()
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mirror"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.seen["authorized"] += 1
        super().do_GET()


def command_lines() -> list[str]:
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def served(tmp_path):
    """A repository with one commit, served over HTTP behind basic auth, and a home and a destination to clone to."""
    work, repos, home = tmp_path / "work", tmp_path / "served", tmp_path / "home"
    for directory in (work, repos, home):
        directory.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    (work / "setup.py").write_text("print('apex')\n")
    git("add", ".", cwd=work)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one", cwd=work)
    git("clone", "-q", "--bare", str(work), str(repos / "apex.git"), cwd=tmp_path)
    git("update-server-info", cwd=repos / "apex.git")
    seen = {"command_lines": [], "authorized": 0}
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(AuthHandler, seen=seen, directory=str(repos)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    bare = f"http://127.0.0.1:{server.server_address[1]}/apex.git"
    try:
        yield SimpleNamespace(
            bare=bare,
            url=bare.replace("http://", f"http://fleet:{SECRET}@"),
            commit=git("rev-parse", "HEAD", cwd=work),
            seen=seen,
            home=home,
            dest=tmp_path / "checkout",
        )
    finally:
        server.shutdown()
        thread.join()


def checkout(served, url=None):
    """The script as fleet_state_owner_run starts it: argv and stdin as the roles pass them (argv, result)."""
    remote = rules.fleet_state_git_remote(url or served.url, "node7")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(served.home), "GIT_CONFIG_NOSYSTEM": "1"}
    argv = ["/bin/bash", "-c", SCRIPT.read_text(), "checkout", remote["url"], str(served.dest), served.commit, "yes"]
    done = subprocess.run(argv, input=remote["stdin"], env=env, capture_output=True, text=True, check=False)
    return argv, done


def test_a_clone_with_credentials_keeps_them_off_every_command_line_and_file(served):
    argv, done = checkout(served)
    assert done.returncode == 0, done.stderr
    assert f"after={served.commit}" in done.stdout.splitlines()
    # The server asked for the credentials and got them: the clone did use them.
    assert served.seen["authorized"] > 0
    assert not any(SECRET in word for word in argv)
    assert served.seen["command_lines"] and not [line for line in served.seen["command_lines"] if SECRET in line]
    files = [*served.dest.rglob("*"), *served.home.rglob("*")]
    assert [p for p in files if p.is_file() and SECRET.encode() in p.read_bytes()] == []
    assert SECRET not in done.stdout + done.stderr
    # A re-run fetches through the same helper, from an origin without credentials.
    served.seen["authorized"] = 0
    _, again = checkout(served)
    assert again.returncode == 0, again.stderr
    assert served.seen["authorized"] > 0
    assert git("remote", "get-url", "origin", cwd=served.dest) == served.bare


def test_an_earlier_clone_s_url_with_credentials_is_replaced_by_the_bare_one(served):
    # What an earlier p40fleet left: the credentials in the checkout's .git/config, readable by every account.
    env = {"HOME": str(served.home), "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "clone", "-q", served.url, str(served.dest)], check=True, capture_output=True, env=env)
    assert SECRET in (served.dest / ".git" / "config").read_text()
    _, done = checkout(served)
    assert done.returncode == 0, done.stderr
    assert SECRET not in (served.dest / ".git" / "config").read_text()


def test_wrong_credentials_fail_without_a_prompt_and_without_showing_them(served):
    _, done = checkout(served, served.bare.replace("http://", "http://fleet:wrong-guess@"))
    assert done.returncode != 0
    assert served.seen["authorized"] == 0
    assert "wrong-guess" not in done.stdout + done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_through_root_s_module_the_result_and_its_invocation_hold_no_credentials(served):
    """As the roles run it: fleet_state_owner_run starts the script as another account (`nobody` plays the owner)."""
    run_module = load_module(REPO_ROOT / "plugins" / "modules" / "fleet_state_owner_run.py", "fleet_state_owner_run")
    remote = rules.fleet_state_git_remote(served.url, "node7")
    with tempfile.TemporaryDirectory() as scratch:
        os.chmod(scratch, 0o777)
        arguments = {
            "owner": "nobody",
            "argv": [
                "/bin/bash",
                "-c",
                SCRIPT.read_text(),
                "checkout",
                remote["url"],
                f"{scratch}/apex",
                served.commit,
                "yes",
            ],
            "stdin": remote["stdin"],
            "environment": {"GIT_CONFIG_NOSYSTEM": "1"},
            "host": "node7",
        }
        result = run_module_main(run_module, arguments)
        printed = json.dumps(result)
        assert result["rc"] == 0, result
        assert f"after={served.commit}" in result["stdout"]
        assert served.seen["authorized"] > 0
        assert SECRET not in printed
        assert not [line for line in served.seen["command_lines"] if SECRET in line]
        config = Path(scratch, "apex", ".git", "config")
        assert config.stat().st_uid == pwd.getpwnam("nobody").pw_uid and SECRET not in config.read_text()

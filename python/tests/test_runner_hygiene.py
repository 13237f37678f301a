"""Runner hygiene, proved with planted secrets on a real localhost run (no containers): runs live
under the state directory, the last N are kept, and no secret reaches any file there: not a token
given with -e, not an environment variable passed on, not one left behind."""

from __future__ import annotations

import hashlib
import json
import secrets

import p40fleet
from p40fleet import api, state
from p40fleet.run import REDACTED, redact_env
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT
from tests.local_hosts import local_inventory

SECRETS_PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "local_secrets.yml"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_no_planted_secret_reaches_a_file_under_the_state_dir(tmp_path, monkeypatch):
    token = "hf_" + secrets.token_urlsafe(24)  # a vault-style token, given with -e
    passed = "passed-" + secrets.token_urlsafe(18)  # an environment variable the play needs
    kept = "kept-" + secrets.token_urlsafe(18)  # one it does not
    proxy_password = secrets.token_urlsafe(12)
    monkeypatch.setenv("P40FLEET_TEST_PASSED_SECRET", passed)
    monkeypatch.setenv("P40FLEET_TEST_KEPT_SECRET", kept)
    monkeypatch.setenv("https_proxy", f"http://ops:{proxy_password}@127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "*")
    digests = tmp_path / "digests"
    state_dir = tmp_path / "state"
    inventory = local_inventory(tmp_path)

    result = p40fleet.provision(
        inventory,
        playbook=SECRETS_PLAYBOOK,
        extra_vars=[f"p40fleet_test_token={token}", f"p40fleet_test_digests={digests}"],
        pass_env=["P40FLEET_TEST_PASSED_SECRET"],
        state_dir=state_dir,
    )
    assert result.exit_code == api.EXIT_OK, result.run.stdout
    assert result.hosts["localhost"].state == "changed"
    # The play got the token and the passed variable, and not the other one.
    assert digests.read_text().split() == [sha(token), sha(passed), sha("")]

    files = [p for p in state_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"command", "stdout", "rc", "status", "last-report.json", "hosts.json", "lock"} <= names
    assert any(p.parent.name == "job_events" for p in files)
    assert not any(p.parent.name == "env" for p in files)  # suppress_env_files
    for secret in (token, passed, kept, proxy_password):
        assert [str(p) for p in files if secret.encode() in p.read_bytes()] == []
    assert list((state_dir / "tmp").iterdir()) == []  # the -e file is gone with the run

    command = json.loads((result.artifact_dir / "command").read_text())
    assert any(arg.startswith("@") and arg.endswith(".json") for arg in command["command"])
    assert command["env"]["P40FLEET_TEST_PASSED_SECRET"] == REDACTED
    assert "P40FLEET_TEST_KEPT_SECRET" not in command["env"]
    assert command["env"]["https_proxy"] == f"http://{REDACTED}@127.0.0.1:9"
    assert command["env"]["ANSIBLE_HOST_KEY_CHECKING"] == "True"


def test_redaction_keeps_what_is_not_secret():
    env = {
        "ANSIBLE_BECOME_PASSWORD_FILE": "/root/.sudo",
        "ANSIBLE_GALAXY_TOKEN": "t0k",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "SSH_AUTH_SOCK": "/run/agent.sock",
        "API_KEY": "k",
        "HTTP_PROXY": "http://proxy:3128",
    }
    assert redact_env(env, ["LANG"]) == {
        **env,
        "ANSIBLE_GALAXY_TOKEN": REDACTED,
        "API_KEY": REDACTED,
    }


def test_the_last_n_runs_are_kept_private_dirs_and_all(tmp_path):
    inventory = local_inventory(tmp_path)
    digests = tmp_path / "digests"
    seen = []
    for _ in range(3):
        result = p40fleet.provision(
            inventory,
            playbook=SECRETS_PLAYBOOK,
            extra_vars={"p40fleet_test_token": "t", "p40fleet_test_digests": str(digests)},
            state_dir=tmp_path / "state",
            keep_runs=2,
        )
        assert result.ok
        seen.append(result.run.private_data_dir)
    runs = StateDir(tmp_path / "state").inventory(inventory).runs()
    assert runs == seen[1:]
    assert not seen[0].exists()
    assert all((run / "artifacts" / run.name / "job_events").is_dir() for run in runs)
    last = StateDir(tmp_path / "state").inventory(inventory).read_last_report()
    assert last["runs"][0]["run_id"] == seen[-1].name


def test_the_state_dir_is_outside_the_repository_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("P40FLEET_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state.default_state_dir() == tmp_path / "xdg" / "p40fleet"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state.default_state_dir() == tmp_path / "home" / ".local" / "state" / "p40fleet"
    monkeypatch.setenv("P40FLEET_STATE_DIR", str(tmp_path / "mine"))
    assert StateDir().root == tmp_path / "mine"
    monkeypatch.setenv("P40FLEET_KEEP_RUNS", "0")
    try:
        state.default_keep_runs()
    except ValueError as error:
        assert "at least 1" in str(error)
    else:
        raise AssertionError("P40FLEET_KEEP_RUNS=0 was accepted")

"""Credentials in an index URL: the torch lock's index reaches pip in its environment, not on its command
line (`ps` shows every account a command line), and the env's pip.conf, which names the same URLs, is the owner's
alone (0600). The role's values are rendered on the controller (python/tests/playbooks/mirror_sources.yml)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT

INDEX = "https://fleet:pa55w0rd@mirror.example.internal/whl/cu118"


def rendered(tmp_path, variables):
    inventory = tmp_path / "inventory"
    (inventory / "host_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(
        yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {"h": {"ansible_host": "192.0.2.1"}}}}}})
    )
    (inventory / "host_vars" / "h.yml").write_text(yaml.safe_dump(variables))
    result = run_playbook(REPO_ROOT / "python" / "tests" / "playbooks" / "mirror_sources.yml", inventory / "hosts.yml")
    assert result.rc == 0, result.stdout
    return next(e["event_data"]["res"]["msg"] for e in result.events if e["event"] == "runner_on_ok")


def lock_digest(found):
    """The marker's digest: the lock's text, then pip's sources (its environment, then its options) as one line."""
    content = Path(found["lock_source"]).read_text() + "\n" if found["lock_source"] else ""
    sources = [f"{k}={v}" for k, v in sorted(found["lock_pip_environment"].items())] + found["lock_pip_options"]
    return hashlib.sha1((content + " ".join(sources)).encode()).hexdigest()


def test_the_index_and_its_credentials_stay_off_pips_command_line(tmp_path):
    found = rendered(tmp_path, {"pytorch_index_url": INDEX})
    assert not any("pa55w0rd" in word or "mirror.example.internal" in word for word in found["lock_pip_options"])
    # The torch lock reads the cu118 index and PyPI (either may serve a locked file), both from the environment.
    assert found["lock_pip_environment"] == {
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": INDEX,
        "PIP_EXTRA_INDEX_URL": "https://pypi.org/simple",
    }
    # The marker's digest covers the sources in the environment: another index installs the lock again.
    assert found["lock_digest"] == lock_digest(found)
    other = rendered(tmp_path / "other", {"pytorch_index_url": INDEX.replace("pa55w0rd", "other")})
    assert other["lock_digest"] != found["lock_digest"]


def test_no_index_stays_as_it_was(tmp_path):
    found = rendered(tmp_path, {"pytorch_no_index": True, "pytorch_find_links": ["/srv/wheels"]})
    assert found["lock_pip_options"][:2] == ["--no-index", "--find-links=/srv/wheels"]
    assert found["lock_pip_environment"] == {"PIP_CONFIG_FILE": "/dev/null"}
    assert found["lock_digest"] == lock_digest(found)


def test_the_envs_pip_conf_is_the_owners_alone():
    tasks = yaml.safe_load((REPO_ROOT / "roles" / "pytorch" / "tasks" / "install.yml").read_text())
    (written,) = [t for t in tasks if t.get("fleet_state_path", {}).get("path") == "{{ pytorch_pip_conf_path }}"]
    assert written["fleet_state_path"]["mode"] == "0600"

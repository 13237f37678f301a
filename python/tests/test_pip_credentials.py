"""Credentials in an index URL (issue 41): the torch lock's index reaches pip in its environment, not on its command
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


def lock_digest(found, options):
    """The marker's digest as the role made it before: the lock's text, then pip's source options as one line."""
    content = Path(found["lock_source"]).read_text() + "\n" if found["lock_source"] else ""
    return hashlib.sha1((content + " ".join(options)).encode()).hexdigest()


def test_the_index_and_its_credentials_stay_off_pips_command_line(tmp_path):
    found = rendered(tmp_path, {"pytorch_index_url": INDEX})
    assert not any("pa55w0rd" in word or "mirror.example.internal" in word for word in found["lock_pip_options"])
    assert found["lock_pip_environment"] == {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": INDEX}
    # The lock's marker digest is the one it was when the index was on the command line: converged hosts keep it.
    assert found["lock_digest"] == lock_digest(found, ["--index-url", INDEX, *found["lock_pip_options"]])


def test_no_index_stays_as_it_was(tmp_path):
    found = rendered(tmp_path, {"pytorch_no_index": True, "pytorch_find_links": ["/srv/wheels"]})
    assert found["lock_pip_options"][:2] == ["--no-index", "--find-links=/srv/wheels"]
    assert found["lock_pip_environment"] == {"PIP_CONFIG_FILE": "/dev/null"}
    assert found["lock_digest"] == lock_digest(found, found["lock_pip_options"])


def test_the_envs_pip_conf_is_the_owners_alone():
    tasks = yaml.safe_load((REPO_ROOT / "roles" / "pytorch" / "tasks" / "install.yml").read_text())
    (written,) = [t for t in tasks if t.get("fleet_state_path", {}).get("path") == "{{ pytorch_pip_conf_path }}"]
    assert written["fleet_state_path"]["mode"] == "0600"

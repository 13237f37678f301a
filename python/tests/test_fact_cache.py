"""No fact outlives its run (docs/privileges.md), with the checkout's ansible.cfg as an operator's plain
ansible-playbook uses it.

ansible.cfg kept a jsonfile cache in the checkout's .fact_cache for a day, keyed by the host's name alone: a fact
a forged module result carried (conda_env_install_prefix: /srv/canary) was read back by the next run of any
inventory from that checkout with a host of that name, a fresh sandbox host among them, and outranked the role's
defaults and the inventory. A cacheable set_fact of a role's own input did the same after the inventory changed
(cuda_toolkit_home). The cache is the run's own now (memory), as under `p40fleet run`, whose ansible-runner
keeps one per run; no role asks for a cacheable fact. Two runs on the controller (local connection) show it.
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from p40fleet.paths import ANSIBLE_CONFIG
from p40fleet_dev.paths import REPO_ROOT

HOST = "fact-cache-forged-node"
FORGE = """---
- name: A module result that carries a fact, as the owner's hook made the conda probe's
  hosts: all
  gather_facts: false
  tasks:
    - name: Forge
      ansible.builtin.set_fact:
        conda_env_install_prefix: /srv/canary
        cacheable: true
"""
READ = """---
- name: What the next run sees
  hosts: all
  gather_facts: false
  tasks:
    - name: Show
      ansible.builtin.debug:
        msg: "prefix={{ conda_env_install_prefix | default('unset') }}"
"""


def write_inventory(tmp_path: Path) -> Path:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"hosts": {HOST: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}
        )
    )
    return inventory


def play(tmp_path: Path, text: str) -> str:
    playbook = tmp_path / "play.yml"
    playbook.write_text(text)
    inventory = write_inventory(tmp_path)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_CACHE") and not k.startswith("ANSIBLE_FACT")
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), str(playbook)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={**env, "ANSIBLE_CONFIG": str(ANSIBLE_CONFIG), "ANSIBLE_FORCE_COLOR": "0"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_forged_fact_is_not_read_back_by_the_next_run(tmp_path):
    play(tmp_path, FORGE)
    shown = play(tmp_path, READ)
    assert "prefix=unset" in shown, shown
    # Nothing of the host was written where a later run (of any inventory) could read it.
    for where in (tmp_path, REPO_ROOT, ANSIBLE_CONFIG.parent):
        cache = where / ".fact_cache"
        assert not any(HOST in path.name for path in cache.glob("*")) if cache.exists() else True


def test_ansible_cfg_keeps_facts_for_the_run_only():
    config = configparser.ConfigParser()
    config.read(ANSIBLE_CONFIG)
    assert config["defaults"]["fact_caching"] == "memory"
    assert "fact_caching_connection" not in config["defaults"]


def test_no_role_or_playbook_asks_for_a_cacheable_fact():
    cached = []
    for path in [*REPO_ROOT.glob("roles/*/tasks/*.yml"), *REPO_ROOT.glob("playbooks/*.yml")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("cacheable:") and "false" not in line:
                cached.append(f"{path.relative_to(REPO_ROOT)}:{number}")
    assert cached == [], json.dumps(cached)


def test_p40fleet_runs_keep_facts_in_memory_whatever_the_environment_names(tmp_path, monkeypatch):
    """ansible-runner put a jsonfile cache into every run's artifacts, over ansible.cfg's memory cache and over the
    caller's own choice: a converged 4-host site.yml paid about 0.5 s of controller CPU for it. p40fleet's runs keep
    facts in memory, as ansible.cfg's do, also where the environment names a file cache that outlives the run."""
    from p40fleet.run import run_playbook

    shared = tmp_path / "shared-cache"
    monkeypatch.setenv("ANSIBLE_CACHE_PLUGIN", "jsonfile")
    monkeypatch.setenv("ANSIBLE_CACHE_PLUGIN_CONNECTION", str(shared))
    playbook = tmp_path / "forge.yml"
    playbook.write_text(FORGE)
    inventory = write_inventory(tmp_path)
    forged = run_playbook(playbook, inventory, state_dir=tmp_path / "state")
    assert forged.rc == 0, forged.stdout
    assert json.loads((forged.artifact_dir / "command").read_text())["env"]["ANSIBLE_CACHE_PLUGIN"] == "memory"
    assert not (forged.artifact_dir / "fact_cache").exists()
    assert not shared.exists()
    playbook.write_text(READ)
    shown = run_playbook(playbook, inventory, state_dir=tmp_path / "state")
    assert "prefix=unset" in shown.stdout, shown.stdout

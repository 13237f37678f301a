"""The main command never succeeds at nothing (no containers): ansible-playbook site.yml with no inventory, an
unparsable one, or a limit that matches no host exits non-zero with Ansible's message (ansible.cfg [inventory])."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p40fleet_dev.paths import REPO_ROOT

PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
EXAMPLE = REPO_ROOT / "inventory" / "hosts.example.yml"


def site(inventory: Path, limit: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_CONFIG"] = str(REPO_ROOT / "ansible.cfg")
    argv = [PLAYBOOK, "-i", str(inventory), str(REPO_ROOT / "site.yml"), "-l", limit, "--list-hosts"]
    return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)


def test_the_default_inventory_is_the_operators_copy_and_its_absence_fails():
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "ansible.cfg")
    assert config["defaults"]["inventory"] == "inventory/hosts.yml"
    assert config["inventory"].getboolean("unparsed_is_failed")
    assert config["inventory"]["host_pattern_mismatch"] == "error"


def test_the_quick_starts_command_before_the_inventory_is_copied_fails(tmp_path):
    """`ansible-playbook site.yml -l p40-hosts` as a new user runs it: no -i, and no inventory/hosts.yml beside the
    checkout's ansible.cfg (a copy of the checkout without the operator's inventory)."""
    shutil.copy(REPO_ROOT / "ansible.cfg", tmp_path / "ansible.cfg")
    for name in ("site.yml", "roles", "plugins"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_CONFIG"] = str(tmp_path / "ansible.cfg")
    argv = [PLAYBOOK, "site.yml", "-l", "p40-hosts", "--list-hosts"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "inventory/hosts.yml as an inventory source" in result.stderr
    assert "No inventory was parsed, please check" in result.stderr


@pytest.mark.parametrize("text", [None, "all: [\n", "p40-hosts:\n  hosts: [a\n"], ids=["missing", "yaml", "flow"])
def test_no_inventory_fails(tmp_path, text):
    inventory = tmp_path / "hosts.yml"
    if text is not None:
        inventory.write_text(text)
    result = site(inventory, "p40-hosts")
    assert result.returncode != 0
    assert f"Unable to parse {inventory}" in result.stderr and "No inventory was parsed, please check" in result.stderr


def test_a_limit_that_matches_no_host_fails():
    result = site(EXAMPLE, "nosuch")
    assert result.returncode != 0
    assert "Could not match supplied host pattern, ignoring: nosuch" in result.stderr


def test_the_example_inventory_with_the_fleet_group_lists_its_hosts():
    result = site(EXAMPLE, "p40-hosts")
    assert result.returncode == 0, result.stderr
    assert "gpu-rack1-01" in result.stdout


EMPTY_GROUP = "p40-hosts:\n  hosts: {}\nothers:\n  hosts:\n    elsewhere: {ansible_connection: local}\n"


@pytest.mark.parametrize("config", ["checkout", "none"])
@pytest.mark.parametrize("inventory", ["empty_group", "no_inventory"])
def test_an_empty_fleet_group_fails_with_or_without_the_checkouts_config(tmp_path, config, inventory):
    """site.yml's first play fails the run when p40-hosts holds no host: under the checkout's ansible.cfg, and under
    no configuration at all (the play's own check, not ansible.cfg's [inventory] settings). Before it, an inventory
    with an empty p40-hosts group ran nothing and exited 0 under either."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    (tmp_path / "empty.cfg").write_text("")
    env["ANSIBLE_CONFIG"] = str(REPO_ROOT / "ansible.cfg") if config == "checkout" else str(tmp_path / "empty.cfg")
    argv = [PLAYBOOK, str(REPO_ROOT / "site.yml")]
    if inventory == "empty_group":
        (tmp_path / "hosts.yml").write_text(EMPTY_GROUP)
        argv += ["-i", str(tmp_path / "hosts.yml")]
    elif config == "checkout":
        argv += ["-i", "localhost,"]  # the checkout's config fails a missing inventory before any play
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "The inventory has no host in the group p40-hosts" in result.stdout + result.stderr, result.stdout[-3000:]

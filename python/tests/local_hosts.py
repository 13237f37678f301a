"""An inventory of the controller itself, for tests that run a real playbook without a sandbox."""

from __future__ import annotations

import pwd
import random
import sys
import uuid
from pathlib import Path

from p40fleet_dev.paths import REPO_ROOT


def local_inventory(tmp_path: Path) -> Path:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        "      ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    return inventory


def run_verl_role(run_playbook, tmp_path: Path, extra: dict):
    """The verl role alone on the controller as host node9 (root acts as the env owner through su, no sudo)."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n    node9:\n      ansible_connection: local\n"
        f"      ansible_python_interpreter: {sys.executable}\n      ansible_become_method: ansible.builtin.su\n"
    )
    playbook = tmp_path / "verl.yml"
    playbook.write_text(f"- hosts: all\n  gather_facts: false\n  roles:\n    - role: {REPO_ROOT / 'roles' / 'verl'}\n")
    env = tmp_path / "env"
    variables = {
        "p40fleet_conda_env_dir": str(env),
        "p40fleet_conda_python": str(env / "bin" / "python"),
        "p40fleet_env_owner": "nobody",
        "verl_checkout_dir": str(tmp_path / "verl"),
        **extra,
    }
    return run_playbook(playbook, inventory, extra_vars=variables, envvars={"ANSIBLE_CACHE_PLUGIN": "memory"})


# The environment of a playbook whose local host has root play the env owner (fleet_state_owner_run refuses uid 0
# otherwise): for tests whose interpreter lies in root's 0700 home, where no other account can run it.
ROOT_PLAYS_OWNER = {"P40FLEET_TEST_ROOT_PLAYS_OWNER": "1"}


def throwaway_name() -> str:
    """A fresh name for a role's throwaway account: tests of other workers make theirs at the same time."""
    return f"p40t-{uuid.uuid4().hex[:10]}"


def free_uid() -> str:
    """A uid no account here has, far above the system and login ranges, for an account a test's role makes on this
    machine: the sandbox containers share this machine's uids, and the role's `pkill -u` of an account at, say, 999
    would kill their env owner's processes too."""
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return str(random.choice([uid for uid in range(61000, 64000) if uid not in taken]))


def account_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True

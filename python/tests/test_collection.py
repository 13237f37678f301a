"""The roles and playbooks as the Ansible collection p40fleet.fleet: built offline, all of it, nothing else; installed
with ansible-galaxy, its playbook p40fleet.fleet.site converges a sandbox host from a directory outside the
checkout, with nothing of the checkout on Ansible's paths, and an operator's own playbook there (no ansible.cfg)
uses its role, module and filter by their full names. With no inventory, its site playbook fails.

The host converges for test_owner_fleet.py's env owner, logging in as root, so that its disk is the owner image that
module and test_sandbox_docs.py start from (p40fleet_dev.images.publish_owner): the three modules are one work unit,
this one first, and the suite converges one host fewer. A sudo login through the whole pipeline is the fault suite's
node1 (docs/dev/faults.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from p40fleet.collection import collection_files
from p40fleet_dev import images
from p40fleet_dev.paths import REPO_ROOT
from tests.test_owner_fleet import OWNER

# One work unit with the modules that start from the host this one converges (its disk is their image).
pytestmark = pytest.mark.xdist_group("owner-image")

CHECKOUT_ONLY = (".venv/", ".cache/", ".sandbox/", ".runs/", ".fact_cache/", "python/", "molecule/", "build/")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collection")
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    # No proxy and no Galaxy server: a collection without dependencies builds from the tree alone.
    result = subprocess.run(
        [str(galaxy), "collection", "build", "--output-path", str(out), str(REPO_ROOT)],
        capture_output=True, text=True, env=galaxy_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    meta = yaml.safe_load((REPO_ROOT / "galaxy.yml").read_text())
    tarball = out / f"{meta['namespace']}-{meta['name']}-{meta['version']}.tar.gz"
    assert tarball.is_file(), sorted(p.name for p in out.iterdir())
    return tarball


def galaxy_env(**extra: str) -> dict[str, str]:
    """No proxy, no Galaxy server and nothing of the checkout's Ansible configuration."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("ANSIBLE_")}
    return {**env, "ANSIBLE_GALAXY_SERVER": "http://127.0.0.1:9", **extra}


def packed_files(tarball: Path) -> list[str]:
    with tarfile.open(tarball) as tar:
        manifest = json.load(tar.extractfile("FILES.json"))
    return sorted(entry["name"] for entry in manifest["files"] if entry["ftype"] == "file")


def test_the_collection_holds_every_role_and_playbook(built):
    files = packed_files(built)
    for role in sorted(p.name for p in (REPO_ROOT / "roles").iterdir() if p.is_dir()):
        assert f"roles/{role}/meta/main.yml" in files, role
    for required in (
        "site.yml",
        "playbooks/site.yml",
        "ansible.cfg",
        "playbooks/verify.yml",
        "playbooks/pins.yml",
        "meta/runtime.yml",
        "plugins/lookup/owner_script.py",
        "owner_scripts/verl_patches_tool.py",
    ):
        assert required in files
    assert [f for f in files if f.startswith(CHECKOUT_ONLY) or f == "inventory/hosts.yml"] == []


def test_the_package_selects_exactly_what_the_collection_build_packs(built):
    """setup.py copies collection_files() into the wheel: it must be ansible-galaxy's own selection."""
    assert collection_files(REPO_ROOT) == packed_files(built)


RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> dict:
    """The built collection installed into a collections path of its own; a working directory outside the checkout,
    without an ansible.cfg; the environment that names that collections path and nothing of the checkout."""
    root = tmp_path_factory.mktemp("installed")
    collections, work = root / "collections", root / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(REPO_ROOT)
    env = galaxy_env(ANSIBLE_COLLECTIONS_PATH=str(collections))
    installed = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "-p", str(collections), str(built)],
        capture_output=True, text=True, env=env, cwd=work, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (collections / "ansible_collections" / "p40fleet" / "fleet" / "playbooks" / "site.yml").is_file()
    assert not (work / "ansible.cfg").exists()
    return {"collections": collections, "work": work, "env": env}


BIN = Path(sys.executable).parent

# An operator's own playbook: the collection's role, a module and a filter, each by its full name.
OPERATOR_PLAYBOOK = """\
---
- name: An operator's own play with p40fleet.fleet's role, module and filter
  hosts: p40-hosts
  gather_facts: false
  roles:
    - role: p40fleet.fleet.gpu_preflight
  tasks:
    - name: Read the host's interfaces with the collection's module
      p40fleet.fleet.ray_cluster_probe:
        address: "{{ ansible_host | default(inventory_hostname) }}"
        env_file: /nonexistent/p40fleet-operator.env
      register: operator_probe
    - name: Check the role's fact, the module's answer and the filter's result
      ansible.builtin.assert:
        that:
          - gpu_preflight_profile.name == 'pascal'
          - operator_probe.interfaces | length > 0
          - operator_probe.env == {}
          - ('py311_24.1.2-0' | p40fleet.fleet.conda_env_installer_python) == '3.11'
"""


def test_the_installed_collections_site_fails_with_no_inventory(installed):
    """From the installed collection, with no ansible.cfg and no inventory (only Ansible's implicit localhost), the
    pipeline fails naming the empty group instead of exiting 0 having done nothing."""
    argv = [str(BIN / "ansible-playbook"), "p40fleet.fleet.site"]
    result = subprocess.run(argv, capture_output=True, text=True, env=installed["env"], cwd=installed["work"])
    assert result.returncode != 0, result.stdout[-3000:]
    assert "The inventory has no host in the group p40-hosts" in result.stdout + result.stderr


@pytest.mark.sandbox
@pytest.mark.converge
def test_the_installed_collection_converges_a_sandbox_host_from_anywhere(installed, make_sandbox):
    env, work = installed["env"], installed["work"]
    fleet = make_sandbox("collection", ["p40"], login="root")
    # The operator's way to name the env owner: the inventory.
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(yaml.safe_dump({"p40fleet_env_owner": OWNER}))
    inventory = ["-i", str(fleet.inventory_dir)]
    argv = [str(BIN / "ansible-playbook"), "p40fleet.fleet.site", *inventory, "-l", "p40-hosts"]

    def play(argv) -> dict[str, tuple[int, ...]]:
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work, check=False)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        return {host: tuple(int(n) for n in counts) for host, *counts in RECAP.findall(result.stdout)}

    first = play(argv)
    assert set(first) == {"node1"}
    _, changed, unreachable, failed = first["node1"]
    assert changed > 0 and unreachable == failed == 0, first
    second = play(argv)
    assert second["node1"][1:] == (0, 0, 0), second
    assert fleet.exec("node1", f"getent passwd {OWNER}").returncode == 0
    images.publish_owner(fleet.host("node1").container, OWNER)

    # The operator's own playbook, beside no ansible.cfg, on the converged host.
    (work / "operator.yml").write_text(OPERATOR_PLAYBOOK)
    own = play([str(BIN / "ansible-playbook"), "operator.yml", *inventory])
    assert set(own) == {"node1"} and own["node1"][2:] == (0, 0), own

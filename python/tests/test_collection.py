"""The roles and playbooks as the Ansible collection p40fleet.fleet: built offline, all of it, nothing else; installed
with ansible-galaxy, its playbook p40fleet.fleet.site converges a sandbox host from a directory outside the
checkout, with nothing of the checkout on Ansible's paths."""

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
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

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
    ):
        assert required in files
    assert [f for f in files if f.startswith(CHECKOUT_ONLY) or f == "inventory/hosts.yml"] == []


def test_the_package_selects_exactly_what_the_collection_build_packs(built):
    """setup.py copies collection_files() into the wheel: it must be ansible-galaxy's own selection."""
    assert collection_files(REPO_ROOT) == packed_files(built)


RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


@pytest.mark.sandbox
@pytest.mark.converge
def test_the_installed_collection_converges_a_sandbox_host_from_anywhere(built, make_sandbox, tmp_path):
    collections, work = tmp_path / "collections", tmp_path / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(REPO_ROOT)
    env = galaxy_env(ANSIBLE_COLLECTIONS_PATH=str(collections))
    bin_dir = Path(sys.executable).parent
    installed = subprocess.run(
        [str(bin_dir / "ansible-galaxy"), "collection", "install", "--offline", "-p", str(collections), str(built)],
        capture_output=True, text=True, env=env, cwd=work, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (collections / "ansible_collections" / "p40fleet" / "fleet" / "playbooks" / "site.yml").is_file()
    fleet = make_sandbox("collection", ["p40"])
    argv = [str(bin_dir / "ansible-playbook"), "p40fleet.fleet.site", "-i", str(fleet.inventory_dir), "-l", "p40-hosts"]

    def play() -> dict[str, tuple[int, ...]]:
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=work, check=False)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        return {host: tuple(int(n) for n in counts) for host, *counts in RECAP.findall(result.stdout)}

    first = play()
    assert set(first) == {"node1"}
    _, changed, unreachable, failed = first["node1"]
    assert changed > 0 and unreachable == failed == 0, first
    second = play()
    assert second["node1"][1:] == (0, 0, 0), second


def test_the_collections_playbooks_reach_every_filter_and_lookup_by_its_short_name():
    """Ansible finds a collection role's filters and lookups only beside the playbook it runs (or in configured
    directories): the loaders in playbooks/ must hand it every one of plugins/."""
    loader = load_module(REPO_ROOT / "playbooks" / "filter_plugins" / "p40fleet_filters.py", "p40fleet_filters")
    wanted = {}
    for path in sorted((REPO_ROOT / "plugins" / "filter").glob("*.py")):
        wanted.update(load_module(path, f"filter_{path.stem}").FilterModule().filters())
    given = loader.FilterModule().filters()
    assert sorted(given) == sorted(wanted)
    assert {name: func.__code__.co_filename for name, func in given.items()} == {
        name: func.__code__.co_filename for name, func in wanted.items()
    }
    lookups = sorted(p.name for p in (REPO_ROOT / "plugins" / "lookup").glob("*.py"))
    assert sorted(p.name for p in (REPO_ROOT / "playbooks" / "lookup_plugins").glob("*.py")) == lookups
    shim = load_module(REPO_ROOT / "playbooks" / "lookup_plugins" / "fleet_state_specs.py", "specs_shim")
    assert shim.LookupModule.run.__code__.co_filename == str(REPO_ROOT / "plugins" / "lookup" / "fleet_state_specs.py")

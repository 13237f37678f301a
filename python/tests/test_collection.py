"""The roles and playbooks as the Ansible collection p40fleet.fleet: built offline, all of it, nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from p40fleet.collection import collection_files
from p40fleet_dev.paths import REPO_ROOT

CHECKOUT_ONLY = (".venv/", ".cache/", ".sandbox/", ".runs/", ".fact_cache/", "python/", "molecule/", "build/")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collection")
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    # No proxy and no Galaxy server: a collection without dependencies builds from the tree alone.
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["ANSIBLE_GALAXY_SERVER"] = "http://127.0.0.1:9"
    result = subprocess.run(
        [str(galaxy), "collection", "build", "--output-path", str(out), str(REPO_ROOT)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    meta = yaml.safe_load((REPO_ROOT / "galaxy.yml").read_text())
    tarball = out / f"{meta['namespace']}-{meta['name']}-{meta['version']}.tar.gz"
    assert tarball.is_file(), sorted(p.name for p in out.iterdir())
    return tarball


def packed_files(tarball: Path) -> list[str]:
    with tarfile.open(tarball) as tar:
        manifest = json.load(tar.extractfile("FILES.json"))
    return sorted(entry["name"] for entry in manifest["files"] if entry["ftype"] == "file")


def test_the_collection_holds_every_role_and_playbook(built):
    files = packed_files(built)
    for role in sorted(p.name for p in (REPO_ROOT / "roles").iterdir() if p.is_dir()):
        assert f"roles/{role}/meta/main.yml" in files, role
    for required in ("site.yml", "ansible.cfg", "playbooks/verify.yml", "playbooks/pins.yml", "meta/runtime.yml"):
        assert required in files
    assert [f for f in files if f.startswith(CHECKOUT_ONLY) or f == "inventory/hosts.yml"] == []


def test_the_package_selects_exactly_what_the_collection_build_packs(built):
    """setup.py copies collection_files() into the wheel: it must be ansible-galaxy's own selection."""
    assert collection_files(REPO_ROOT) == packed_files(built)

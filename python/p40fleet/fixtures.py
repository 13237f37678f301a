"""Test fixtures the sandbox serves: real upstream files fetched ahead of time, and stand-ins.

Real third-party files (verl's sdist and the wheels its config needs) are fetched from PyPI by
`p40fleet fixtures fetch` (run by `make fixtures`), never at test time. Stand-ins for what cannot be
downloaded here (the CUDA runfile, cuDNN, Miniconda, torch cu118 wheels, Apex) are built by the
modules in python/tests/fixtures/standins/artifacts/, each exposing
`build(out_dir, upstream_dir) -> dict` of the inventory variables that point the roles at them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from p40fleet.paths import CACHE_DIR, STANDINS_DIR, UPSTREAM_DIR, UPSTREAM_LIST

BUILDERS_DIR = STANDINS_DIR / "artifacts"


class FixtureError(RuntimeError):
    pass


@dataclass
class StandinArtifacts:
    mirror_dir: Path
    group_vars: dict


def upstream_requirements() -> list[tuple[str, str]]:
    """The (kind, requirement) pairs listed in upstream.txt; kind is sdist or wheel."""
    if not UPSTREAM_LIST.exists():
        return []
    entries = []
    for number, raw in enumerate(UPSTREAM_LIST.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, requirement = line.partition(" ")
        if kind not in {"sdist", "wheel"} or not requirement.strip():
            raise FixtureError(f"{UPSTREAM_LIST}:{number}: expected 'sdist NAME==VER' or 'wheel NAME==VER'")
        entries.append((kind, requirement.strip()))
    return entries


def fetch_upstream() -> Path:
    """Download every listed file once; what is already there is kept."""
    stamp = UPSTREAM_DIR / ".fetched"
    wanted = "\n".join(f"{k} {r}" for k, r in upstream_requirements())
    if stamp.exists() and stamp.read_text() == wanted:
        return UPSTREAM_DIR
    pip = [sys.executable, "-m", "pip"]
    for kind, requirement in upstream_requirements():
        target = UPSTREAM_DIR / kind
        target.mkdir(parents=True, exist_ok=True)
        if kind == "sdist":
            command = [*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", str(target), requirement]
        else:
            # A wheel for the sandbox hosts' Python (3.11, linux x86_64); built when PyPI has only an sdist.
            command = [*pip, "wheel", "--no-deps", "--prefer-binary", "-w", str(target), requirement]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise FixtureError(f"fetching {requirement} ({kind}) failed:\n{result.stdout}\n{result.stderr}")
    stamp.write_text(wanted)
    return UPSTREAM_DIR


def _builders() -> list[Path]:
    return sorted(p for p in BUILDERS_DIR.glob("*.py") if not p.name.startswith("_"))


def standins_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in BUILDERS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(BUILDERS_DIR)).encode())
        digest.update(path.read_bytes())
    for kind, requirement in upstream_requirements():
        digest.update(f"{kind} {requirement}\n".encode())
    return digest.hexdigest()[:16]


def build_standins() -> StandinArtifacts:
    """Build every stand-in into a mirror directory, cached by a hash of the builders."""
    out = CACHE_DIR / "standins" / standins_hash()
    manifest = out / "group_vars.json"
    if manifest.exists():
        return StandinArtifacts(out / "mirror", json.loads(manifest.read_text()))
    upstream = fetch_upstream()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix="building-"))
    group_vars: dict = {}
    try:
        mirror = staging / "mirror"
        mirror.mkdir()
        for path in _builders():
            spec = importlib.util.spec_from_file_location(f"p40fleet_standin_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            produced = module.build(mirror, upstream)
            clash = set(produced) & set(group_vars)
            if clash:
                raise FixtureError(f"stand-in {path.name} sets variables already set by another: {sorted(clash)}")
            group_vars.update(produced)
        (staging / "group_vars.json").write_text(json.dumps(group_vars, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return StandinArtifacts(out / "mirror", group_vars)

"""Test fixtures the sandbox serves: real upstream files fetched ahead of time, and stand-ins.

Real third-party files (verl's sdist and the wheels its config needs) are fetched from PyPI by
`python -m p40fleet_dev fixtures` (run by `make fixtures`), never at test time, and so are the real files of
the sandbox's verl dependency lock and of the PyPI part of its torch lock (fetch_locked_wheels), which the
sandbox mirror serves, and the wheels of
p40fleet's own dependencies (fetch_package_dependencies: a fresh venv installs the p40fleet wheel offline).
Stand-ins for what cannot be downloaded by the tests (the CUDA runfile, cuDNN, Miniconda, torch cu118 wheels, Apex) are
built by the modules in python/tests/fixtures/standins/artifacts/, each exposing
`build(out_dir, upstream_dir) -> dict` of the inventory variables that point the roles at them.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from p40fleet.bundle import LinkFinder, hashed_downloads, parse_hashed_requirements
from p40fleet.fetch import Fetcher, FetchError
from p40fleet.paths import ROLES_DIR
from p40fleet_dev.paths import CACHE_DIR, FIXTURES_DIR, REPO_ROOT, STANDINS_DIR, UPSTREAM_DIR, UPSTREAM_LIST

# The modules that build the stand-ins, one per artifact.
BUILDERS_DIR = STANDINS_DIR / "artifacts"
VERL_LOCKS_DIR = ROLES_DIR / "verl" / "files"
# The sandbox env's Python is the hosts' python3 (Debian 12), which the Miniconda stand-in can only give, and
# the verl release the sandbox installs: together they pick the lock whose real wheels the mirror serves.
SANDBOX_PYTHON = "3.11"
SANDBOX_VERL = "0.4.1"
SANDBOX_TORCH = "2.6.0-cu118"
# What of the torch lock the sandbox serves as stand-ins (torch_wheels.py), not as the real files: torch (its
# index is not reachable), triton and the CUDA libraries (gigabytes, and of no use without the real torch).
TORCH_STANDINS = re.compile(r"^(torch|triton|nvidia-.*)$")
# torch for the CPU venv (p40fleet_dev/cpu_venv.py), with the sandbox's verl lock: the hosts' stack on a CPU.
CPU_TORCH_LOCK = FIXTURES_DIR / "cpu-torch-2.6.0-py311.lock.txt"
# Where the locks' files come from: PyPI's simple API, as pip reads it.
PYPI_SIMPLE = "https://pypi.org/simple"


class FixtureError(RuntimeError):
    pass


@dataclass
class StandinArtifacts:
    mirror_dir: Path
    group_vars: dict


def upstream_requirements() -> list[tuple[str, str]]:
    """The (kind, requirement) pairs listed in upstream.txt; kind is sdist or wheel."""
    upstream_list = UPSTREAM_LIST
    if not upstream_list.exists():
        return []
    entries = []
    for number, raw in enumerate(upstream_list.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, requirement = line.partition(" ")
        if kind not in {"sdist", "wheel"} or not requirement.strip():
            raise FixtureError(f"{upstream_list}:{number}: expected 'sdist NAME==VER' or 'wheel NAME==VER'")
        entries.append((kind, requirement.strip()))
    return entries


def fetch_upstream() -> Path:
    """Download every listed file once, the files of the sandbox's verl lock, of its torch lock's real part and of
    the CPU venv's torch lock, and p40fleet's own dependencies; what is there is kept.

    The sets go side by side (each into its own directory, each with its own stamp): their time is mostly the
    downloads' (316 MB from PyPI on a fresh clone, and torch's 3 GB), and CI waits for them before the first test."""
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = [
            pool.submit(_fetch_listed),
            pool.submit(fetch_locked_wheels, sandbox_verl_lock()),
            pool.submit(fetch_locked_wheels, sandbox_torch_pypi_lock()),
            pool.submit(fetch_locked_wheels, CPU_TORCH_LOCK),
            pool.submit(fetch_package_dependencies),
        ]
    for future in futures:
        future.result()  # the first failure, in this order, once all have ended
    return UPSTREAM_DIR


def pip_rounds(entries: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """The listed (kind, requirement) pairs as few pip calls as can be: one call a kind, in list order, and another
    round where a name comes again (pip resolves the requirements of one call together, so two versions of one
    project in a call are a conflict even with --no-deps). A pip process is slow to start, so one call a line
    cost most of the fixtures' time (docs/benchmarks-code.md)."""
    rounds: list[tuple[str, list[str], set[str]]] = []
    for kind, requirement in entries:
        name = canonicalize_name(Requirement(requirement).name)
        for round_kind, requirements, names in rounds:
            if round_kind == kind and name not in names:
                requirements.append(requirement)
                names.add(name)
                break
        else:
            rounds.append((kind, [requirement], {name}))
    return [(kind, requirements) for kind, requirements, _ in rounds]


def _fetch_listed() -> None:
    upstream_dir = UPSTREAM_DIR
    stamp = upstream_dir / ".fetched"
    wanted = "\n".join(f"{k} {r}" for k, r in upstream_requirements())
    if stamp.exists() and stamp.read_text() == wanted:
        return
    pip = [sys.executable, "-m", "pip"]
    for kind, requirements in pip_rounds(upstream_requirements()):
        target = upstream_dir / kind
        target.mkdir(parents=True, exist_ok=True)
        if kind == "sdist":
            command = [*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", str(target), *requirements]
        else:
            # Wheels for the sandbox hosts' Python (3.11, linux x86_64); built when PyPI has only an sdist.
            command = [*pip, "wheel", "--no-deps", "--prefer-binary", "-w", str(target), *requirements]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            listed = ", ".join(requirements)
            raise FixtureError(f"fetching {listed} ({kind}) failed:\n{result.stdout}\n{result.stderr}")
    stamp.write_text(wanted)


def sandbox_verl_lock() -> Path:
    """The verl lock the sandbox env installs: resolved for the sandbox hosts' Python (see SANDBOX_PYTHON)."""
    return VERL_LOCKS_DIR / f"verl-{SANDBOX_VERL}-py{SANDBOX_PYTHON.replace('.', '')}.lock.txt"


def sandbox_torch_lock() -> Path:
    """The shipped torch lock for the sandbox hosts' Python: the stand-in lock keeps its names and versions."""
    return ROLES_DIR / "pytorch" / "files" / f"pytorch-{SANDBOX_TORCH}-py{SANDBOX_PYTHON.replace('.', '')}.lock.txt"


def sandbox_torch_pypi_lock() -> Path:
    """The lines of sandbox_torch_lock() the sandbox serves as the real files (all but TORCH_STANDINS), as a lock of
    its own under the cache, rewritten (by rename, never in place) only when they change."""
    shipped = sandbox_torch_lock()
    lines = [
        f"{pin.name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(pin.sha256s))
        for pin in parse_hashed_requirements(shipped.read_text(), shipped.name)
        if not TORCH_STANDINS.match(pin.name)
    ]
    text = f"# The real files of {shipped.name} the sandbox serves (p40fleet_dev.fixtures).\n" + "\n".join(lines) + "\n"
    path = CACHE_DIR / "locks" / shipped.name.replace(".lock.txt", "-pypi.lock.txt")
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(text)
        staging.replace(path)
    return path


def locked_files_dir(lock: Path) -> Path:
    """Where fetch_locked_wheels keeps the files of one lock (keyed by the lock's own name)."""
    return UPSTREAM_DIR / "locked" / lock.name.removesuffix(".txt")


def fetch_locked_wheels(lock: Path) -> Path:
    """Download exactly the files a hash-pinned lock names, once, for the sandbox hosts' Python and platform.

    The policy and the downloader are `p40fleet bundle`'s (p40fleet.bundle.hashed_downloads, p40fleet.fetch):
    every wheel of a pin some x86_64 glibc 2.5-2.28 host installs for CPython SANDBOX_PYTHON, the sdist where
    PyPI has no wheel, each checked against the lock's sha256 before it moves into place. A valid file already
    there is kept without a request, so only what the lock changed downloads.
    """
    dest = locked_files_dir(lock)
    stamp = dest / ".fetched"
    # The policy's name is in the stamp: files fetched by an earlier policy (pip download's one wheel per pin) are
    # looked at again, and what this one adds is fetched.
    wanted = hashlib.sha256(b"bundle.hashed_downloads\n" + lock.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return dest
    session = requests.Session()
    pins = parse_hashed_requirements(lock.read_text(), lock.name)
    try:
        downloads = hashed_downloads(pins, lock.name, SANDBOX_PYTHON, [PYPI_SIMPLE], [], dest, LinkFinder(session))
        Fetcher(session=session).fetch_all(downloads)
    except FetchError as error:
        raise FixtureError(f"fetching the files of {lock.name} failed: {error}") from None
    kept = {download.dest.name for download in downloads}
    for leftover in dest.iterdir():
        if not leftover.name.startswith(".") and leftover.name not in kept:
            leftover.unlink()  # a file of an earlier lock
    stamp.write_text(wanted)
    return dest


def package_dependencies_dir() -> Path:
    """Wheels of p40fleet's own dependencies (pyproject.toml, pinned by constraints.txt), for installing the
    p40fleet wheel into a fresh venv offline (python/tests/test_wheel.py)."""
    return UPSTREAM_DIR / "p40fleet-dependencies"


def fetch_package_dependencies() -> Path:
    """Download the wheels p40fleet's dependencies install from, once per dependency list and constraints."""
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    constraints = REPO_ROOT / "constraints.txt"
    dest = package_dependencies_dir()
    stamp = dest / ".fetched"
    wanted = hashlib.sha256(("\n".join(dependencies) + "\n").encode() + constraints.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix="fetching-"))
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-d", str(staging)]
    command += ["-c", str(constraints), *dependencies]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise FixtureError(f"fetching p40fleet's dependencies failed:\n{result.stdout[-4000:]}\n{result.stderr}")
        (staging / ".fetched").write_text(wanted)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _builders() -> list[Path]:
    return sorted(p for p in BUILDERS_DIR.glob("*.py") if not p.name.startswith("_"))


def tree_digest(paths, base: Path = REPO_ROOT) -> str:
    """A digest of the files at `paths` (files or trees, relative to `base`), by name and content."""
    digest = hashlib.sha256()
    for entry in paths:
        root = base / entry
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            digest.update(str(path.relative_to(base)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def standins_hash() -> str:
    """The stand-ins' cache key: their builders, the upstream files they are built from, the sandbox's locks."""
    digest = hashlib.sha256(tree_digest(["."], base=BUILDERS_DIR).encode())
    for kind, requirement in upstream_requirements():
        digest.update(f"{kind} {requirement}\n".encode())
    digest.update(sandbox_verl_lock().read_bytes())
    digest.update(sandbox_torch_lock().read_bytes())
    return digest.hexdigest()[:16]


def build_standins() -> StandinArtifacts:
    """Build every stand-in into a mirror directory, cached by a hash of the builders."""
    out = CACHE_DIR / "standins" / standins_hash()
    manifest = out / "group_vars.json"
    if manifest.exists():
        return StandinArtifacts(out / "mirror", json.loads(manifest.read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (pytest-xdist's workers start sandboxes together): a build is not byte-for-byte
    # repeatable (git commits carry times), so a second build's variables could name files the first one kept.
    with (out.parent / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if manifest.exists():
            return StandinArtifacts(out / "mirror", json.loads(manifest.read_text()))
        return _build_standins(out)


def _build_standins(out: Path) -> StandinArtifacts:
    upstream = fetch_upstream()
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

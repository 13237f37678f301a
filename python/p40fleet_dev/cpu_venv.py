"""The CPU venv: the hosts' Python stack (torch 2.6.0, verl 0.4.1's locked dependencies) on this machine's CPU.

`make test` runs verl's and transformers' real code in it (python/tests/cpu/), where a GPU is not needed to show a
behaviour: the hf rollout's positions, the validation batch's chunking. Its files are the verl lock's (the hosts'
own set) and python/tests/fixtures/cpu-torch-2.6.0-py311.lock.txt (torch from PyPI and what it pulls in), fetched
once by `make fixtures` with every sha256 checked, then installed on the test machine with pip's hash-checking mode
and no index.
The two sdists of the verl lock are built into wheels first, from their checked sdists, as the GPU bundle does.
The venv is made in a temporary directory and renamed into place, keyed by the locks' digest: an interrupted build
is made again, never taken for a finished one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from p40fleet.bundle import parse_hashed_requirements
from p40fleet_dev.fixtures import (
    CPU_TORCH_LOCK,
    FixtureError,
    fetch_locked_wheels,
    locked_files_dir,
    sandbox_verl_lock,
)
from p40fleet_dev.paths import CACHE_DIR

CPU_VENV_DIR = CACHE_DIR / "cpu-venv"
# The verl lock's files PyPI publishes as sdists only: built into wheels from the checked sdist.
SDIST_ONLY = ("antlr4-python3-runtime", "pylatexenc")


def locks() -> list[Path]:
    return [sandbox_verl_lock(), CPU_TORCH_LOCK]


def fetch() -> None:
    """Download both locks' files (each checked against its lock's sha256); kept when already there."""
    for lock in locks():
        fetch_locked_wheels(lock)


def digest() -> str:
    h = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]}\n".encode())
    for lock in locks():
        h.update(lock.read_bytes())
    return h.hexdigest()[:16]


def python() -> Path:
    """The CPU venv's python, built first when missing (one builder at a time across pytest workers)."""
    target = CPU_VENV_DIR / digest()
    if (target / ".complete").exists():
        return target / "bin" / "python"
    CPU_VENV_DIR.mkdir(parents=True, exist_ok=True)
    with (CPU_VENV_DIR / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            _build(target)
    return target / "bin" / "python"


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FixtureError(
            f"building the CPU venv: {' '.join(argv[:4])} ... failed:\n{done.stdout[-3000:]}{done.stderr}"
        )


def _build(target: Path) -> None:
    fetch()
    for old in CPU_VENV_DIR.iterdir():
        if old.is_dir() and old.name != target.name:
            shutil.rmtree(old, ignore_errors=True)  # another lock's venv
    staging = Path(tempfile.mkdtemp(dir=CPU_VENV_DIR, prefix="building-"))
    try:
        venv = staging / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
        requirements = staging / "requirements.txt"
        lines = []
        for lock in locks():
            for pin in parse_hashed_requirements(lock.read_text(), lock.name):
                if pin.name in SDIST_ONLY:
                    continue
                marker = f"; {pin.marker}" if pin.marker else ""
                hashes = " ".join(f"--hash=sha256:{h}" for h in sorted(pin.sha256s))
                lines.append(f"{pin.name}=={pin.version}{marker} {hashes}")
        requirements.write_text("\n".join(lines) + "\n")
        links = [a for lock in locks() for a in ("--find-links", str(locked_files_dir(lock)))]
        _run([*pip, "install", "--no-index", "--no-deps", "--require-hashes", *links, "-r", str(requirements)])
        built = staging / "built"
        sdists = [
            path
            for path in locked_files_dir(sandbox_verl_lock()).iterdir()
            if path.name.endswith(".tar.gz") and path.name.rsplit("-", 1)[0].lower().replace("_", "-") in SDIST_ONLY
        ]
        if len(sdists) != len(SDIST_ONLY):
            raise FixtureError(f"building the CPU venv: expected the sdists of {SDIST_ONLY}, found {sdists}")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(built),
                *map(str, sdists),
            ]
        )
        _run([*pip, "install", "--no-index", "--no-deps", *map(str, sorted(built.glob("*.whl")))])
        # A venv records its own path in its scripts: build it where it will live.
        if target.exists():
            shutil.rmtree(target)
        _relocate(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _relocate(staging: Path, target: Path) -> None:
    """Move the venv to its place; its interpreter link and pyvenv.cfg are path-free, its scripts are not used."""
    os.rename(staging / "venv", target)
    (target / ".complete").write_text(digest() + "\n")

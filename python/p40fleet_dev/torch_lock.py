"""`make lock-torch`: resolve the torch locks again and compare them with the shipped ones; never overwrite them.

A shipped lock (roles/pytorch/files/pytorch-2.6.0-cu118-py3XX.lock.txt) has two parts. Above MARKER: the header
and torch's line, whose sha256 was taken from public sources (the header names them), since PyTorch's cu118
index could not be reached where the lock was written. Below MARKER: `uv pip compile` of torch's requirements
(pytorch-2.6.0-cu118-requirements.in) against PyPI, with PyPI's sha256.

Checks, per Python: the PyPI part resolved again equals the shipped one line for line; where the index is
reachable (not with --pypi-only), torch resolved from it with its real metadata pulls in exactly the shipped
names and versions, and the index lists torch's shipped sha256. A difference fails with the lines that differ.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from p40fleet_dev.paths import REPO_ROOT

LOCK_DIR = REPO_ROOT / "roles" / "pytorch" / "files"
VERL_LOCK_DIR = REPO_ROOT / "roles" / "verl" / "files"
PYPI = "https://pypi.org/simple"
PLATFORM = "x86_64-manylinux_2_28"
MARKER = "# --- below: `uv pip compile` of torch's requirements against PyPI (`make lock-torch` re-checks it) ---"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


class LockCheckError(RuntimeError):
    pass


def lock_path(torch: str, tag: str, python: str) -> Path:
    return LOCK_DIR / f"pytorch-{torch}-{tag}-py{python.replace('.', '')}.lock.txt"


def split_lock(text: str, name: str) -> tuple[str, str]:
    """(the hand-written part up to MARKER, uv's part after it)."""
    head, found, tail = text.partition(MARKER + "\n")
    if not found:
        raise LockCheckError(f"{name}: no line {MARKER!r}: not a lock this check knows how to read")
    return head, tail


def pins(text: str) -> dict[str, tuple[str, set[str]]]:
    """{lowercased name: (version, {sha256})} of a hashed requirements text (continuation lines joined)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        match = PIN.match(line)
        if match:
            name = re.sub(r"[-_.]+", "-", match[1]).lower()
            found[name] = (match[2], set(HASH.findall(line)))
    return found


def diff(shipped: str, resolved: str, name: str) -> list[str]:
    return list(difflib.unified_diff(shipped.splitlines(), resolved.splitlines(), name, "resolved now", lineterm=""))


def uv(*args: str, cwd: Path) -> str:
    command = [str(Path(sys.executable).with_name("uv")), "pip", "compile", "--quiet", "--generate-hashes", *args]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LockCheckError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout


def pypi_part(python: str, requirements: Path, verl_lock: Path, exclude_newer: str) -> str:
    """torch's requirements resolved against PyPI alone, with verl's lock of that Python as a constraint."""
    return uv(
        "--no-header", "--python-version", python, "--python-platform", PLATFORM, "--index-url", PYPI,
        "--exclude-newer", exclude_newer, "-c", f"../../verl/files/{verl_lock.name}", requirements.name,
        cwd=requirements.parent,
    )  # fmt: skip


def index_problems(python: str, torch_pin: str, shipped: dict, index: str) -> list[str]:
    """torch from the index with its own metadata, the rest at the shipped versions from either index: the names
    and versions must be the shipped ones, and the index must list the shipped sha256 of torch."""
    with tempfile.TemporaryDirectory(prefix="p40fleet-lock-torch-") as tmp:
        (Path(tmp) / "torch.in").write_text(torch_pin + "\n")
        held = [f"{name}=={version}" for name, (version, _) in sorted(shipped.items()) if name != "torch"]
        (Path(tmp) / "shipped.txt").write_text("\n".join(held) + "\n")
        resolved = pins(
            uv(
                "--python-version", python, "--python-platform", PLATFORM, "--index-url", PYPI,
                "--extra-index-url", index, "--index-strategy", "unsafe-best-match", "-c", "shipped.txt", "torch.in",
                cwd=Path(tmp),
            )
        )  # fmt: skip
    problems = diff(
        "\n".join(f"{n}=={v}" for n, (v, _) in sorted(shipped.items())),
        "\n".join(f"{n}=={v}" for n, (v, _) in sorted(resolved.items())),
        f"names and versions of the shipped lock for Python {python}",
    )
    if not shipped["torch"][1] <= resolved.get("torch", ("", set()))[1]:
        problems.append(
            f"torch's sha256 in the shipped lock for Python {python} ({', '.join(sorted(shipped['torch'][1]))}) is not"
            f" among those {index} lists: {', '.join(sorted(resolved.get('torch', ('', set()))[1])) or 'none'}"
        )
    return problems


def check(pythons: list[str], torch: str, tag: str, index: str, exclude_newer: str, pypi_only: bool) -> list[str]:
    requirements = LOCK_DIR / f"pytorch-{torch}-{tag}-requirements.in"
    problems: list[str] = []
    for python in pythons:
        lock = lock_path(torch, tag, python)
        if not lock.is_file():
            problems.append(f"{lock.relative_to(REPO_ROOT)}: missing (no lock is written here: see README.md)")
            continue
        head, tail = split_lock(lock.read_text(), lock.name)
        verl_lock = VERL_LOCK_DIR / f"verl-0.4.1-py{python.replace('.', '')}.lock.txt"
        problems += diff(tail, pypi_part(python, requirements, verl_lock, exclude_newer), lock.name)
        if not pypi_only:
            shipped = pins(head + tail)
            problems += index_problems(python, f"torch=={torch}+{tag}", shipped, index)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lock-torch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pythons", required=True, help="space-separated Python versions, as VERL_LOCK_PYTHONS")
    parser.add_argument("--torch", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--index", required=True, help="PyTorch's index for that tag")
    parser.add_argument("--exclude-newer", required=True, help="PyPI as of this time (verl's locks use the same)")
    parser.add_argument("--pypi-only", action="store_true", help="skip the index check (it is unreachable here)")
    args = parser.parse_args(argv)
    try:
        problems = check(args.pythons.split(), args.torch, args.tag, args.index, args.exclude_newer, args.pypi_only)
    except LockCheckError as error:
        print(f"lock-torch: {error}", file=sys.stderr)
        return 2
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print("lock-torch: the shipped locks differ from what resolves now (above); they were not changed.")
        return 1
    print(f"lock-torch: the shipped locks for Python {args.pythons} resolve again as shipped"
          + (" (PyPI part only: --pypi-only)" if args.pypi_only else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""verl's dependency locks (roles/verl/files/verl-*-py*.lock.txt) against what they must satisfy.

Offline: verl's declared requirements come from the real sdist in the fixtures cache, the torch pins from the
pytorch role, each locked package's own requirements from the real files `make fixtures` fetched for the
sandbox's lock. The locks themselves are written by `make lock` (needs PyPI; never run by the tests).
"""

from __future__ import annotations

import re
import shlex
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import jinja2
import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from p40fleet_dev.fixtures import SANDBOX_PYTHON, locked_files_dir, sandbox_verl_lock
from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.local_hosts import run_verl_role
from tests.pins import role_defaults

VERL_FILES = REPO_ROOT / "roles" / "verl" / "files"
PYTORCH_ROLE = REPO_ROOT / "roles" / "pytorch"
LOCKS = sorted(VERL_FILES.glob("verl-*-py*.lock.txt"))
LOCK_NAME = re.compile(r"verl-(?P<verl>[0-9.]+)-py3(?P<minor>[0-9]+)\.lock\.txt")
# CUDA 12 / sm70+ builds a P40 cannot run, and what only PyPI's CUDA 12 torch pulls in.
FORBIDDEN = {"vllm", "flash-attn", "liger-kernel", "sglang", "xformers", "triton", "verl"}


def parse_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """{canonical name: (version, [sha256, ...])}; refuses any line that is not `name==version` with hashes."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    logical = re.sub(r"\\\n", " ", "\n".join(line.split(" #")[0] for line in path.read_text().splitlines()))
    for line in logical.splitlines():
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if not line:
            continue
        words = shlex.split(line)
        requirement = Requirement(words[0])
        options = words[1:]
        hashes = [w.removeprefix("--hash=sha256:") for w in options if w.startswith("--hash=sha256:")]
        assert len(hashes) == len(options) and hashes, f"{path.name}: {line!r} has options other than sha256 hashes"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), f"{path.name}: {line!r}: malformed sha256"
        specs = list(requirement.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not requirement.url, f"{path.name}: {line!r}"
        assert requirement.marker is None and not requirement.extras, f"{path.name}: {line!r}: markers/extras"
        name = canonicalize_name(requirement.name)
        assert name not in entries, f"{path.name}: {name} twice"
        entries[name] = (Version(specs[0].version), hashes)
    return entries


def lock_environment(minor: str) -> dict[str, str]:
    return {
        "python_version": f"3.{minor}",
        "python_full_version": f"3.{minor}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def applies(requirement: Requirement, environment: dict[str, str], extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in {"", *extras})


def verl_declared(version: str) -> list[Requirement]:
    """install_requires of verl's real sdist (its egg-info/requires.txt, written from setup.py)."""
    with tarfile.open(UPSTREAM_DIR / "sdist" / f"verl-{version}.tar.gz") as sdist:
        text = sdist.extractfile(f"verl-{version}/verl.egg-info/requires.txt").read().decode()
    main = text.split("\n[", 1)[0]
    return [Requirement(line) for line in main.splitlines() if line.strip()]


def pytorch_pins() -> dict[str, Version]:
    """The pytorch role's constraints file, rendered from its vars and defaults: {name: +cu118 version}."""
    defaults = role_defaults("pytorch")
    role_vars = yaml.safe_load((PYTORCH_ROLE / "vars" / "main.yml").read_text())
    rendered = [jinja2.Template(line).render(**defaults) for line in role_vars["pytorch_requirements"]]
    pins = {}
    for line in rendered:
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_every_lock_line_is_an_exact_pin_with_sha256(lock: Path) -> None:
    entries = parse_lock(lock)
    assert len(entries) > 50, f"{lock.name}: only {len(entries)} pins: not verl's whole dependency set"


def test_the_sandbox_lock_and_a_host_lock_exist() -> None:
    names = {p.name for p in LOCKS}
    assert "verl-0.4.1-py310.lock.txt" in names, "the Python 3.10 lock for real hosts is missing"
    assert sandbox_verl_lock().name in names, "the lock for the sandbox's Python is missing"


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_lock_satisfies_verls_declared_requirements(lock: Path) -> None:
    match = LOCK_NAME.fullmatch(lock.name)
    entries = parse_lock(lock)
    environment = lock_environment(match["minor"])
    missing, wrong = [], []
    for requirement in verl_declared(match["verl"]):
        if not applies(requirement, environment, set()):
            continue
        name = canonicalize_name(requirement.name)
        if name not in entries:
            missing.append(str(requirement))
        elif not requirement.specifier.contains(entries[name][0], prereleases=True):
            wrong.append(f"{requirement} (locked {entries[name][0]})")
    assert not missing and not wrong, f"{lock.name}: missing {missing}; outside verl's range {wrong}"


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_lock_leaves_the_torch_stack_to_the_pytorch_role(lock: Path) -> None:
    entries = parse_lock(lock)
    inside = sorted(
        name for name in entries if name in pytorch_pins() or name in FORBIDDEN or name.startswith("nvidia-")
    )
    assert not inside, f"{lock.name} holds what the pytorch role installs or a P40 cannot run: {inside}"


def test_locks_were_resolved_against_the_pytorch_roles_versions() -> None:
    """The resolver's torch constraints are the pytorch role's pins without the local tag (+cu118)."""
    constraints = {}
    for lock in LOCKS:
        source = VERL_FILES / f"verl-{LOCK_NAME.fullmatch(lock.name)['verl']}-constraints.in"
        for line in source.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                requirement = Requirement(line)
                constraints[canonicalize_name(requirement.name)] = requirement.specifier
    for name, version in pytorch_pins().items():
        assert name in constraints, f"the lock's constraints do not hold {name} at the pytorch role's version"
        assert constraints[name].contains(version), f"{name}: locked against {constraints[name]}, role has {version}"
        assert str(constraints[name]) == f"=={version.public}", f"{name}: {constraints[name]} is not an exact pin"


def test_locks_of_one_release_come_from_the_same_inputs() -> None:
    """Each lock is the same uv command with only --python-version changed, and that version is its name's."""
    commands = {}
    for lock in LOCKS:
        match = LOCK_NAME.fullmatch(lock.name)
        text = lock.read_text()
        (command,) = re.findall(r"^#\s+(uv pip compile .*)$", text, flags=re.M)
        words = shlex.split(command)
        assert words[words.index("--python-version") + 1] == f"3.{match['minor']}", lock.name
        assert "--generate-hashes" in words and "--python-platform" in words, lock.name
        words[words.index("--python-version") + 1] = "X"
        commands.setdefault(match["verl"], set()).add(" ".join(words))
    for verl, seen in commands.items():
        assert len(seen) == 1, f"verl {verl}'s locks were resolved with different commands: {seen}"


def file_metadata(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel (METADATA) or an sdist (PKG-INFO; these two declare none or only old-Python)."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            (name,) = [n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            text = wheel.read(name).decode()
    else:
        with tarfile.open(path) as sdist:
            (member,) = [m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
            text = sdist.extractfile(member).read().decode()
    return [Requirement(value) for value in Parser().parsestr(text).get_all("Requires-Dist") or []]


def test_sandbox_lock_is_complete_by_its_real_files_metadata() -> None:
    """What `pip check` would say in the env, offline: every requirement of every locked file (extras that are
    asked for included) is met by the lock or by the pytorch role's +cu118 builds."""
    lock = sandbox_verl_lock()
    entries = parse_lock(lock)
    files_dir = locked_files_dir(lock)
    assert (files_dir / ".fetched").exists(), f"{files_dir} is empty: run `make fixtures`"
    files = {}
    for path in files_dir.iterdir():
        if path.suffix == ".whl":
            files[parse_wheel_filename(path.name)[0]] = path
        elif not path.name.startswith("."):
            files[parse_sdist_filename(path.name)[0]] = path
    assert set(files) == set(entries), f"fetched files differ from the lock: {set(files) ^ set(entries)}"
    torch = pytorch_pins()
    environment = lock_environment(SANDBOX_PYTHON.split(".")[1])
    inputs = (VERL_FILES / "verl-0.4.1-requirements.in").read_text().splitlines()
    extra_roots = [Requirement(line) for line in inputs if line.strip() and not line.startswith(("#", "verl=="))]
    roots = [*verl_declared("0.4.1"), *extra_roots]
    asked: dict[str, set[str]] = {}
    queue = [r for r in roots if applies(r, environment, set())]
    problems = []
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        if name in torch:
            if not requirement.specifier.contains(torch[name], prereleases=True):
                problems.append(f"{requirement} is not met by the pytorch role's {name} {torch[name]}")
            continue
        if name not in entries:
            problems.append(f"{requirement} is not in the lock")
            continue
        if not requirement.specifier.contains(entries[name][0], prereleases=True):
            problems.append(f"{requirement} is not met by the locked {entries[name][0]}")
        extras = set(requirement.extras)
        if name in asked and extras <= asked[name]:
            continue
        asked[name] = asked.get(name, set()) | extras
        queue += [r for r in file_metadata(files[name]) if applies(r, environment, asked[name])]
    assert not problems, "\n".join(sorted(set(problems)))
    unused = sorted(set(entries) - set(asked))
    assert not unused, f"{lock.name} pins what nothing asks for: {unused}"


def test_marker_environment_is_what_the_locks_target() -> None:
    """The markers used above say Linux x86_64 CPython: a requirement for Windows must not count."""
    assert not Marker('sys_platform == "win32"').evaluate(lock_environment("11"))
    assert Marker('python_version < "3.11"').evaluate(lock_environment("10"))


def test_role_stops_where_no_lock_was_resolved_for_the_envs_python(run_playbook, tmp_path) -> None:
    """An env on a Python no lock was resolved for stops before anything is installed, naming what to do."""
    result = run_verl_role(run_playbook, tmp_path, {"p40fleet_python_version": "3.12"})
    env = tmp_path / "env"
    assert result.rc != 0
    (failure,) = result.failures
    assert failure.task == "Ensure a dependency lock exists for this verl release and the env's Python"
    assert failure.message.startswith("node9: no dependency lock verl-0.4.1-py312.lock.txt for verl 0.4.1 on")
    assert "verl-0.4.1-py310.lock.txt" in failure.message and "make lock" in failure.message
    assert not env.exists() and not (tmp_path / "verl").exists()

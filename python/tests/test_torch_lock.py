"""The torch locks (roles/pytorch/files/pytorch-*-py*.lock.txt) and the sandbox's, without hosts.

The shipped locks: torch at the sha256 public sources published for PyTorch's file (DOCUMENTED_TORCH_SHA256),
its requirements from PyPI (`make lock-torch` re-checks both where PyPI and the index are reachable; never here).
Checked statically: every line hashed, the torch sums the documented ones, the set closed under the documented
Requires-Dist of every locked wheel, the pins the role's and verl's. The sandbox's lock keeps the shipped names and
versions with the stand-ins (torch_wheels.py); real pip installs it as the role does, and refuses a rebuilt wheel
served under a locked name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from p40fleet.bundle import bundle_downloads
from p40fleet.fetch import HostPins
from p40fleet_dev import torch_lock
from p40fleet_dev.fixtures import locked_files_dir, sandbox_torch_pypi_lock, sandbox_verl_lock
from p40fleet_dev.paths import REPO_ROOT
from tests.host_state import sh
from tests.http_server import serve_directory
from tests.source_modules import load_module
from tests.test_verl_lock import parse_lock, pytorch_pins

PYTORCH_FILES = REPO_ROOT / "roles" / "pytorch" / "files"
VERL_FILES = REPO_ROOT / "roles" / "verl" / "files"
LOCKS = sorted(PYTORCH_FILES.glob("pytorch-*-py3*.lock.txt"))
LOCK_NAME = re.compile(r"pytorch-(?P<torch>[0-9.]+)-(?P<tag>cu[0-9]+)-py3(?P<minor>[0-9]+)\.lock\.txt")
TORCH_WHEELS = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "artifacts" / "torch_wheels.py"
MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def makefile_value(name: str) -> str:
    (value,) = re.findall(rf"^{name} := (.*)$", MAKEFILE, flags=re.M)
    return value.strip()


# torch 2.6.0+cu118's wheels for linux x86_64, and the sha256 independent public sources give for each (the
# shipped lock's header names them): a first-hand hash needs PyTorch's index (`make lock-torch`).
DOCUMENTED_TORCH_SHA256 = {
    "10": "715d3b039a629881f263c40d1fb65edac6786da13bfba221b353ef2371c4da86",
    "11": "3e73419aab6dbcd888a3cc6a00d1f52f5950d918d7289ea6aeae751346613edc",
}
# torch 2.6.0+cu118's Requires-Dist on linux x86_64 (public uv.lock metadata and a pip log of the install agree).
TORCH_REQUIRES = [
    "filelock", "fsspec", "jinja2", "networkx", "typing-extensions>=4.10.0", "sympy==1.13.1", "triton==3.2.0",
    "nvidia-cublas-cu11==11.11.3.6", "nvidia-cuda-cupti-cu11==11.8.87", "nvidia-cuda-nvrtc-cu11==11.8.89",
    "nvidia-cuda-runtime-cu11==11.8.89", "nvidia-cudnn-cu11==9.1.0.70", "nvidia-cufft-cu11==10.9.0.58",
    "nvidia-curand-cu11==10.3.0.86", "nvidia-cusolver-cu11==11.4.1.48", "nvidia-cusparse-cu11==11.7.5.86",
    "nvidia-nccl-cu11==2.21.5", "nvidia-nvtx-cu11==11.8.86",
]  # fmt: skip
# The Requires-Dist (extras left out) of the other locked wheels, as PyPI's metadata of the locked versions has it
# (cudnn's as public uv.lock metadata has it; PyPI serves none for it); a name not here requires nothing.
DEPENDENCY_REQUIRES = {
    "jinja2": ["MarkupSafe>=2.0"],
    "sympy": ["mpmath<1.4,>=1.1.0"],
    "nvidia-cudnn-cu11": ["nvidia-cublas-cu11"],
    "nvidia-cusolver-cu11": ["nvidia-cublas-cu11"],
}
NO_REQUIREMENTS = {
    "filelock", "fsspec", "markupsafe", "mpmath", "networkx", "typing-extensions", "triton", "nvidia-cublas-cu11",
    "nvidia-cuda-cupti-cu11", "nvidia-cuda-nvrtc-cu11", "nvidia-cuda-runtime-cu11", "nvidia-cufft-cu11",
    "nvidia-curand-cu11", "nvidia-cusparse-cu11", "nvidia-nccl-cu11", "nvidia-nvtx-cu11",
}  # fmt: skip
REQUIREMENTS_IN = PYTORCH_FILES / "pytorch-2.6.0-cu118-requirements.in"


def requirement_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()[:1] not in ("", "#")]


def test_requirements_are_torchs_documented_requires_dist() -> None:
    """What lock-torch resolves against PyPI is what torch 2.6.0+cu118 requires, nothing more or less."""
    assert requirement_lines(REQUIREMENTS_IN) == TORCH_REQUIRES


def test_lock_target_checks_and_never_writes() -> None:
    """`make lock-torch` runs the check for every verl Python with verl's PyPI date; it writes no lock."""
    recipe = MAKEFILE.split("\nlock-torch: venv\n", 1)[1].split("\n\n", 1)[0]
    assert "-m p40fleet_dev.torch_lock" in recipe and "--exclude-newer $(VERL_LOCK_EXCLUDE_NEWER)" in recipe
    assert '--pythons "$(PYTORCH_LOCK_PYTHONS)"' in recipe and "--index $(PYTORCH_LOCK_INDEX)" in recipe
    assert not re.search(r"(^|\s)(mv|cp|>)\s", recipe), recipe
    assert makefile_value("PYTORCH_LOCK_INDEX") == "https://download.pytorch.org/whl/$(PYTORCH_LOCK_CUDA_TAG)"
    assert makefile_value("PYTORCH_LOCK_PYTHONS") == "$(VERL_LOCK_PYTHONS)"
    assert makefile_value("PYTORCH_LOCK_VERSION") == "2.6.0" and makefile_value("PYTORCH_LOCK_CUDA_TAG") == "cu118"
    assert re.search(r"^lock: lock-verl lock-torch$", MAKEFILE, flags=re.M)


def test_a_host_lock_exists_for_every_python() -> None:
    wanted = {
        f"pytorch-2.6.0-cu118-py{p.replace('.', '')}.lock.txt" for p in makefile_value("VERL_LOCK_PYTHONS").split()
    }
    assert wanted <= {lock.name for lock in LOCKS}
    assert len(LOCKS) == len(wanted)


def check_lock(lock: Path, minor: str) -> None:
    """One lock against the pins: every line an exact pin with sha256, the role's +cu118 builds, CUDA 11 libraries
    only, and what verl's lock of the same Python also holds at the same version."""
    entries = parse_lock(lock)
    for name, version in pytorch_pins().items():
        assert name in entries, f"{lock.name} lacks {name}"
        assert entries[name][0] == version, f"{lock.name}: {name} {entries[name][0]}, the role pins {version}"
    cuda12 = sorted(name for name in entries if name.startswith("nvidia-") and not name.endswith("-cu11"))
    assert not cuda12, f"{lock.name} holds CUDA libraries that are not the cu11 builds: {cuda12}"
    verl = parse_lock(VERL_FILES / f"verl-0.4.1-py3{minor}.lock.txt")
    for name in set(entries) & set(verl):
        assert entries[name][0] == verl[name][0], f"{name}: {entries[name][0]} here, {verl[name][0]} in verl's lock"
        assert set(entries[name][1]) & set(verl[name][1]), f"{name}: no sha256 in common with verl's lock"


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_host_lock_matches_the_pins(lock: Path) -> None:
    check_lock(lock, LOCK_NAME.fullmatch(lock.name)["minor"])


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_host_lock_torch_is_the_documented_file(lock: Path) -> None:
    """torch: one sha256, the documented one for this Python; no torchvision or torchaudio; the header names the
    wheel; everything after MARKER is PyPI's part (the torch line is above it)."""
    minor = LOCK_NAME.fullmatch(lock.name)["minor"]
    entries = parse_lock(lock)
    assert entries["torch"] == (Version("2.6.0+cu118"), [DOCUMENTED_TORCH_SHA256[minor]])
    assert not {"torchvision", "torchaudio"} & set(entries)
    head, tail = torch_lock.split_lock(lock.read_text(), lock.name)
    assert f"torch-2.6.0+cu118-cp3{minor}-cp3{minor}-linux_x86_64.whl" in head
    assert set(torch_lock.pins(head)) == {"torch"} and "torch" not in torch_lock.pins(tail)


@pytest.mark.parametrize("lock", LOCKS, ids=[p.name for p in LOCKS])
def test_host_lock_is_closed_under_every_locked_wheels_requirements(lock: Path) -> None:
    """--no-deps installs exactly the lock: each requirement of each locked wheel (for a Linux x86_64 CPython of the
    lock's version) names a locked distribution at a version it accepts, and each locked name is required."""
    minor = LOCK_NAME.fullmatch(lock.name)["minor"]
    entries = parse_lock(lock)
    assert set(entries) == {"torch"} | set(DEPENDENCY_REQUIRES) | NO_REQUIREMENTS
    environment = {"python_version": f"3.{minor}", "platform_system": "Linux", "platform_machine": "x86_64",
                   "sys_platform": "linux", "extra": ""}  # fmt: skip
    required = set()
    for name in entries:
        for line in TORCH_REQUIRES if name == "torch" else DEPENDENCY_REQUIRES.get(name, []):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            wanted = canonicalize_name(requirement.name)
            assert wanted in entries, f"{lock.name}: {name} requires {line}, which the lock lacks"
            assert requirement.specifier.contains(entries[wanted][0], prereleases=True), (
                f"{lock.name}: {name} requires {line}, the lock has {entries[wanted][0]}"
            )
            required.add(wanted)
    assert required == set(entries) - {"torch"}, "a locked distribution nothing requires"


def fake_uv(monkeypatch, answer) -> list[tuple]:
    calls = []

    def uv(*args, cwd):
        calls.append(args)
        return answer(args)

    monkeypatch.setattr(torch_lock, "uv", uv)
    return calls


def test_lock_torch_passes_what_resolves_as_shipped_and_names_each_differing_line(monkeypatch, capsys) -> None:
    """The compare itself (the resolver is uv: faked here, as PyPI and the index are not reached by tests)."""
    locks = {lock: lock.read_text() for lock in LOCKS}
    tails = {p: torch_lock.split_lock(text, p.name)[1] for p, text in locks.items()}
    by_python = {f"3.{LOCK_NAME.fullmatch(p.name)['minor']}": tail for p, tail in tails.items()}

    def resolved(args, change=lambda text: text):
        python = args[args.index("--python-version") + 1]
        if "--extra-index-url" not in args:
            assert args[args.index("--index-url") + 1] == torch_lock.PYPI and "--exclude-newer" in args
            return change(by_python[python])
        lock = next(p for p in LOCKS if p.name.endswith(f"py{python.replace('.', '')}.lock.txt"))
        return "\n".join(line for line in locks[lock].splitlines() if not line.startswith("#"))

    argv = ["--pythons", "3.10 3.11", "--torch", "2.6.0", "--tag", "cu118", "--index", "https://x.invalid/cu118",
            "--exclude-newer", "2025-06-27T12:00:00Z"]  # fmt: skip
    calls = fake_uv(monkeypatch, resolved)
    assert torch_lock.main(argv) == 0, capsys.readouterr().err
    assert len(calls) == 4
    fake_uv(monkeypatch, lambda args: resolved(args, lambda text: text.replace("jinja2==3.1.6", "jinja2==3.1.7")))
    assert torch_lock.main([*argv, "--pypi-only"]) == 1
    err = capsys.readouterr().err
    assert "-jinja2==3.1.6 \\" in err and "+jinja2==3.1.7 \\" in err
    assert {lock: lock.read_text() for lock in LOCKS} == locks, "a lock was rewritten"


def test_lock_torch_fails_when_the_index_lacks_torchs_sum_or_pulls_in_another_set(monkeypatch, capsys) -> None:
    (lock,) = [p for p in LOCKS if p.name.endswith("py311.lock.txt")]
    text = lock.read_text()
    shipped = torch_lock.pins(text)
    answer = text.replace(DOCUMENTED_TORCH_SHA256["11"], "0" * 64).replace("networkx==3.5", "networkx==3.4.2")
    fake_uv(monkeypatch, lambda args: answer)
    problems = torch_lock.index_problems("3.11", "torch==2.6.0+cu118", shipped, "https://x.invalid/cu118")
    assert "-networkx==3.5" in problems and "+networkx==3.4.2" in problems
    assert any(DOCUMENTED_TORCH_SHA256["11"] in p and "is not among" in p for p in problems), problems


# -- the sandbox's lock: stand-ins with their sha256 as built, the real files they require ---------------------


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torch-standins")
    load_module(TORCH_WHEELS, "p40fleet_standin_torch_wheels").build(out, out)
    return out


def pip_install(lock: Path, wheels: Path, target: Path) -> subprocess.CompletedProcess:
    """The role's install (--require-hashes --no-deps, only the sources named, no pip.conf), into a target dir
    for the sandbox hosts' Python 3.11 on x86_64 Linux."""
    command = [sys.executable, "-m", "pip", "install", "--require-hashes", "--no-deps", "--no-index"]
    command += ["--find-links", str(wheels), "--target", str(target), "--only-binary=:all:"]
    command += ["--python-version", "3.11", "--platform", "manylinux2014_x86_64", "-r", str(lock)]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False)


STANDINS = {"torch", "triton"} | {n for n in NO_REQUIREMENTS | set(DEPENDENCY_REQUIRES) if n.startswith("nvidia-")}


def test_sandbox_lock_keeps_the_shipped_names_and_versions(standins) -> None:
    """The shipped lock for the sandbox's Python, name for name and version for version: stand-ins with their sha256
    as built for torch, triton and the CUDA libraries, the real files with the shipped sha256 for the rest."""
    lock = standins / "locks" / "torch-sandbox.lock.txt"
    entries = parse_lock(lock)
    shipped = parse_lock(PYTORCH_FILES / "pytorch-2.6.0-cu118-py311.lock.txt")
    assert {n: v for n, (v, _) in entries.items()} == {n: v for n, (v, _) in shipped.items()}
    assert len(STANDINS) == 13
    for name in STANDINS:
        (wheel,) = (standins / "torch_wheels").glob(f"{name.replace('-', '_')}-{entries[name][0]}-py3-none-any.whl")
        digest = subprocess.run(["sha256sum", str(wheel)], capture_output=True, text=True, check=True).stdout.split()[0]
        assert entries[name][1] == [digest], f"{name}: the lock's sha256 is not the stand-in's as built"
    for name in set(entries) - STANDINS:
        assert entries[name] == shipped[name], f"{name}: not the shipped lock's pin and sha256"
    check_lock(lock, "11")


def test_standins_declare_the_real_requirements(standins) -> None:
    torch_wheels = load_module(TORCH_WHEELS, "p40fleet_standin_torch_wheels")
    assert [str(Requirement(r)).split(";")[0] for r in torch_wheels.torch_requires()] == [
        str(Requirement(r)) for r in TORCH_REQUIRES
    ]
    assert {n: r for n, r in DEPENDENCY_REQUIRES.items() if n in STANDINS} == torch_wheels.REQUIRES


def test_sandbox_lock_installs_with_require_hashes(standins, tmp_path) -> None:
    done = pip_install(standins / "locks" / "torch-sandbox.lock.txt", standins / "torch_wheels", tmp_path / "env")
    assert done.returncode == 0, done.stdout + done.stderr
    installed = {re.sub(r"-[^-]+\.dist-info$", "", p.name) for p in (tmp_path / "env").glob("*.dist-info")}
    assert {canonicalize_name(n) for n in installed} == set(parse_lock(standins / "locks" / "torch-sandbox.lock.txt"))
    assert (tmp_path / "env" / "torch-2.6.0+cu118.dist-info").is_dir()


def test_rebuilt_wheel_under_a_locked_name_is_refused(standins, tmp_path) -> None:
    """A mirror serving another build of torch 2.6.0+cu118 under the locked file name: pip refuses it, installs
    nothing, and names the file and both sums."""
    served = tmp_path / "mirror"
    served.mkdir()
    for path in (standins / "torch_wheels").iterdir():
        os.link(path, served / path.name)
    (wheel,) = served.glob("torch-2.6.0+cu118-py3-none-any.whl")
    wheel.unlink()
    torch_wheels = load_module(TORCH_WHEELS, "p40fleet_standin_torch_wheels")
    files = torch_wheels.torch_files("2.6.0+cu118", "11.8")
    files["torch/_rebuilt.py"] = "# a rebuild: same name and version, other bytes\n"
    torch_wheels.make_wheel(served, "torch", "2.6.0+cu118", files, torch_wheels.torch_requires(), "rebuilt")
    done = pip_install(standins / "locks" / "torch-sandbox.lock.txt", served, tmp_path / "env")
    assert done.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE" in done.stderr, done.stderr
    assert "torch==2.6.0+cu118" in done.stderr
    assert not any((tmp_path / "env").glob("*.dist-info")), "something was installed from the refused set"


# -- the role on a sandbox host: the lock installs with --require-hashes; another build is refused --------------
# On conftest's site_fleet (this module runs with its group, after test_python_stack.py): a fresh host of its own
# would cost the prerequisites and the env on top of the install this test is about.

STACK = REPO_ROOT / "python" / "tests" / "playbooks" / "python_stack.yml"
UP_TO_TORCH = "gpu_preflight,host_prereqs,conda_env,pytorch"
HOST = "node2"
PY = "/opt/miniconda3/envs/verl-env/bin/python"
INSTALL_TASK = "Ensure the torch builds and their dependencies are installed from the hash-pinned lock"


@pytest.fixture(scope="module")
def torch_fleet(converged_site_fleet):
    """conftest's site_fleet, converged (the test takes node2's torch away first, and leaves it installed)."""
    return converged_site_fleet


def task_results(result, task: str) -> list[dict]:
    return [
        e["event_data"]["res"]
        for e in result.events
        if e["event"] in ("runner_on_ok", "runner_on_failed") and e["event_data"].get("task") == task
    ]


@pytest.mark.sandbox
def test_role_refuses_a_served_build_that_is_not_the_locked_one_then_installs_the_lock(
    torch_fleet, run_playbook, tmp_path
):
    inventory = torch_fleet.inventory_dir
    sandbox_vars = yaml.safe_load((inventory / "group_vars" / "p40_sandbox.yml").read_text())
    lock = Path(sandbox_vars["p40fleet_sandbox_mirror_dir"]) / "locks" / "torch-sandbox.lock.txt"
    # The lock names a build of torch 2.6.0+cu118 other than the one the mirror serves (as a lock made from the
    # genuine files meets a mirror serving a rebuild): the mirror's file must be refused.
    torch_wheels = load_module(TORCH_WHEELS, "p40fleet_standin_torch_wheels")
    files = torch_wheels.torch_files("2.6.0+cu118", "11.8")
    files["torch/_rebuilt.py"] = "# another build: same name and version, other bytes\n"
    other = torch_wheels.make_wheel(tmp_path, "torch", "2.6.0+cu118", files, torch_wheels.torch_requires(), "other")
    served_sum = parse_lock(lock)["torch"][1][0]
    tampered = tmp_path / "torch.lock.txt"
    tampered.write_text(lock.read_text().replace(served_sum, torch_wheels.sha256(other)))

    # A host whose torch is to be installed: site.yml's builds taken away.
    sh(torch_fleet, HOST, f"sudo -u p40fleet {PY} -m pip uninstall -y torch")
    refused = run_playbook(
        STACK, inventory, limit=HOST, tags=UP_TO_TORCH, extra_vars={"pytorch_lock_file": str(tampered)}
    )
    assert refused.rc != 0
    assert [f.task for f in refused.host_failures(HOST)] == [INSTALL_TASK]
    assert "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE" in refused.stdout
    assert torch_fleet.exec(HOST, f"{PY} -m pip show torch").returncode != 0, "torch installed from a refused set"

    done = run_playbook(STACK, inventory, limit=HOST, tags=UP_TO_TORCH)
    assert done.rc == 0, [f"{f.task}: {f.message}" for f in done.failures]
    (install,) = task_results(done, INSTALL_TASK)
    argv = install["cmd"]
    assert {"--require-hashes", "--no-deps", "--no-index"} <= set(argv), argv
    assert "--extra-index-url" not in argv and "--index-url" not in argv, argv
    versions = sh(
        torch_fleet, HOST, f"{PY} -c 'import torch, sympy, jinja2, networkx, filelock; print(torch.__version__)'"
    )
    assert versions.split() == ["2.6.0+cu118"]
    assert "No broken requirements found." in sh(torch_fleet, HOST, f"sudo -u p40fleet {PY} -m pip check")
    again = run_playbook(STACK, inventory, limit=HOST, tags=UP_TO_TORCH)
    assert again.rc == 0 and again.stats[HOST]["changed"] == 0


def test_bundle_serves_exactly_the_torch_locks_files(standins, tmp_path):
    """`p40fleet bundle`'s wheels for a host: exactly the torch lock's files (never the index's decoys), read from
    the torch install's own sources, beside the verl lock's."""
    served = tmp_path / "served"
    served.mkdir()
    locked_files = [
        *locked_files_dir(sandbox_verl_lock()).glob("*.*"),
        *locked_files_dir(sandbox_torch_pypi_lock()).glob("*.*"),
    ]
    files = [*(standins / "torch_wheels").iterdir(), *locked_files]
    for path in {path.name: path for path in files}.values():
        os.link(path, served / path.name)
    running = serve_directory(served)
    try:
        host = HostPins(
            host="node1",
            artifacts=[],
            controller_cache_dir=tmp_path / "cache",
            python_version="3.11",
            pip={"no_index": True, "index_url": "", "extra_index_urls": [],
                 "find_links": [f"{running.base_url}/"]},
            torch_requirements=[],
            apex={"enabled": False},
            verl={"source": "path", "lock_file": str(sandbox_verl_lock()), "find_links": []},
            torch_lock_file=str(standins / "locks" / "torch-sandbox.lock.txt"),
        )  # fmt: skip
        downloads = bundle_downloads([host], tmp_path / "bundle", requests.Session())
    finally:
        running.stop()
    names = {d.dest.name for d in downloads}
    assert {"torch-2.6.0+cu118-py3-none-any.whl", "triton-3.2.0-py3-none-any.whl"} <= names
    assert not {"torch-2.6.0-py3-none-any.whl", "torch-2.7.0-py3-none-any.whl"} & names
    locked = parse_lock(standins / "locks" / "torch-sandbox.lock.txt")
    assert set(locked) <= {canonicalize_name(d.label.split("==")[0]) for d in downloads}
    for download in downloads:
        name = canonicalize_name(download.label.split("==")[0])
        if name in locked:
            assert download.sha256s == frozenset(locked[name][1]), download.label

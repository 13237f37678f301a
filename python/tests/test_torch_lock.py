"""The torch stack's hash locks (roles/pytorch/files/pytorch-*-py*.lock.txt) and the sandbox's, without hosts.

The host locks are written by `make lock` from PyTorch's cu118 index (never run here: that index is not
reachable from the build machine, so no host lock is committed yet; see test_a_host_lock_exists_for_every_python).
Each lock that exists is checked against the pytorch role's pins and verl's lock of the same Python. The sandbox's
lock is built with the stand-ins (torch_wheels.py), and real pip installs it as the role does, and refuses a
rebuilt wheel served under a locked name.
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

from p40fleet.bundle import bundle_downloads
from p40fleet.fetch import HostPins
from p40fleet_dev.fixtures import locked_files_dir, sandbox_verl_lock
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


def test_requirements_are_the_roles_pins() -> None:
    """What `make lock` resolves is what the role's constraints hold: the +cu118 builds at the role's versions."""
    source = PYTORCH_FILES / "pytorch-2.6.0-cu118-requirements.in"
    pins = {}
    for line in source.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            pins[canonicalize_name(requirement.name)] = spec.version
    assert pins == {name: str(version) for name, version in pytorch_pins().items()}
    assert makefile_value("PYTORCH_LOCK_VERSION") == "2.6.0" and makefile_value("PYTORCH_LOCK_CUDA_TAG") == "cu118"


def test_lock_target_resolves_from_the_cu118_index_alone_for_every_verl_python() -> None:
    recipe = MAKEFILE.split("\nlock-torch: venv\n", 1)[1].split("\n\n", 1)[0]
    assert "--generate-hashes" in recipe and "--index-url $(PYTORCH_LOCK_INDEX)" in recipe
    assert "--extra-index-url" not in recipe and "--find-links" not in recipe
    assert makefile_value("PYTORCH_LOCK_INDEX") == "https://download.pytorch.org/whl/$(PYTORCH_LOCK_CUDA_TAG)"
    assert makefile_value("PYTORCH_LOCK_PYTHONS") == "$(VERL_LOCK_PYTHONS)"
    assert re.search(r"^lock: lock-verl lock-torch$", MAKEFILE, flags=re.M)


@pytest.mark.xfail(
    strict=True,
    reason="download.pytorch.org is not reachable from the build machine: `make lock` could not write the host "
    "locks here (the pytorch role refuses a host without one, naming `make lock`)",
)
def test_a_host_lock_exists_for_every_python() -> None:
    wanted = {
        f"pytorch-2.6.0-cu118-py{p.replace('.', '')}.lock.txt" for p in makefile_value("VERL_LOCK_PYTHONS").split()
    }
    assert wanted <= {lock.name for lock in LOCKS}


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


def test_sandbox_lock_pins_the_standins_as_built_and_real_files_for_the_rest(standins) -> None:
    lock = standins / "locks" / "torch-sandbox.lock.txt"
    entries = parse_lock(lock)
    for name in ("torch", "torchvision", "torchaudio"):
        (wheel,) = (standins / "torch_wheels").glob(f"{name}-*+cu118-py3-none-any.whl")
        digest = subprocess.run(["sha256sum", str(wheel)], capture_output=True, text=True, check=True).stdout.split()[0]
        assert entries[name][1] == [digest], f"{name}: the lock's sha256 is not the stand-in's as built"
    verl = parse_lock(VERL_FILES / "verl-0.4.1-py311.lock.txt")
    real = set(entries) - {"torch", "torchvision", "torchaudio"}
    assert real == {"filelock", "typing-extensions", "fsspec", "numpy"}
    for name in real:
        assert entries[name] == verl[name], f"{name}: not the verl lock's pin and sha256"
    check_lock(lock, "11")


def test_sandbox_lock_installs_with_require_hashes(standins, tmp_path) -> None:
    done = pip_install(standins / "locks" / "torch-sandbox.lock.txt", standins / "torch_wheels", tmp_path / "env")
    assert done.returncode == 0, done.stdout + done.stderr
    installed = sorted(p.name for p in (tmp_path / "env").glob("*.dist-info"))
    assert [re.sub(r"-[^-]+\.dist-info$", "", n) for n in installed] == [
        "filelock",
        "fsspec",
        "numpy",
        "torch",
        "torchaudio",
        "torchvision",
        "typing_extensions",
    ]
    assert "torch-2.6.0+cu118.dist-info" in installed, installed


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
    torch_wheels.make_wheel(served, "torch", "2.6.0+cu118", files, torch_wheels.TORCH_REQUIRES, "rebuilt")
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
    other = torch_wheels.make_wheel(tmp_path, "torch", "2.6.0+cu118", files, torch_wheels.TORCH_REQUIRES, "other")
    served_sum = parse_lock(lock)["torch"][1][0]
    tampered = tmp_path / "torch.lock.txt"
    tampered.write_text(lock.read_text().replace(served_sum, torch_wheels.sha256(other)))

    # A host whose torch is to be installed: site.yml's builds taken away.
    sh(torch_fleet, HOST, f"sudo -u p40fleet {PY} -m pip uninstall -y torch torchvision torchaudio")
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
    versions = sh(torch_fleet, HOST, f"{PY} -c 'import torch, torchvision, torchaudio as a, numpy, filelock; "
                  "print(torch.__version__, torchvision.__version__, a.__version__)'")  # fmt: skip
    assert versions.split() == ["2.6.0+cu118", "0.21.0+cu118", "2.6.0+cu118"]
    assert "No broken requirements found." in sh(torch_fleet, HOST, f"sudo -u p40fleet {PY} -m pip check")
    again = run_playbook(STACK, inventory, limit=HOST, tags=UP_TO_TORCH)
    assert again.rc == 0 and again.stats[HOST]["changed"] == 0


def test_bundle_serves_exactly_the_torch_locks_files(standins, tmp_path):
    """`p40fleet bundle`'s wheels for a host: the torch lock's files (never the index's decoys), read from the torch
    install's own sources, beside the verl lock's."""
    served = tmp_path / "served"
    served.mkdir()
    files = [*(standins / "torch_wheels").iterdir(), *locked_files_dir(sandbox_verl_lock()).glob("*.*")]
    for path in {path.name: path for path in files}.values():
        os.link(path, served / path.name)
    running = serve_directory(served)
    try:
        host = HostPins(
            host="node1",
            artifacts=[],
            controller_cache_dir=tmp_path / "cache",
            python_version="3.11",
            # An extra index the torch install must never read: it does not resolve.
            pip={"no_index": True, "index_url": "", "extra_index_urls": ["https://pypi.invalid/simple"],
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
    torch = {"torch-2.6.0+cu118-py3-none-any.whl", "torchvision-0.21.0+cu118-py3-none-any.whl"}
    assert torch | {"torchaudio-2.6.0+cu118-py3-none-any.whl"} <= names
    assert not {"torch-2.6.0-py3-none-any.whl", "torch-2.7.0-py3-none-any.whl"} & names
    locked = parse_lock(standins / "locks" / "torch-sandbox.lock.txt")
    for download in downloads:
        name = canonicalize_name(download.label.split("==")[0])
        if name in locked:
            assert download.sha256s == frozenset(locked[name][1]), download.label

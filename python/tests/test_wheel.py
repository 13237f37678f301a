"""A wheel of p40fleet, installed into a fresh venv outside the checkout, provisions without the checkout.

The wheel is built from the checkout (`pip wheel --no-deps --no-build-isolation`, offline) and installed with
the project's constraints from the dependency wheels `make fixtures` downloaded (--no-index: no network). The
installed `p40fleet` then runs from a working directory outside the checkout, with nothing of the checkout on
its paths: its playbooks and roles must be the collection the wheel carries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from p40fleet.collection import collection_files
from p40fleet_dev.fixtures import package_dependencies_dir
from p40fleet_dev.paths import REPO_ROOT

# Where the wheel carries the collection: p40fleet/collection/ is a collections path.
PACKED = "p40fleet/collection/ansible_collections/p40fleet/fleet/"


def offline_env(**extra: str) -> dict[str, str]:
    """pip without any index or configuration of the machine, Ansible without the checkout's configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def run(argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = run([sys.executable, "-m", "pip", "wheel", REPO_ROOT, "--no-deps", "--no-build-isolation", "-w", out],
                env=offline_env())  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("p40fleet-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, Path]:
    """A fresh venv with the wheel installed, and a working directory outside the checkout."""
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    assert run([sys.executable, "-m", "venv", venv]).returncode == 0
    dependencies = package_dependencies_dir()
    assert (dependencies / ".fetched").is_file(), f"{dependencies}: run `make fixtures`"
    install = run(
        [venv / "bin" / "pip", "install", "--find-links", dependencies, "-c", REPO_ROOT / "constraints.txt", wheel],
        env=offline_env(),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    work = root / "work"
    work.mkdir()
    assert not work.resolve().is_relative_to(REPO_ROOT)
    return {"venv": venv, "work": work, "state": root / "state"}


def installed_env(installed) -> dict[str, str]:
    path = os.pathsep.join([str(installed["venv"] / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    return offline_env(PATH=path, P40FLEET_STATE_DIR=str(installed["state"]))


def test_the_wheel_carries_the_collection(wheel):
    with zipfile.ZipFile(wheel) as archive:
        carried = sorted(n.removeprefix(PACKED) for n in archive.namelist() if n.startswith("p40fleet/collection/"))
    assert carried == collection_files(REPO_ROOT)


def test_the_wheel_carries_no_harness(wheel):
    """The sandbox, the test fixtures and their commands are the checkout's (p40fleet_dev), not the operator's."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    modules = sorted(n for n in names if n.endswith(".py") and not n.startswith("p40fleet/collection/"))
    assert [n for n in names if n.startswith("p40fleet_dev")] == []
    assert "p40fleet/sandbox.py" not in modules and "p40fleet/fixtures.py" not in modules, modules
    assert [n for n in modules if not n.startswith("p40fleet/")] == [], modules
    assert "p40fleet_dev" not in entry_points


def test_the_installed_package_finds_its_own_roles_and_has_no_harness(installed):
    probe = (
        "import importlib.util, json, p40fleet.paths as p\n"
        "harness = ('p40fleet_dev', 'p40fleet.sandbox', 'p40fleet.fixtures')\n"
        "harness = [m for m in harness if importlib.util.find_spec(m)]\n"
        "print(json.dumps({'checkout': str(p.CHECKOUT), 'ansible_dir': str(p.ANSIBLE_DIR),"
        " 'site': str(p.SITE_PLAYBOOK), 'harness': harness}))"
    )
    env = installed_env(installed)
    result = run([installed["venv"] / "bin" / "python", "-c", probe], cwd=installed["work"], env=env)
    assert result.returncode == 0, result.stderr
    paths = json.loads(result.stdout)
    site_packages = next((installed["venv"] / "lib").glob("python3*/site-packages"))
    assert paths["checkout"] == "None"
    assert paths["ansible_dir"] == str(site_packages / PACKED)
    assert Path(paths["site"]).is_file()
    assert paths["harness"] == []

    # The operator's command has no sandbox, demo or fixtures: refused as unknown commands, a usage error (exit 1).
    for command in ("sandbox", "demo", "fixtures"):
        refused = run([installed["venv"] / "bin" / "p40fleet", command], cwd=installed["work"], env=env)
        assert refused.returncode == 1 and "invalid choice" in refused.stderr, refused.stderr


@pytest.mark.sandbox
def test_the_installed_package_provisions_a_sandbox_host(installed, make_sandbox):
    fleet = make_sandbox("wheel", ["p40"])
    saved_state = "/etc/ansible/facts.d/p40fleet_preflight.fact"
    assert fleet.exec("node1", f"test -e {saved_state}").returncode != 0
    env = installed_env(installed)
    collection = next((installed["venv"] / "lib").glob("python3*/site-packages")) / PACKED
    p40fleet = installed["venv"] / "bin" / "p40fleet"
    argv = [p40fleet, "run", "-i", fleet.inventory_dir / "hosts.yml", "--tags", "gpu_preflight"]
    result = run(argv, cwd=installed["work"], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert fleet.exec("node1", f"test -s {saved_state}").returncode == 0
    # Every task that ran came from the installed package's site.yml and roles, none from the checkout's.
    task_paths = set()
    for event_file in installed["state"].rglob("job_events/*.json"):
        task_path = json.loads(event_file.read_text()).get("event_data", {}).get("task_path")
        if task_path:
            task_paths.add(task_path.rsplit(":", 1)[0])
    assert any(p.startswith(str(collection / "roles" / "gpu_preflight")) for p in task_paths), task_paths
    assert [p for p in task_paths if not p.startswith(str(collection))] == []

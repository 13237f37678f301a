"""Shared fixtures: the repository, sandbox fleets over real SSH, and playbook runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from p40fleet.run import RunResult
from p40fleet.run import run_playbook as _run_playbook
from p40fleet_dev.paths import REPO_ROOT, RUNS_DIR
from p40fleet_dev.sandbox import DEFAULT_LOGIN, DEFAULT_OS, Sandbox
from tests.pins import CUDA_HOME

PODMAN_MISSING = shutil.which("podman") is None or shutil.which("debootstrap") is None
# Runs the tests make are kept in the checkout's .runs/, not in the user's own state directory.
os.environ["P40FLEET_STATE_DIR"] = str(RUNS_DIR / "pytest-state")
# Screenshots and pages the tests leave for people to look at.
TEST_OUTPUT = RUNS_DIR / "test-output"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "sandbox" not in item.keywords:
            item.add_marker(pytest.mark.unit)
    if not PODMAN_MISSING:
        return
    # Sandbox tests need podman; `make test` installs it, so there a missing podman is an error.
    for item in items:
        if "sandbox" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="podman/debootstrap not installed: run `make sandbox-deps`"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


_sandboxes: dict[str, Sandbox] = {}


@pytest.fixture(scope="session")
def make_sandbox():
    """make_sandbox(name, profiles, login=DEFAULT_LOGIN, os_name=DEFAULT_OS, tmpfs=None, services=False) -> a running
    Sandbox (services: the stand-in service manager answers systemctl on its hosts);
    removed at the end of the session."""

    def make(
        name: str,
        profiles: Sequence[str],
        login: str = DEFAULT_LOGIN,
        os_name: str = DEFAULT_OS,
        tmpfs: dict[str, dict[str, str]] | None = None,
        services: bool = False,
    ) -> Sandbox:
        sandbox = Sandbox(f"pytest-{name}")
        sandbox.up(list(profiles), login=login, os_name=os_name, tmpfs=tmpfs, services=services)
        _sandboxes[sandbox.name] = sandbox
        return sandbox

    yield make
    for sandbox in _sandboxes.values():
        sandbox.down()
    _sandboxes.clear()


@pytest.fixture(scope="session")
def run_playbook():
    """run_playbook(playbook, inventory, limit=None, extra_vars=None, check=False, diff=False,
    tags=None, skip_tags=None, envvars=None, become_password_file=None)
    -> RunResult (.rc, .stdout, .stats[host][ok|changed|failures|...],
    .failures: list of HostFailure(host, task, role, message))."""

    def run(
        playbook: Path | str,
        inventory: Path | str,
        limit: str | None = None,
        extra_vars: dict | None = None,
        check: bool = False,
        diff: bool = False,
        tags: str | None = None,
        skip_tags: str | None = None,
        envvars: dict | None = None,
        become_password_file: Path | None = None,
    ) -> RunResult:
        cmdline = []
        if limit:
            cmdline += ["--limit", limit]
        if check:
            cmdline.append("--check")
        if diff:
            cmdline.append("--diff")
        if tags:
            cmdline += ["--tags", tags]
        if skip_tags:
            cmdline += ["--skip-tags", skip_tags]
        path = Path(playbook)
        if not path.is_absolute():
            path = REPO_ROOT / path
        return _run_playbook(
            path,
            inventory,
            cmdline=cmdline,
            extravars=extra_vars,
            envvars=envvars,
            become_password_file=become_password_file,
        )

    return run


@pytest.fixture(scope="session")
def site_fleet(make_sandbox, run_playbook, tmp_path_factory):
    """One P40 and one 2x P40 host taken through site.yml the way a new user would, shared by the tests of
    the converged run (test_converged_run.py) and of the launch script (test_launch_script.py), since every
    first converge of the whole pipeline costs minutes:
    .preflight_only (--tags gpu_preflight on the fresh hosts), .dry_run (--check --diff on the fresh hosts),
    .prereqs_only (--tags host_prereqs, then),
    .first and .second (two real runs), and .play(**run_playbook kwargs) for more."""
    fleet = make_sandbox("site", ["p40", "p40x2"])
    cache = tmp_path_factory.mktemp("site-apex-cache")

    def play(**kwargs):
        extra = {"apex_controller_cache_dir": str(cache), **kwargs.pop("extra_vars", {})}
        return run_playbook("site.yml", fleet.inventory_dir, extra_vars=extra, **kwargs)

    def observe(paths):
        return {
            (host.name, path): fleet.exec(host.name, f"test -e {path} || test -L {path}").returncode == 0
            for host in fleet.hosts()
            for path in paths
        }

    watched = [
        "/etc/ansible/facts.d/p40fleet_preflight.fact",
        "/var/lib/p40fleet/stages",
        "/opt/miniconda3",
        CUDA_HOME,
    ]
    fleet.play = play
    fleet.preflight_only = play(tags="gpu_preflight")
    fleet.after_preflight_only = observe(watched)
    fleet.dry_run = play(check=True, diff=True)
    fleet.after_dry_run = observe(watched)
    fleet.prereqs_only = play(tags="host_prereqs")
    fleet.after_prereqs_only = observe([*watched, "/var/lib/p40fleet/stages/host_prereqs.json", "/usr/bin/gcc-11"])
    fleet.first = play()
    fleet.second = play()
    return fleet

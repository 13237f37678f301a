"""Shared fixtures: the repository, sandbox fleets over real SSH, and playbook runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from p40fleet.run import RunResult
from p40fleet.run import run_playbook as _run_playbook
from p40fleet_dev import images
from p40fleet_dev.paths import REPO_ROOT, RUNS_DIR
from p40fleet_dev.sandbox import DEFAULT_LOGIN, DEFAULT_OS, Sandbox, claim_session
from tests import sandbox_removal, unit_costs
from tests.faults import table as fault_table
from tests.pins import CUDA_HOME
from tests.workers import sandbox_name

PODMAN_MISSING = shutil.which("podman") is None or shutil.which("debootstrap") is None
# Runs the tests make are kept in the checkout's .runs/, not in the user's own state directory.
os.environ["P40FLEET_STATE_DIR"] = str(RUNS_DIR / "pytest-state")
# Screenshots and pages the tests leave for people to look at.
TEST_OUTPUT = RUNS_DIR / "test-output"
# A work unit's worker-seconds until tests/unit_costs.py measures it: a fresh converge of a host, a sandbox fleet's
# start and a few runs, a container-free module.
FALLBACK_SECONDS = {"converge": 150.0, "sandbox": 30.0, "unit": 1.0}


def _xdist_group(item) -> str | None:
    """The work unit a test belongs to under `--dist loadgroup` when a fleet is shared beyond its module: the
    fault suite's fleet (session-wide, every module under faults/), conftest's site_fleet (the modules using it),
    or a group the module names itself (xdist_group). Other tests stay with their module, as under loadscope."""
    marker = item.get_closest_marker("xdist_group")
    if marker:
        return marker.args[0]
    if item.path.parent.name == "faults":
        return "faults"
    if "site_fleet" in item.fixturenames:
        return "site-fleet"
    return None


UNIT = pytest.StashKey[str]()


def reads_site_image_only(item) -> bool:
    """Whether a test starts from site_image without setting up site_fleet: in site_fleet's unit it goes after the
    tests that do, so it starts copies of the node1 site_fleet publishes; before them (collection order put
    test_check_diff.py first) the image was built from a fresh host, a whole converge more."""
    return "site_image" in item.fixturenames and "site_fleet" not in item.fixturenames


def _order_and_group(items) -> None:
    """Whole modules (or shared-fleet groups) as work units, the costliest first (tests/unit_costs.py's measured
    worker-seconds; a unit not measured yet by its kind: FALLBACK_SECONDS). xdist hands a worker the next unit when
    its own is almost done, so longest first (LPT) keeps the two workers busy to the end, where collection order
    left one waiting on the last fleet; within a unit the order is unchanged (a module stays whole, so its fixtures
    are set up once), but for the modules that only read site_image, which go last (reads_site_image_only). The
    first unit's fleet builds the sandbox's base image (debootstrap, under a lock a worker starting another fleet
    would wait on): the other workers start with the costliest container-free units meanwhile."""
    module_of = {item: item.nodeid.split("::")[0] for item in items}
    unit_of = {item: _xdist_group(item) or module_of[item] for item in items}
    # A module with one test using a shared fleet runs wholly with that fleet's group.
    module_group = {}
    for item in items:
        if unit_of[item] != module_of[item]:
            module_group.setdefault(module_of[item], unit_of[item])
    guess: dict[str, float] = {}
    containers: set[str] = set()
    for item in items:
        unit = module_group.get(module_of[item], unit_of[item])
        unit_of[item] = unit
        kind = "converge" if "converge" in item.keywords else "sandbox" if "sandbox" in item.keywords else "unit"
        guess[unit] = max(guess.get(unit, 0.0), FALLBACK_SECONDS[kind])
        if kind != "unit":
            containers.add(unit)
    cost = {unit: unit_costs.SECONDS.get(unit, seconds) for unit, seconds in guess.items()}
    # By name among equal costs: a group's modules (site-fleet's are not adjacent in collection) stay together.
    order = sorted(cost, key=lambda unit: (-cost[unit], unit))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    first_free = [unit for unit in order[1:] if unit not in containers][: workers - 1]
    order = [*order[:1], *first_free, *(unit for unit in order[1:] if unit not in first_free)]
    rank = {unit: index for index, unit in enumerate(order)}
    items.sort(key=lambda item: (rank[unit_of[item]], reads_site_image_only(item)))
    # Every test names its unit: loadgroup sends a test without a group to any worker on its own, which splits a
    # module across workers (each converging the module's fleet, and a test missing what the one before it left).
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit_of[item]))
        item.stash[UNIT] = unit_of[item]
        UNIT_CLOCK.units[item.nodeid] = unit_of[item]


# Each work unit's worker-seconds in this session, read by the guard at its end (tests/unit_costs.py).
UNIT_CLOCK = unit_costs.UnitClock()


# Held by the session's controller (xdist's, or the one process) while it runs; see claim_session.
SESSION_LOCK = RUNS_DIR / "pytest-session.lock"


def pytest_configure(config):
    fault_table.configure(config)
    if hasattr(config, "workerinput") or PODMAN_MISSING:
        return
    # Before any worker starts a sandbox: the sandboxes a killed session left (every test sandbox is named
    # pytest-*) go, unless another session of this checkout is running.
    config._p40fleet_session_lock, config._p40fleet_removed = claim_session(SESSION_LOCK, "pytest-")


def pytest_report_header(config):
    removed = getattr(config, "_p40fleet_removed", [])
    return [f"removed {len(removed)} sandboxes a killed test session left: {', '.join(removed)}"] if removed else []


# Before xdist's own hook, which reads the groups set here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    fault_table.collect(config, items)
    for item in items:
        if "sandbox" not in item.keywords:
            item.add_marker(pytest.mark.unit)
    _order_and_group(items)
    if not PODMAN_MISSING:
        return
    # Sandbox tests need podman; `make test` installs it, so there a missing podman is an error.
    for item in items:
        if "sandbox" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="podman/debootstrap not installed: run `make sandbox-deps`"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    sandbox_removal.session.unit_starts(item.stash.get(UNIT, ""))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        # The unit's fixtures are torn down by now; its sandboxes go while the next unit runs.
        if nextitem is not None and nextitem.stash.get(UNIT, "") != item.stash.get(UNIT, ""):
            sandbox_removal.session.unit_done(item.stash.get(UNIT, ""))


def pytest_runtest_logreport(report):
    UNIT_CLOCK.add(report.nodeid, report.when, report.duration)


def whole_suite(config) -> bool:
    """Whether this session runs the whole suite as `make test` does: the session's controller (xdist's, or the
    one process), started on the configured testpaths, nothing selected away (-k, -m, --lf, --deselect, ...)."""
    option = config.option
    narrowed = (
        option.keyword,
        option.markexpr,
        getattr(option, "lf", False),
        getattr(option, "deselect", None),
        getattr(option, "ignore", None),
        getattr(option, "ignore_glob", None),
        getattr(option, "exitfirst", False),
    )
    return (
        not hasattr(config, "workerinput")
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not any(narrowed)
    )


# The summary lines and the complaints the guard leaves for the terminal summary.
UNIT_GUARD = pytest.StashKey[tuple[list[str], list[str]]]()


def pytest_sessionfinish(session):
    try:
        sandbox_removal.session.finish()
    finally:
        unit_guard(session)


def unit_guard(session, clock: unit_costs.UnitClock | None = None) -> None:
    """The guard on a unit's cost: only a whole-suite session has every unit's whole cost (a module run alone says
    nothing, and prints nothing). A unit over its share, not reviewed, fails the session."""
    clock = UNIT_CLOCK if clock is None else clock
    if not whole_suite(session.config) or not clock.seconds:
        return
    complaints = clock.complaints()
    session.config.stash[UNIT_GUARD] = (clock.summary(), complaints)
    if complaints and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    fault_table.node_down(node)


def pytest_terminal_summary(terminalreporter, config):
    fault_table.summary(terminalreporter)
    guarded = config.stash.get(UNIT_GUARD, None)
    if guarded is None:
        return
    summary, complaints = guarded
    terminalreporter.section("worker-seconds per work unit")
    for line in summary:
        terminalreporter.write_line(line)
    for complaint in complaints:
        terminalreporter.write_line(f"FAILED (unit cost): {complaint}", red=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def make_sandbox():
    """make_sandbox(name, profiles, login=DEFAULT_LOGIN, os_name=DEFAULT_OS, tmpfs=None, services=False, image="",
    volumes=None) -> a running Sandbox (services: the stand-in service manager answers systemctl on its hosts; image:
    its hosts start as copies of a converged host, p40fleet_dev.images.converged_image; volumes: controller
    directories each host sees read-only, {controller path: host path}); removed once the work unit that
    made it is done (tests/sandbox_removal.py)."""

    def make(
        name: str,
        profiles: Sequence[str],
        login: str = DEFAULT_LOGIN,
        os_name: str = DEFAULT_OS,
        tmpfs: dict[str, dict[str, str]] | None = None,
        services: bool = False,
        image: str = "",
        volumes: dict[str, str] | None = None,
    ) -> Sandbox:
        sandbox = Sandbox(sandbox_name(name))
        sandbox_removal.session.claim(sandbox.name)
        sandbox.up(
            list(profiles), login=login, os_name=os_name, tmpfs=tmpfs, services=services, image=image, volumes=volumes
        )
        sandbox_removal.session.keep_until_unit_ends(sandbox)
        return sandbox

    return make


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
def site_fleet(make_sandbox, run_playbook, tmp_path_factory, request):
    """One P40 and one 2x P40 host taken through site.yml the way a new user would, shared by the tests of
    the converged run (test_converged_run.py), of the launch script (test_launch_script.py), of the fleet
    checklist (test_checklist.py), of the Python stack's roles (test_python_stack.py) and of the torch lock's
    install (test_torch_lock.py), the last two after the others (they break and repair the stack), since every
    first converge of the whole pipeline costs minutes:
    .preflight_only (--tags gpu_preflight on the fresh hosts), .dry_run (--check --diff on fresh node2, whose
    /usr/local/cuda already names a toolkit not installed yet; a dry run of every stage costs a host about as much
    CPU as a fifth of its converge, and node1 would show nothing more),
    .prereqs_only (--tags host_prereqs, then),
    .first and .second (two real runs), .play(**run_playbook kwargs) for more, and .apex_cache (the controller's
    Apex wheel cache the runs share: node1 builds the wheel, node2 installs it).
    The fleet logs in as root: the privilege model (README.md, "Privilege model") asks site.yml to converge and re-run
    unchanged with root login as with an ordinary user with sudo (test_privileges.py, with a sudo password;
    test_bundle.py and the role fleets, without).
    node2's /usr/local/cuda already points at the CUDA home before the first run, as on a host someone set up by
    hand: a valid host the cuda_toolkit role leaves as it found it, which the checklist must pass.
    When a test of the session starts from `site_image`, node1's disk after the two runs is kept as that image."""
    fleet = make_sandbox("site", ["p40", "p40x2"], login="root")
    linked = fleet.exec("node2", f"ln -sfn {CUDA_HOME} /usr/local/cuda")
    assert linked.returncode == 0, linked.stderr
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
    fleet.apex_cache = cache
    fleet.preflight_only = play(tags="gpu_preflight")
    fleet.after_preflight_only = observe(watched)
    fleet.dry_run = play(check=True, diff=True, limit="node2")
    fleet.after_dry_run = observe(watched)
    fleet.prereqs_only = play(tags="host_prereqs")
    fleet.after_prereqs_only = observe([*watched, "/var/lib/p40fleet/stages/host_prereqs.json", "/usr/bin/gcc-11"])
    fleet.first = play()
    fleet.second = play()
    converged = fleet.first.rc == 0 and fleet.second.rc == 0 and fleet.second.stats["node1"]["changed"] == 0
    if converged and any("site_image" in item.fixturenames for item in request.session.items):
        # The variant is site.yml with no extra vars: the one these runs add names a directory on the controller,
        # nothing on the host's disk.
        images.publish(fleet.host("node1").container, profile=SITE_IMAGE_PROFILE, login="root")
    return fleet


# site_fleet's node1.
SITE_IMAGE_PROFILE = "p40"


@pytest.fixture(scope="session")
def site_image() -> str:
    """The image of a P40 host (node1) taken through the whole of site.yml logging in as root: site_fleet's node1,
    kept after its two runs when site_fleet ran first on this worker (a module using this fixture names site_fleet's
    work unit, xdist_group("site-fleet"), and goes after site_fleet's modules in it), else built from a fresh host
    (the module run alone)."""
    return images.converged_image(profile=SITE_IMAGE_PROFILE, login="root")


@pytest.fixture(scope="session")
def converged_site_fleet(site_fleet):
    """site_fleet after its first real run, which must have succeeded: for the modules that test on its converged
    hosts."""
    assert site_fleet.first.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in site_fleet.first.failures]
    return site_fleet

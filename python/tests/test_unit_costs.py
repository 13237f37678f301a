"""tests/unit_costs.py: the measured unit costs, and the order conftest.py hands the work units out in."""

from __future__ import annotations

import argparse
import re

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests import conftest, unit_costs

TESTS = REPO_ROOT / "python" / "tests"


def group_names() -> set[str]:
    """The work units that are not one module: conftest.py's groups and the xdist_group markers modules set."""
    named = set(re.findall(r'xdist_group\("([^"]+)"\)', "".join(p.read_text() for p in TESTS.rglob("test_*.py"))))
    return named | {"faults", "site-fleet"}


@pytest.mark.parametrize("unit", sorted(unit_costs.SECONDS))
def test_every_measured_unit_still_exists(unit):
    # A unit renamed or removed would leave its figure here to order nothing.
    assert unit in group_names() or (unit.endswith(".py") and (REPO_ROOT / unit).is_file()), unit


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            [
                "703.20s setup    python/tests/faults/test_case02.py::test_a[x]@faults",
                "1.50s call     python/tests/faults/test_case02.py::test_a[x]@faults",
                "0.25s teardown python/tests/test_fetch.py::test_b@python/tests/test_fetch.py",
                "12.00s call     python/tests/test_fetch.py::test_b",  # no unit: not run under xdist
                "= 744 passed in 1579.12s =",
            ],
            {"faults": 704.7, "python/tests/test_fetch.py": 0.25},
        ),
        ([], {}),
    ],
)
def test_measure_sums_each_unit_s_phases(lines, expected):
    assert unit_costs.measure(lines) == pytest.approx(expected)


class Item:
    """What conftest's ordering reads of a collected test."""

    def __init__(self, nodeid: str, kind: str = "unit", group: str | None = None, fixtures: tuple = ()) -> None:
        self.nodeid = nodeid
        self.path = REPO_ROOT / nodeid.split("::")[0]
        self.keywords = {"sandbox": True, "converge": True} if kind == "converge" else {kind: True}
        self.fixturenames = ["site_fleet"] if group == "site-fleet" else list(fixtures)
        self.markers = []
        self.stash = {}

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, marker):
        self.markers.append(marker.mark)


def units_in_order(items) -> list[str]:
    order = []
    for item in items:
        unit = item.get_closest_marker("xdist_group").args[0]
        assert item.stash[conftest.UNIT] == unit  # what the hooks read to remove a unit's sandboxes when it ends
        if not order or order[-1] != unit:
            order.append(unit)
    return order


def collection(monkeypatch, workers: int) -> list[str]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    monkeypatch.setattr(
        unit_costs, "SECONDS", {"site-fleet": 800, "faults": 700, "python/tests/test_slow_local.py": 180}
    )
    items = [
        Item("python/tests/faults/test_case02.py::test_a", "converge"),
        Item("python/tests/test_checklist.py::test_a", "converge", group="site-fleet"),
        Item("python/tests/test_fast_local.py::test_a"),
        Item("python/tests/test_new_fleet.py::test_a", "sandbox"),
        Item("python/tests/test_slow_local.py::test_a"),
        Item("python/tests/test_slow_local.py::test_b"),
        Item("python/tests/test_converged_run.py::test_a", "converge", group="site-fleet"),
        Item("python/tests/faults/test_case03.py::test_a", "converge"),
    ]
    conftest._order_and_group(items)
    assert [item.nodeid for item in items if "faults/" in item.nodeid] == [
        "python/tests/faults/test_case02.py::test_a",
        "python/tests/faults/test_case03.py::test_a",
    ]  # within a unit, collection order
    return units_in_order(items)


def test_one_worker_runs_the_units_longest_first_each_whole(monkeypatch):
    assert collection(monkeypatch, 1) == [
        "site-fleet",
        "faults",
        "python/tests/test_slow_local.py",
        "python/tests/test_new_fleet.py",  # not measured: a sandbox module's guess
        "python/tests/test_fast_local.py",
    ]


def test_the_second_worker_starts_with_the_costliest_container_free_unit(monkeypatch):
    assert collection(monkeypatch, 2) == [
        "site-fleet",
        "python/tests/test_slow_local.py",
        "faults",
        "python/tests/test_new_fleet.py",
        "python/tests/test_fast_local.py",
    ]


def test_site_fleet_s_modules_come_before_those_that_start_from_its_image(monkeypatch):
    """The image modules name the group themselves; collection order puts test_check_diff.py first, where it would
    build the image from a fresh host before site_fleet publishes its node1."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    image = ("site_image",)
    items = [
        Item("python/tests/test_check_diff.py::test_a", "converge", fixtures=image),
        Item("python/tests/test_check_diff.py::test_b", "converge", fixtures=image),
        Item("python/tests/test_checklist.py::test_a", "converge", group="site-fleet"),
        Item("python/tests/test_ray_cluster.py::test_a", "converge", fixtures=image),
        Item("python/tests/test_torch_lock.py::test_a", "converge", group="site-fleet"),
    ]
    for item in items:  # as the image modules' pytestmark names it
        item.markers = [pytest.mark.xdist_group("site-fleet").mark]
    conftest._order_and_group(items)
    assert [item.nodeid.split("/")[-1] for item in items] == [
        "test_checklist.py::test_a",
        "test_torch_lock.py::test_a",
        "test_check_diff.py::test_a",
        "test_check_diff.py::test_b",
        "test_ray_cluster.py::test_a",
    ]
    assert units_in_order(items) == ["site-fleet"]


@pytest.mark.parametrize("unit", sorted(unit_costs.REVIEWED))
def test_every_reviewed_unit_still_exists(unit):
    assert unit in group_names() or (unit.endswith(".py") and (REPO_ROOT / unit).is_file()), unit


def clock_of(reports, units=None) -> unit_costs.UnitClock:
    clock = unit_costs.UnitClock()
    clock.units.update(units or {})
    for nodeid, when, duration in reports:
        clock.add(nodeid, when, duration)
    return clock


def test_the_clock_sums_setup_call_and_teardown_by_unit():
    clock = clock_of(
        [
            ("python/tests/faults/test_case02.py::test_a[x]@faults", "setup", 100.0),
            ("python/tests/faults/test_case02.py::test_a[x]@faults", "call", 15.5),
            ("python/tests/faults/test_case03.py::test_b@faults", "teardown", 5.0),
            ("python/tests/test_fetch.py::test_b@python/tests/test_fetch.py", "call", 2.25),
            ("python/tests/test_wheel.py::test_c", "call", 1.0),  # no xdist: the map from collection says
            ("python/tests/test_inputs.py::test_d", "setup", 0.5),  # neither: the module
            ("python/tests/test_inputs.py::test_d", "collect", 9.0),  # not a test phase
        ],
        units={"python/tests/test_wheel.py::test_c": "site-fleet"},
    )
    assert clock.seconds == pytest.approx(
        {"faults": 120.5, "python/tests/test_fetch.py": 2.25, "site-fleet": 1.0, "python/tests/test_inputs.py": 0.5}
    )
    assert clock.total() == pytest.approx(124.25)
    assert clock.slowest(2) == [("faults", 120.5), ("python/tests/test_fetch.py", 2.25)]


def test_a_unit_over_its_share_fails_unless_reviewed():
    share = unit_costs.SHARE_SECONDS
    clock = clock_of(
        [
            ("a.py::t@exactly-its-share", "call", share),
            ("a.py::t@just-over", "call", share - 1.0),
            ("a.py::t@just-over", "teardown", 1.5),  # over only with its teardown
            ("a.py::t@far-over", "setup", share * 3),
            ("a.py::t@reviewed", "call", share * 5),
        ]
    )
    over = clock.over_share(reviewed={"reviewed": "proves something only it can"})
    assert over == [("far-over", share * 3), ("just-over", share + 0.5)]  # costliest first
    assert [unit for unit, _ in clock.over_share(reviewed={})] == ["reviewed", "far-over", "just-over"]


def test_the_complaint_names_the_unit_its_seconds_and_the_way_on(monkeypatch):
    monkeypatch.setattr(unit_costs, "REVIEWED", {"site-fleet": "why"})
    clock = clock_of([("x.py::t@site-fleet", "call", 900.0), ("y.py::t@python/tests/y.py", "call", 130.25)])
    (complaint,) = clock.complaints()
    assert "python/tests/y.py took 130.2 worker-seconds" in complaint
    assert "REVIEWED in python/tests/unit_costs.py" in complaint


def test_the_summary_gives_the_total_and_the_ten_slowest(monkeypatch):
    monkeypatch.setattr(unit_costs, "REVIEWED", {"u11": "why"})
    clock = clock_of([(f"m.py::t@u{n:02}", "call", float(n * 12)) for n in range(1, 13)])
    lines = clock.summary()
    assert lines[0] == "work units: 12, 936.0 worker-seconds in all; the 10 slowest:"
    assert [line.split()[-1] for line in lines[1:]] == ["share)", "(reviewed)", *(f"u{n:02}" for n in range(10, 2, -1))]
    assert lines[1] == "     144.0 s  u12 (over its share)"


class Config:
    """What the guard reads of pytest's config."""

    def __init__(self, args_source=pytest.Config.ArgsSource.TESTPATHS, **options) -> None:
        self.args_source = args_source
        self.option = argparse.Namespace(**{"keyword": "", "markexpr": "", **options})
        self.stash = pytest.Stash()


class Session:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.exitstatus = pytest.ExitCode.OK


def test_a_whole_suite_session_fails_on_a_unit_over_its_share():
    clock = clock_of([("python/tests/test_new.py::t@python/tests/test_new.py", "call", 121.0)])
    session = Session(Config())
    conftest.unit_guard(session, clock)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    summary, complaints = session.config.stash[conftest.UNIT_GUARD]
    assert summary[1] == "     121.0 s  python/tests/test_new.py (over its share)"
    assert len(complaints) == 1 and "python/tests/test_new.py took 121.0" in complaints[0]


def test_a_whole_suite_session_within_its_shares_passes_and_keeps_its_failures():
    session = Session(Config())
    conftest.unit_guard(session, clock_of([("a.py::t@python/tests/a.py", "call", 119.0)]))
    assert session.exitstatus == pytest.ExitCode.OK
    assert session.config.stash[conftest.UNIT_GUARD][1] == []
    failed = Session(Config())
    failed.exitstatus = pytest.ExitCode.INTERRUPTED
    conftest.unit_guard(failed, clock_of([("a.py::t@python/tests/a.py", "call", 500.0)]))
    assert failed.exitstatus == pytest.ExitCode.INTERRUPTED  # its own failure stays what it reports


@pytest.mark.parametrize(
    "config",
    [
        Config(pytest.Config.ArgsSource.ARGS),  # a module or a test named
        Config(keyword="fetch"),
        Config(markexpr="unit"),
        Config(lf=True),
        Config(deselect=["python/tests/test_bundle.py"]),
        Config(exitfirst=True),
    ],
)
def test_a_session_of_part_of_the_suite_is_not_judged(config):
    session = Session(config)
    conftest.unit_guard(session, clock_of([("a.py::t@python/tests/a.py", "call", 500.0)]))
    assert session.exitstatus == pytest.ExitCode.OK
    assert conftest.UNIT_GUARD not in session.config.stash


def test_this_session_of_one_module_is_not_the_whole_suite(request):
    assert not conftest.whole_suite(request.config)

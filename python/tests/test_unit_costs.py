"""tests/unit_costs.py: the measured unit costs, and the order conftest.py hands the work units out in."""

from __future__ import annotations

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

    def __init__(self, nodeid: str, kind: str = "unit", group: str | None = None) -> None:
        self.nodeid = nodeid
        self.path = REPO_ROOT / nodeid.split("::")[0]
        self.keywords = {"sandbox": True, "converge": True} if kind == "converge" else {kind: True}
        self.fixturenames = ["site_fleet"] if group == "site-fleet" else []
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

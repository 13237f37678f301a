"""tests/unit_costs.py: the measured unit costs conftest.py orders the work units by."""

from __future__ import annotations

import re

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests import unit_costs

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

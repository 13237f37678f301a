"""The molecule scenarios (molecule/), each a role used alone on a sandbox fleet: run by pytest, as one pytest-xdist
work unit each, so a scenario shares the test machine's cores with the other fleets instead of running alone
before them (`make molecule` runs them by themselves)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from p40fleet_dev.paths import REPO_ROOT

# converge: a scenario takes fresh hosts through its roles (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

SCENARIOS = sorted(path.parent.name for path in (REPO_ROOT / "molecule").glob("*/molecule.yml"))


def test_the_scenarios_are_found():
    assert SCENARIOS == ["verl_patches"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_passes_its_whole_sequence(scenario):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "molecule"), "test", "--scenario-name", scenario],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_COLOR": "1", "PY_COLORS": "0", "ANSIBLE_FORCE_COLOR": "0"},
        capture_output=True,
        text=True,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # Every step of the scenario's sequence ran and succeeded, idempotence among them (molecule's summary).
    for step in ("create", "prepare", "converge", "idempotence", "verify", "destroy"):
        assert f"\n{scenario} > {step}: Executed: Successful\n" in output, (step, output[-6000:])
    assert re.search(rf"^{scenario} +: actions=7 +successful=7 .* failed=0$", output, re.M), output[-3000:]

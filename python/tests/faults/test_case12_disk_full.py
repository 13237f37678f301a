"""Case 12: node1's disk fills up in the middle of an install; the failure says so, and once room is made the
next run converges, with nothing left half-installed.

node1's conda prefix is a 1.2 GB filesystem of its own (a tmpfs the sandbox mounts, so nothing here fills the
test machine's disk). verl's four largest dependencies are taken out of the env, as if never installed; site.yml
reinstalls them, and once pip has begun writing the first of them back, host_trap.py fills the filesystem to its
last MiB from inside the host. pip fails midway; the run names the full disk; nothing records the set as installed.
The filler is removed, and the next run must converge, and every package in the env be whole (each file its
RECORD lists present, with that sha256).
"""

from __future__ import annotations

import pytest
from tests.faults.tools import (
    CONDA_TMPFS,
    CONVERGED_HOST,
    ENV,
    ENV_OWNER,
    ENV_PYTHON,
    SITE_PACKAGES,
    HostTrap,
    env_packages,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.fault_case(12), pytest.mark.faults_full]

HOST, OWNER, PYTHON = CONVERGED_HOST, ENV_OWNER, ENV_PYTHON
MARKER = f"{ENV}/.p40fleet-verl-requirements.sha1"  # the verl role's record of the completed set
FILLER = f"{CONDA_TMPFS}/.p40fleet-faults-filler"
TAKEN_OUT = ("ray", "pyarrow", "transformers", "pandas")


def test_a_disk_filling_up_mid_install_is_named_and_the_next_run_converges(converged_node1):
    fleet = converged_node1
    fleet.sh(HOST, f"{PYTHON} -m pip uninstall -y -q {' '.join(TAKEN_OUT)}", user=OWNER)
    fleet.sh(HOST, f"rm -f {MARKER}")
    trap = HostTrap(fleet.sandbox, HOST, "case12")
    trap.arm(
        pattern=r"-m pip install --require-hashes",
        until=f"{SITE_PACKAGES}/ray/*",
        action="fill",
        fill_path=FILLER,
        leave_bytes=1 << 20,
    )
    try:
        result = fleet.play(HOST)
        caught = trap.report()
        assert caught and "error" not in caught, caught
        assert caught["free_bytes"] <= 1 << 20 < caught["filled_bytes"]
        assert [f.message for f in result.failures] == [
            f"{HOST}: pip could not install verl's locked dependencies into {ENV} (exit 1): ERROR: Could not install"
            " packages due to an OSError: [Errno 28] No space left on device. The filesystem holding"
            f" {ENV} is full: free space there, or move p40fleet_conda_prefix to a larger disk. The set is not"
            " recorded as installed: rerun once the cause is fixed, and pip completes it."
        ]
        assert result.failures[0].role == "verl"
        # Midway: pip had begun writing the packages back (ray's files) when the disk filled; the set is not whole.
        assert fleet.exists(HOST, f"{SITE_PACKAGES}/ray")
        installed = env_packages(fleet.sandbox, HOST, PYTHON, OWNER)["names"]
        assert not set(TAKEN_OUT) <= set(installed), installed
        assert not fleet.exists(HOST, MARKER)
    finally:
        fleet.sh(HOST, f"rm -f {FILLER}")

    fleet.converge(HOST)
    packages = env_packages(fleet.sandbox, HOST, PYTHON, OWNER)
    assert set(TAKEN_OUT) <= set(packages["names"])
    assert packages["broken"] == {}
    assert fleet.exists(HOST, MARKER)

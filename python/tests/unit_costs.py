"""What each pytest-xdist work unit cost in a measured CI run, for conftest.py's ordering only: units are handed to
the two workers longest first (longest-processing-time scheduling), so neither waits at the end on a long unit the
other could have started earlier. A figure that drifts only costs balance, never a check; a unit missing here is
placed by its kind (conftest.py's FALLBACK_SECONDS).

Refresh from a run with every duration printed (`PYTEST_ADDOPTS=--durations=0 bash .ci/run > LOG`):
`python -m tests.unit_costs LOG` (from python/) prints the table to paste below.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Iterable

# Worker-seconds (setup, call and teardown of every test) per unit: 11b631c's clean-clone CI run, 2026-12-03.
SECONDS: dict[str, float] = {
    "site-fleet": 884,
    "faults": 611,
    "cuda-sandbox": 364,
    "python/tests/test_verl_patches.py": 190,
    "python/tests/test_login_modes.py": 176,
    "python/tests/test_bundle.py": 175,
    "python/tests/test_gpu_preflight.py": 102,
    "python/tests/test_operations.py": 48,
    "python/tests/test_molecule.py": 47,
    "python/tests/test_driver_hold.py": 42,
    "python/tests/test_sandbox.py": 37,
    "python/tests/test_verl_lock.py": 33,
    "python/tests/test_fact_cache.py": 9,
    "python/tests/test_training_data.py": 24,
    "python/tests/test_verl_patches_rules.py": 22,
    "python/tests/test_wheel.py": 15,
    "python/tests/test_fetch.py": 14,
    "python/tests/test_inputs.py": 9,
    "python/tests/test_ray_cluster_launch.py": 8,
    "python/tests/test_runner_hygiene.py": 7,
}

# --durations lines under xdist: "12.34s call     path::test@unit".
DURATION = re.compile(r"([\d.]+)s (?:setup|call|teardown)\s+\S+@(\S+)")


def measure(lines: Iterable[str]) -> dict[str, float]:
    """{unit: worker-seconds} from a pytest log's --durations=0 lines, costliest first."""
    total: collections.Counter[str] = collections.Counter()
    for line in lines:
        match = DURATION.match(line)
        if match:
            total[match.group(2)] += float(match.group(1))
    return dict(total.most_common())


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8", errors="replace") as log:
        for unit, seconds in measure(log).items():
            if seconds >= 5:
                print(f'    "{unit}": {round(seconds)},')

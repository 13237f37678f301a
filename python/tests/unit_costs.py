"""What each pytest-xdist work unit costs: SECONDS, measured in a CI run, for conftest.py's ordering (units are
handed to the two workers longest first, longest-processing-time scheduling, so neither waits at the end on a long
unit the other could have started earlier; a figure that drifts only costs balance, never a check; a unit missing
here is placed by its kind, conftest.py's FALLBACK_SECONDS), and the guard on what a unit may cost: a whole-suite
session (`make test`) sums every unit's worker-seconds as it runs (UnitClock), prints the total and the ten
slowest units at the end, and fails when a unit took more than SHARE_SECONDS without being on REVIEWED.

Refresh from a run with every duration printed (`PYTEST_ADDOPTS=--durations=0 bash .ci/run > LOG`):
`python -m tests.unit_costs LOG` (from python/) prints the table to paste below.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Iterable, Mapping

# Worker-seconds (setup, call and teardown of every test) per unit: the ten slowest from `make test`'s summary of the
# last clean-clone CI run, 2026-12-07 (3150 s of pytest, 6273 worker-seconds in 87 units); the others from 11b631c's
# run of 2026-12-03, test_verl_patches.py's capped at the tenth's figure, as it was not among the ten. The units
# missing until now were placed by their kind's guess (test_train_runs.py 30 s, test_cpu_verl.py 1 s), so they started
# among the last, where minutes of one unit leave the other worker idle at the end.
SECONDS: dict[str, float] = {
    "site-fleet": 2217,
    "faults": 1045,
    "cuda-sandbox": 595,
    "python/tests/test_train_runs.py": 356,
    "python/tests/test_bundle.py": 294,
    "python/tests/test_login_modes.py": 268,
    "python/tests/test_verl_patches.py": 123,
    "python/tests/test_cpu_verl.py": 193,
    "python/tests/test_gpu_qualify.py": 180,
    "python/tests/test_gpu_preflight.py": 123,
    "python/tests/test_operations.py": 48,
    "python/tests/test_molecule.py": 47,
    "python/tests/test_driver_hold.py": 42,
    "python/tests/test_sandbox.py": 37,
    "python/tests/test_verl_lock.py": 33,
    "python/tests/test_fact_cache.py": 9,
    "python/tests/test_training_data.py": 90,
    # Run alone on 2026-12-07 (the three modules, one worker): test_collection.py's converge is the owner image now.
    "owner-image": 332,
    "python/tests/test_verl_patches_rules.py": 22,
    "python/tests/test_wheel.py": 15,
    "python/tests/test_fetch.py": 14,
    "python/tests/test_inputs.py": 9,
    "python/tests/test_ray_cluster_launch.py": 8,
    "python/tests/test_runner_hygiene.py": 7,
}

# What one work unit may cost in a whole-suite session without a review: two minutes of one worker. Above it, a
# unit is made cheaper or reviewed onto REVIEWED.
SHARE_SECONDS = 120.0

# The units reviewed as worth more than their share, each with what it proves that a cheaper unit could not. A unit
# over SHARE_SECONDS and not here fails the session; one added here is a decision, taken in review.
REVIEWED: dict[str, str] = {
    "site-fleet": "two hosts through the whole of site.yml as a new user would, shared by every module that reads "
    "a converged host (conftest.py's site_fleet)",
    "faults": "the fault suite's cases on one shared fleet (docs/dev/faults.md)",
    "cuda-sandbox": "the CUDA toolkit, cuDNN and artifact fetch stages on sandbox hosts over SSH",
    "python/tests/test_verl_patches.py": "verl_patches against the real verl sdists, run by ansible-playbook",
    "python/tests/test_login_modes.py": "each login mode (sudo with and without a password, root) from a minimal "
    "host through host_prereqs",
    "python/tests/test_bundle.py": "a bundle directory is all a fresh sandbox host needs, its mirror stopped",
    "python/tests/test_train_runs.py": "p40fleet train for real on three sandbox hosts under the stand-in service "
    "manager: a stop and resume from a checkpoint and a power cycle under a run, followed to the end in status and "
    "report (review 2026-12-07: its fresh hosts are its subject, a converged host would not show a first start)",
    "python/tests/test_cpu_verl.py": "verl 0.4.1's and transformers' real code on a CPU: rollout positions with "
    "and without the patch, validation chunks and start-up checks for 1 to 8 GPUs, each with its negative control",
    "python/tests/test_gpu_qualify.py": "playbooks/qualify.yml twice over real SSH and sudo, one recorded card per "
    "host, the second run judging a card from the history the first kept",
    "python/tests/test_gpu_preflight.py": "one ansible-playbook run judging every GPU setup preflight knows, one "
    "host each, and a driver change on a converged host",
    "owner-image": "one fresh host converged by the collection built offline and installed with ansible-galaxy, "
    "from outside the checkout, for the env owner trainer (issues 58/59's acceptance), kept as the image that "
    "test_owner_fleet.py (another owner refused, qualify's load run as trainer) and test_sandbox_docs.py "
    "(docs/dev/sandbox-day.md's operator's day as written: a converged re-run, a refresh, qualify, report, train "
    "start/status/stop/resume, four bad inputs) start from (review 2026-12-07: two converges made one)",
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


class UnitClock:
    """The worker-seconds of each work unit in one session: the setup, call and teardown durations of every test
    report, summed by unit. A report names its unit as xdist's loadgroup spells it (`path::test@unit`); without
    xdist, `units` (nodeid -> unit, filled at collection) says it; else the test's module is its unit."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.units: dict[str, str] = {}

    def unit_of(self, nodeid: str) -> str:
        if nodeid in self.units:
            return self.units[nodeid]
        path, _, rest = nodeid.partition("::")
        return rest.rpartition("@")[2] if "@" in rest else path

    def add(self, nodeid: str, when: str, duration: float) -> None:
        if when in ("setup", "call", "teardown"):
            self.seconds[self.unit_of(nodeid)] += duration

    def total(self) -> float:
        return sum(self.seconds.values())

    def slowest(self, count: int = 10) -> list[tuple[str, float]]:
        return self.seconds.most_common(count)

    def over_share(
        self, share: float = SHARE_SECONDS, reviewed: Mapping[str, str] | None = None
    ) -> list[tuple[str, float]]:
        """The units that cost more than `share` worker-seconds and are not on the reviewed list, costliest first."""
        reviewed = REVIEWED if reviewed is None else reviewed
        return [(unit, s) for unit, s in self.seconds.most_common() if s > share and unit not in reviewed]

    def summary(self, count: int = 10) -> list[str]:
        lines = [f"work units: {len(self.seconds)}, {self.total():.1f} worker-seconds in all; the {count} slowest:"]
        for unit, seconds in self.slowest(count):
            mark = " (reviewed)" if unit in REVIEWED else " (over its share)" if seconds > SHARE_SECONDS else ""
            lines.append(f"  {seconds:8.1f} s  {unit}{mark}")
        return lines

    def complaints(self) -> list[str]:
        return [
            f"work unit {unit} took {seconds:.1f} worker-seconds, more than its share of {SHARE_SECONDS:.0f}: make it "
            "cheaper, or add it to REVIEWED in python/tests/unit_costs.py with what it proves (a review's decision)"
            for unit, seconds in self.over_share()
        ]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8", errors="replace") as log:
        for unit, seconds in measure(log).items():
            if seconds >= 5:
                print(f'    "{unit}": {round(seconds)},')

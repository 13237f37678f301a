"""make bench's figures from raw material (the mirror's access log, ansible-runner's job events), without containers."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.benchmarks import bench

RUNFILE = "/cuda_runfile/cuda_11.8.0_520.61.05_linux.run"


def log_line(path: str, method: str = "GET", status: int = 200, client: str = "10.89.0.5") -> str:
    return f'{client} - - [01/Dec/2026 09:04:27] "{method} {path} HTTP/1.1" {status} -'


@pytest.fixture
def mirror_dir(tmp_path):
    (tmp_path / "cuda_runfile").mkdir()
    (tmp_path / "cuda_runfile" / "cuda_11.8.0_520.61.05_linux.run").write_bytes(b"x" * 1000)
    return tmp_path


def test_served_counts_only_new_complete_gets_and_tells_the_fleet_mirror_from_upstream(mirror_dir):
    before = Counter([log_line(RUNFILE)])
    after = before + Counter(
        [
            log_line(RUNFILE, client="10.89.0.6"),
            log_line(RUNFILE, client="10.89.0.7"),
            log_line("/fleet-mirror/.." + RUNFILE),
            log_line(RUNFILE, method="HEAD"),
            log_line("/cuda_runfile/missing.run", status=404),
        ]
    )
    assert bench.served_since(before, after, mirror_dir) == {
        RUNFILE: {"requests": 3, "bytes": 3000, "size": 1000, "upstream_requests": 2, "fleet_mirror_requests": 1}
    }


def test_the_same_line_twice_counts_twice(mirror_dir):
    line = log_line(RUNFILE)
    served = bench.served_since(Counter(), Counter({line: 2}), mirror_dir)
    assert served[RUNFILE]["upstream_requests"] == 2 and served[RUNFILE]["bytes"] == 2000


def event(kind: str, host: str, task: str, role: str = "", play: str = "stage play") -> dict:
    return {"event": kind, "event_data": {"host": host, "task": task, "role": role, "play": play}}


def test_executed_tasks_per_stage_count_ok_results_once_per_task_and_never_skips():
    events = [
        event("playbook_on_task_start", "", "Probe the toolkit", "cuda_toolkit"),
        event("runner_on_ok", "node1", "Probe the toolkit", "cuda_toolkit"),
        event("runner_on_ok", "node2", "Probe the toolkit", "cuda_toolkit"),
        event("runner_item_on_ok", "node1", "Copy each file", "cuda_toolkit"),
        event("runner_on_ok", "node1", "Copy each file", "cuda_toolkit"),
        event("runner_on_skipped", "node2", "Copy each file", "cuda_toolkit"),
        event("runner_on_ok", "node1", "Gathering Facts", play="Gather facts and ping every host."),
        event("runner_on_failed", "node2", "Gathering Facts", play="Gather facts and ping every host."),
    ]
    assert bench.executed_per_stage(events) == {
        "cuda_toolkit": {"node1": 2, "node2": 1},
        "play: Gather facts and ping every host.": {"node1": 1},
    }


def test_ratios_and_spreads():
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(1.0, 0.0) is None

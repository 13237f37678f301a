"""What a run shows while it goes, from synthetic ansible-runner events (no containers): plain,
unwrapped lines when the output is not a terminal, a live table per host when it is."""

from __future__ import annotations

import io

from rich.console import Console

from p40fleet.progress import LiveProgress, PlainProgress, Tracker, make_progress

LONG_TASK = "Ensure a host that fails preflight is refused before anything touches it, whatever the column count"
PREFLIGHT_MESSAGE = (
    "gpu_preflight refused gpu-rack2-01.example.internal (nothing was changed on it):\n"
    "- driver 470.256.02 is too old for CUDA 11.8; required: >= 520.61.05 (gpu_preflight_driver_min_version); "
    "do: upgrade the driver (e.g. 535 or 550), reboot, run again"
)
UNREACHABLE = "Failed to connect to the host via ssh: ssh: connect to host 192.0.2.21 port 22: Connection timed out"


def event(kind: str, **data) -> dict:
    return {"event": kind, "event_data": data}


def events() -> list[dict]:
    return [
        event("playbook_on_start"),
        event("playbook_on_play_start", play="Preflight every host before anything is downloaded or changed."),
        event("playbook_on_task_start", task="Probe.", role="gpu_preflight"),
        event("runner_on_start", host="gpu-rack1-01", task="Probe.", role="gpu_preflight"),
        event("runner_on_start", host="gpu-rack2-01.example.internal", task="Probe.", role="gpu_preflight"),
        event("runner_on_ok", host="gpu-rack1-01", task="Probe.", role="gpu_preflight", res={"changed": False}),
        event(
            "runner_on_unreachable", host="gpu-lab-07", task="Probe.", role="gpu_preflight", res={"msg": UNREACHABLE}
        ),
        event("runner_on_start", host="gpu-rack2-01.example.internal", task=LONG_TASK, role="gpu_preflight"),
        event(
            "runner_on_failed",
            host="gpu-rack2-01.example.internal",
            task=LONG_TASK,
            role="gpu_preflight",
            res={"msg": PREFLIGHT_MESSAGE},
            ignore_errors=None,
        ),
        event("runner_on_failed", host="gpu-rack1-01", task="Tolerated.", res={"msg": "meh"}, ignore_errors=True),
        event("runner_on_start", host="gpu-rack1-01", task="Unpack the toolkit.", role="cuda_toolkit"),
        event("runner_item_on_ok", host="gpu-rack1-01", task="Unpack the toolkit.", res={"changed": True}),
        event(
            "runner_on_ok", host="gpu-rack1-01", task="Unpack the toolkit.", role="cuda_toolkit", res={"changed": True}
        ),
        event("runner_on_skipped", host="gpu-rack1-01", task="Skip me.", role="cuda_toolkit"),
    ]


def test_plain_mode_prints_one_unwrapped_line_per_event_that_matters():
    out = io.StringIO()
    console = Console(file=out, width=80)  # a pipe: not a terminal, rich's default 80 columns
    assert not console.is_terminal
    progress = make_progress(console, "run")
    assert isinstance(progress, PlainProgress)
    with progress:
        for e in events():
            progress(e)
    lines = out.getvalue().splitlines()
    assert lines == [
        "run: play: Preflight every host before anything is downloaded or changed.",
        f"run: gpu-lab-07 unreachable: [gpu_preflight] Probe.: {UNREACHABLE}",
        f"run: gpu-rack2-01.example.internal failed: [gpu_preflight] {LONG_TASK}: "
        + " | ".join(PREFLIGHT_MESSAGE.splitlines()),
        "run: gpu-rack1-01 changed: [cuda_toolkit] Unpack the toolkit.",
    ]
    assert max(len(line) for line in lines) > 200  # kept whole, far past 80 columns
    assert "\x1b[" not in out.getvalue()  # no terminal codes in a log


def test_the_tracker_keeps_stage_task_and_counts_per_host_and_the_recap_wins():
    tracker = Tracker()
    for e in events():
        tracker.update(e)
    rack1 = tracker.hosts["gpu-rack1-01"]
    assert (rack1.stage, rack1.task, rack1.state) == ("cuda_toolkit", "Unpack the toolkit.", "running")
    counts = rack1.counts
    assert (counts["ok"], counts["changed"], counts["ignored"], counts["skipped"]) == (3, 1, 1, 1)
    assert tracker.hosts["gpu-rack2-01.example.internal"].state == "failed"
    assert tracker.hosts["gpu-lab-07"].state == "unreachable"
    tracker.update(
        event(
            "playbook_on_stats",
            ok={"gpu-rack1-01": 7},
            changed={"gpu-rack1-01": 2},
            dark={"gpu-lab-07": 1},
            failures={"gpu-rack2-01.example.internal": 1},
            processed={"gpu-rack1-01": 1, "gpu-lab-07": 1, "gpu-rack2-01.example.internal": 1},
        )
    )
    assert (rack1.state, rack1.counts["ok"], rack1.counts["changed"]) == ("changed", 7, 2)


def test_live_mode_draws_a_row_per_host_and_prints_failures_above_it():
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True, color_system=None)
    progress = make_progress(console, "first run", live=True)
    assert isinstance(progress, LiveProgress)
    with progress:
        for e in events():
            progress(e)
    text = out.getvalue()
    assert "gpu-rack2-01.example.internal failed: [gpu_preflight]" in text
    for host in ("gpu-rack1-01", "gpu-lab-07"):
        assert host in text
    final = progress.render()
    rendered = Console(width=160, record=True, color_system=None)
    rendered.print(final)
    rows = rendered.export_text().splitlines()
    rack1 = next(r for r in rows if r.startswith("gpu-rack1-01"))
    assert "running" in rack1 and "cuda_toolkit" in rack1 and "Unpack the toolkit." in rack1
    assert next(r for r in rows if r.startswith("gpu-lab-07")).split()[1] == "unreachable"


def test_nothing_is_drawn_when_no_event_came():
    out = io.StringIO()
    with make_progress(Console(file=out, force_terminal=True), "run", live=True):
        pass
    assert out.getvalue() == ""

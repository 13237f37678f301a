"""tests/sandbox_removal.py: a work unit's sandboxes go in the background once the unit is done, a name is started
again only after its removal ended, and the session's end leaves none (no containers: a recorder stands in for
the removal)."""

from __future__ import annotations

import threading

import pytest

from p40fleet_dev.sandbox import Sandbox
from tests.sandbox_removal import Removals


class Recorder:
    """Records each removal call's sandbox names; holds a call until released where asked."""

    def __init__(self, hold: bool = False, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fail = fail

    def __call__(self, sandboxes) -> None:
        self.release.wait(timeout=10)
        self.calls.append([sandbox.name for sandbox in sandboxes])
        if self.fail:
            raise RuntimeError("podman rm failed")


def started(removals: Removals, unit: str, *names: str) -> None:
    removals.unit_starts(unit)
    for name in names:
        removals.claim(name)
        removals.keep_until_unit_ends(Sandbox(name))


def test_a_unit_s_sandboxes_go_when_it_ends_and_the_rest_at_the_session_s_end():
    recorder = Recorder()
    removals = Removals(recorder)
    started(removals, "a.py", "pytest-a", "pytest-a2")
    started(removals, "b.py", "pytest-b")
    removals.unit_done("a.py")
    removals.claim("pytest-a")  # waits for that removal
    assert recorder.calls == [["pytest-a", "pytest-a2"]]
    removals.unit_done("a.py")  # twice: nothing more
    removals.finish()
    assert recorder.calls == [["pytest-a", "pytest-a2"], ["pytest-b"]]


def test_a_name_starts_again_only_after_its_removal_ended():
    recorder = Recorder(hold=True)
    removals = Removals(recorder)
    started(removals, "a.py", "pytest-cuda")
    removals.unit_done("a.py")
    claimed = threading.Thread(target=removals.claim, args=("pytest-cuda",))
    claimed.start()
    claimed.join(timeout=0.5)
    assert claimed.is_alive() and recorder.calls == []  # still waiting on the removal
    recorder.release.set()
    claimed.join(timeout=10)
    assert not claimed.is_alive() and recorder.calls == [["pytest-cuda"]]
    removals.finish()


def test_the_session_s_end_waits_for_removals_under_way_and_raises_their_error():
    recorder = Recorder(fail=True)
    removals = Removals(recorder)
    started(removals, "a.py", "pytest-a")
    removals.unit_done("a.py")
    with pytest.raises(RuntimeError, match="podman rm failed"):
        removals.finish()
    assert recorder.calls == [["pytest-a"]]

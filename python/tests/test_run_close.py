"""p40fleet.run's close of ansible-playbook's pty (docs/benchmarks-overhead.md): a child already reaped is closed
without ptyprocess's 0.1 s pause; a live one keeps the pause and is still ended."""

from __future__ import annotations

import time

import ptyprocess
import pytest

from p40fleet import run


@pytest.fixture
def pauses(monkeypatch):
    run._close_exited_without_pause()
    slept: list[float] = []

    class Clock:  # ptyprocess's own time module, its sleeps recorded
        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(seconds)
            time.sleep(seconds)

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr(ptyprocess.ptyprocess, "time", Clock())
    return slept


def test_a_reaped_child_is_closed_without_the_pause(pauses):
    child = ptyprocess.PtyProcess.spawn(["true"])
    deadline = time.monotonic() + 10
    while child.isalive():  # what ansible-runner's loop does before it closes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.close()
    assert child.closed
    assert [pause for pause in pauses if pause] == []


def test_a_live_child_keeps_the_pause_and_is_ended(pauses):
    child = ptyprocess.PtyProcess.spawn(["sleep", "30"])
    child.close(force=True)
    assert 0.1 in pauses
    assert not child.isalive()


def test_installing_twice_wraps_once():
    run._close_exited_without_pause()
    first = ptyprocess.PtyProcess.close
    run._close_exited_without_pause()
    assert ptyprocess.PtyProcess.close is first

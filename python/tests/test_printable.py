"""Owner-made text reaches the operator without the control characters a terminal acts on: the driver's
printable()/one_line() (failure messages, `p40fleet report`'s lines) and launch_script's smoke verdict, which keeps
the owner's summary and reason. Each row: what an owner's process printed, what the operator sees."""

from __future__ import annotations

import json

import pytest

from p40fleet.progress import CONTROLS, one_line, printable
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

SMOKE_RULES = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "ls_print")

TABLE = [
    ("plain text stays", "smoke: PASS 5/5 steps", "smoke: PASS 5/5 steps"),
    ("tab and newline stay", "a\tb\nc", "a\tb\nc"),
    ("a colour sequence loses its ESC", "\x1b[31mFAIL\x1b[0m", "[31mFAIL[0m"),
    ("a title sequence (OSC, BEL)", "\x1b]0;pwned\x07ok", "]0;pwnedok"),
    ("carriage return cannot overwrite a line", "FAIL\rPASS", "FAILPASS"),
    ("backspaces cannot erase words", "FAIL\x08\x08\x08\x08PASS", "FAILPASS"),
    ("a C1 CSI and DEL", "a\x9b2Jb\x7fc", "a2Jbc"),
    ("a right-to-left override cannot reorder", "exit \u202e0 tixe", "exit 0 tixe"),
    ("zero-width and isolate marks", "P\u200bA\u2066S\u2069S\ufeff", "PASS"),
    ("a NUL", "a\x00b", "ab"),
]


@pytest.mark.parametrize(("_case", "made", "shown"), TABLE, ids=[row[0] for row in TABLE])
def test_printable(_case, made, shown):
    assert printable(made) == shown


def test_one_line_joins_what_is_left():
    assert one_line("first\r\n\x1b[2Ksecond\u2028third") == "first | [2Ksecondthird"


def test_the_smoke_verdict_keeps_no_control_character():
    verdict = {"ok": False, "why": "OOM\x1b[2J\rall good", "gpu_peak_mib": {"0\x1b": 100}}
    stdout = "smoke: FAIL \u202e1/5\x07\nsmoke-json: " + json.dumps(verdict)
    result = SMOKE_RULES.launch_script_smoke_result(stdout, 1, 5, "2026-12-05T00:00:00\x1b")
    assert result["summary"] == "smoke: FAIL 1/5"
    assert result["why"] == "OOM[2Jall good"
    assert result["gpu_peak_mib"] == {"0": 100}
    assert result["at"] == "2026-12-05T00:00:00"


def test_the_role_and_the_driver_remove_the_same_characters():
    assert SMOKE_RULES.CONTROLS.pattern == CONTROLS.pattern

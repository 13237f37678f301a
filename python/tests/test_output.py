"""StderrConsole (python/p40fleet/output.py): off a terminal its lines are rich's own, and `p40fleet run` starts
without importing rich; on a terminal, or for anything but a plain line, rich writes."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich import control
from rich.console import Console

from p40fleet import output
from p40fleet_dev.paths import REPO_ROOT

LINES = [
    "plain",
    "",
    "trailing   ",
    "bell\x07 backspace\x08 vt\x0b ff\x0c cr\r end",
    "esc\x1b[31m stays, as rich keeps it",
    "[red]markup[/] and :smile: are text",
    "wide 漢字 é \u200b zero-width",
    "multi\nline\n",
    "x" * 300,
    "nul\x00 del\x7f c1\x85\x9b",
]
NO_TTY_ENV = ("TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE")


@pytest.fixture
def stderr(monkeypatch, capsys):
    """What reaches standard error off a terminal (pytest's capture stands in for it only in the test's call)."""
    for name in NO_TTY_ENV:
        monkeypatch.delenv(name, raising=False)
    return capsys


def rich_out(*objects, **kwargs) -> str:
    stream = io.StringIO()
    Console(file=stream, highlight=False).out(*objects, **kwargs)
    return stream.getvalue()


def test_the_control_codes_stripped_are_richs():
    assert list(output.STRIP_CONTROL_CODES) == list(control.STRIP_CONTROL_CODES)


@pytest.mark.parametrize("line", LINES)
def test_a_plain_line_off_a_terminal_is_what_rich_writes(stderr, line):
    console = output.StderrConsole()
    console.out(line, highlight=False)
    assert stderr.readouterr().err == rich_out(line)
    assert console._rich is None  # written without rich


def test_several_objects_a_separator_and_an_end_as_rich_joins_them(stderr):
    console = output.StderrConsole()
    console.out("a", 1, None, sep="|", end="!\n")
    assert stderr.readouterr().err == rich_out("a", 1, None, sep="|", end="!\n")


@pytest.mark.parametrize(
    ("line", "kwargs"),
    [("tab\there 漢\tcells", {}), ("styled", {"style": "red"}), ("highlighted 1.5", {"highlight": True})],
)
def test_tabs_styles_and_highlights_are_left_to_rich(stderr, line, kwargs):
    console = output.StderrConsole()
    console.out(line, **kwargs)
    assert console._rich is not None
    assert stderr.readouterr().err == rich_out(line, **kwargs)


@pytest.mark.parametrize(
    ("env", "isatty", "terminal"),
    [
        ({}, False, False),
        ({}, True, True),
        ({"TTY_COMPATIBLE": "1"}, False, True),
        ({"TTY_COMPATIBLE": "0"}, True, False),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"FORCE_COLOR": ""}, True, False),
    ],
)
def test_is_terminal_is_richs_verdict(monkeypatch, env, isatty, terminal):
    for name in NO_TTY_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return isatty

    monkeypatch.setattr(sys, "stderr", Stream())
    assert output.stderr_is_terminal() is terminal
    assert Console(stderr=True).is_terminal is terminal
    assert output.StderrConsole().is_terminal is terminal


def test_on_a_terminal_rich_writes_every_line(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    console = output.StderrConsole()
    console.out("on a terminal", highlight=False)
    assert console._rich is not None and console.rich.is_terminal
    assert "on a terminal" in stream.getvalue()


def test_the_rest_of_richs_console_is_richs(stderr):
    console = output.StderrConsole()
    console.print("[red]p40fleet fetch: marked up[/]")
    assert stderr.readouterr().err == "p40fleet fetch: marked up\n"
    assert console.width == console.rich.width


def test_the_run_command_and_its_output_off_a_terminal_import_no_rich():
    """Importing rich cost every `p40fleet run` about 0.035 s of CPU where its output goes to a log or a pipe."""
    code = "\n".join(
        [
            "import sys",
            "from p40fleet import cli, report",
            "from p40fleet.progress import make_progress",
            "progress = make_progress(cli.console, 'run')",
            "progress({'event': 'playbook_on_play_start', 'event_data': {'play': 'p'}})",
            "summary = {'runs': [{'label': 'run', 'exit_code': 0, 'status': 'successful', 'rc': 0, 'hosts': {}}]}",
            "report.print_summary(cli.console, summary)",
            "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.')))",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in NO_TTY_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env
    )
    assert done.stdout.strip() == "[]"
    summary = "p40fleet · run · exit 0: ok (successful, ansible-playbook rc 0)"
    assert done.stderr.splitlines() == ["run: play: p", summary]

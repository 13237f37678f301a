"""What a run shows while it goes: a live table per host on a terminal, plain lines elsewhere.

On a terminal (stdout and stderr both): one row per host with its stage (the role), current task
and counts, redrawn in place by rich.live; failures are also printed above it as they happen.
Anywhere else (CI logs, `| tee`): one unwrapped line per event that matters (a stage starting, a
change, a failure, an unreachable host), however long, so a log keeps every word.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p40fleet.run import STAT_KEYS, _failure_message, _stats_from

if TYPE_CHECKING:
    from rich.console import Console, Group

# rich is imported by the live table only: plain lines need none of it (python/p40fleet/output.py).

STATE_STYLES = {
    "waiting": "dim",
    "running": "cyan",
    "ok": "green",
    "changed": "yellow",
    "failed": "bold red",
    "unreachable": "bold magenta",
}


@dataclass
class HostProgress:
    host: str
    stage: str = ""
    task: str = ""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0))
    done: bool = False

    @property
    def state(self) -> str:
        if self.counts["unreachable"]:
            return "unreachable"
        if self.counts["failures"]:
            return "failed"
        if not self.done:
            return "running" if self.task else "waiting"
        return "changed" if self.counts["changed"] else "ok"


class Tracker:
    """Per-host stage, task and counts, from ansible-runner events (the recap has the last word)."""

    def __init__(self) -> None:
        self.hosts: dict[str, HostProgress] = {}
        self.play = ""

    def host(self, name: str) -> HostProgress:
        if name not in self.hosts:
            self.hosts[name] = HostProgress(name)
        return self.hosts[name]

    def update(self, event: dict) -> None:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        if kind == "playbook_on_play_start":
            self.play = data.get("play", "")
            return
        if kind == "playbook_on_stats":
            for name, stats in _stats_from(data).items():
                entry = self.host(name)
                entry.counts = dict(stats)
                entry.done = True
            return
        name = data.get("host")
        if not name or kind.startswith("runner_item_"):
            return
        entry = self.host(name)
        if kind == "runner_on_start":
            entry.stage = data.get("role") or data.get("play") or self.play
            entry.task = data.get("task", "")
        elif kind == "runner_on_ok":
            entry.counts["ok"] += 1
            entry.counts["changed"] += bool(data.get("res", {}).get("changed"))
        elif kind == "runner_on_failed":
            if data.get("ignore_errors"):
                entry.counts["ok"] += 1
                entry.counts["ignored"] += 1
            else:
                entry.counts["failures"] += 1
        elif kind == "runner_on_skipped":
            entry.counts["skipped"] += 1
        elif kind == "runner_on_unreachable":
            entry.counts["unreachable"] += 1


# What a terminal acts on rather than shows: C0 controls but tab and newline (ESC starts colour, cursor and title
# sequences), DEL, C1 controls (CSI and OSC on some terminals), and the Unicode marks that reorder or hide text
# (bidi overrides and isolates, zero-width characters, the line and paragraph separators).
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """Text an owner's process made (smoke verdicts, task output, failure messages), its control characters
    removed before it reaches the operator's terminal: the process cannot rewrite the screen or hide words."""
    return CONTROLS.sub("", str(text))


def one_line(text: str) -> str:
    """A message on one line: its lines joined, its control characters removed (printable), nothing else dropped."""
    return " | ".join(line.strip() for line in printable(text).splitlines() if line.strip())


def event_line(label: str, event: dict) -> str | None:
    """The plain line for an event, or None for events that stay quiet (ok, skipped, starts)."""
    kind = event.get("event", "")
    data = event.get("event_data", {})
    host = data.get("host", "")
    role = data.get("role", "")
    where = f"[{role}] {data.get('task', '')}" if role else data.get("task", "")
    if kind == "playbook_on_play_start":
        return f"{label}: play: {data.get('play', '')}"
    if kind == "runner_on_ok" and data.get("res", {}).get("changed"):
        return f"{label}: {host} changed: {where}"
    if kind == "runner_on_failed" and not data.get("ignore_errors"):
        return f"{label}: {host} failed: {where}: {one_line(_failure_message(data.get('res', {})))}"
    if kind == "runner_on_unreachable":
        return f"{label}: {host} unreachable: {where}: {one_line(_failure_message(data.get('res', {})))}"
    return None


class PlainProgress:
    """One line per event that matters, never wrapped or cut (Console.out neither wraps nor crops)."""

    def __init__(self, console: Console, label: str) -> None:
        self.console = console
        self.label = label
        self.tracker = Tracker()

    def __call__(self, event: dict) -> None:
        self.tracker.update(event)
        line = event_line(self.label, event)
        if line is not None:
            self.console.out(line, highlight=False)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None


class LiveProgress:
    """A table per host (stage, task, counts), redrawn in place; failures printed above it."""

    def __init__(self, console: Console, label: str) -> None:
        from rich.live import Live

        # p40fleet's StderrConsole hands over the rich Console it stands for.
        console = getattr(console, "rich", console)
        self.console = console
        self.label = label
        self.tracker = Tracker()
        self.live = Live(self.render(), console=console, refresh_per_second=4, transient=False)
        self.started = False

    def render(self) -> Group:
        from rich.console import Group
        from rich.markup import escape
        from rich.table import Table
        from rich.text import Text

        table = Table(expand=True, pad_edge=False, box=None, header_style="bold")
        table.add_column("host", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("stage", no_wrap=True)
        table.add_column("task", no_wrap=True, overflow="ellipsis", ratio=1)
        for column in ("ok", "changed", "failed", "unreach.", "skipped"):
            table.add_column(column, justify="right", no_wrap=True)
        for entry in self.tracker.hosts.values():
            counts = entry.counts
            table.add_row(
                escape(entry.host),
                Text(entry.state, style=STATE_STYLES[entry.state]),
                escape(entry.stage),
                escape(entry.task),
                str(counts["ok"]),
                str(counts["changed"]),
                str(counts["failures"]),
                str(counts["unreachable"]),
                str(counts["skipped"]),
            )
        title = Text.assemble((f"{self.label}", "bold"), " · ", self.tracker.play)
        return Group(title, table)

    def __call__(self, event: dict) -> None:
        if not self.started:
            # Started by the first event, so nothing is drawn for a run that bad input stopped.
            self.live.start()
            self.started = True
        self.tracker.update(event)
        kind = event.get("event", "")
        if kind in ("runner_on_failed", "runner_on_unreachable"):
            line = event_line(self.label, event)
            if line is not None:
                from rich.text import Text

                self.live.console.print(Text(line, style="red"))
        self.live.update(self.render())

    def __enter__(self) -> LiveProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            self.live.update(self.render())
            self.live.stop()
            self.started = False


def interactive(console: Console) -> bool:
    """Live output only where a person watches: the console is a terminal, and so are stdout and
    stderr (with `| tee` or in CI one of them is not)."""
    return console.is_terminal and sys.stdout.isatty() and sys.stderr.isatty()


def make_progress(console: Console, label: str, live: bool | None = None) -> PlainProgress | LiveProgress:
    if live is None:
        live = interactive(console)
    return LiveProgress(console, label) if live else PlainProgress(console, label)

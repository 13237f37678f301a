"""Standard error as `p40fleet` writes to it: rich's console, made only where plain lines are not enough.

Importing rich cost `p40fleet run` about 0.035 s of CPU on every start, where its output goes to a log, a pipe or a
test (docs/benchmarks-overhead.md). Off a terminal its every line is `Console.out`, which neither wraps nor styles:
the text with rich's control codes removed. StderrConsole writes those lines itself and hands everything else (a
terminal, a table, a tab, a style) to the rich Console it then makes, so what reaches the stream is rich's own.
"""

from __future__ import annotations

import os
import sys

# rich.control.STRIP_CONTROL_CODES (BEL, BS, VT, FF, CR): what Console.out removes from a line
# (python/tests/test_output.py holds the two equal).
STRIP_CONTROL_CODES = (7, 8, 11, 12, 13)
_STRIP = dict.fromkeys(STRIP_CONTROL_CODES)


def stderr_is_terminal() -> bool:
    """rich's Console.is_terminal for standard error, read without importing rich."""
    tty_compatible = os.environ.get("TTY_COMPATIBLE", "")
    if tty_compatible in ("0", "1"):
        return tty_compatible == "1"
    force_color = os.environ.get("FORCE_COLOR")
    if force_color is not None:
        return force_color != ""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class StderrConsole:
    """rich's Console(stderr=True, highlight=False) in what p40fleet uses of it; rich is imported on first need."""

    def __init__(self) -> None:
        self._rich = None

    @property
    def rich(self):
        """The rich Console itself (a live table, a styled line): made on first use."""
        if self._rich is None:
            from rich.console import Console

            self._rich = Console(stderr=True, highlight=False)
        return self._rich

    @property
    def is_terminal(self) -> bool:
        return self._rich.is_terminal if self._rich is not None else stderr_is_terminal()

    def out(self, *objects, sep: str = " ", end: str = "\n", style=None, highlight: bool | None = None) -> None:
        text = sep.join(str(o) for o in objects)
        # rich expands tabs by the cells a character takes; styles and highlights are rich's own.
        if style is not None or highlight or "\t" in text or self.is_terminal:
            self.rich.out(*objects, sep=sep, end=end, style=style, highlight=highlight)
            return
        stream = sys.stderr
        stream.write(text.translate(_STRIP) + end)
        stream.flush()

    def __getattr__(self, name: str):
        # Everything else (print with markup, tables, width) is rich's.
        return getattr(self.rich, name)

"""p40fleet's exit codes: the one table of them. docs/cli.md shows it; python/tests/test_cli_docs.py holds the two
equal and makes every subcommand give them."""

from __future__ import annotations

import signal
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    # Usage errors too: argparse's own 2 would read as "hosts failed" to a script.
    ERROR = 1
    HOSTS_FAILED = 2
    HOSTS_UNREACHABLE = 3
    BAD_INPUT = 4
    NOT_IDEMPOTENT = 5
    # 128 + the signal's number, as a shell reports a command a signal ended.
    INTERRUPTED = 128 + signal.SIGINT
    TERMINATED = 128 + signal.SIGTERM


# What each code says, in the words of docs/cli.md's table and the summary's header.
MEANING = {
    Exit.OK: "ok",
    Exit.ERROR: "p40fleet could not run",
    Exit.HOSTS_FAILED: "hosts failed",
    Exit.HOSTS_UNREACHABLE: "hosts unreachable",
    Exit.BAD_INPUT: "bad input",
    Exit.NOT_IDEMPOTENT: "not idempotent",
    Exit.INTERRUPTED: "interrupted",
    Exit.TERMINATED: "terminated",
}


def for_signal(number: int) -> int:
    """The exit code of a run a signal stopped."""
    return 128 + int(number)


def meaning(code: int) -> str:
    try:
        return MEANING[Exit(code)]
    except ValueError:
        return "unknown"

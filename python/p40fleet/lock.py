"""One run per inventory at a time: an flock on a file in the inventory's state directory.

The kernel drops an flock when its holder dies, so a run that was killed never blocks the next one;
the file keeps who held it last (pid, start time, command), which is what a refused run is told.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from p40fleet.state import now


class RunLocked(RuntimeError):
    """Another p40fleet run holds the inventory."""

    def __init__(self, inventory: Path, holder: dict) -> None:
        self.inventory = inventory
        self.holder = holder
        who = f"pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"
        if holder.get("command"):
            who += f": {holder['command']}"
        super().__init__(
            f"another p40fleet run against {inventory} is in progress ({who}); "
            "wait for it to finish, or stop that process, then run again"
        )


def _holder(handle) -> dict:
    # The holder writes its details right after taking the lock: give it a moment.
    for _ in range(20):
        handle.seek(0)
        text = handle.read()
        if text.strip():
            try:
                return json.loads(text)
            except ValueError:
                pass
        time.sleep(0.05)
    return {}


EXTRA_VARS_OPTIONS = ("-e", "--extra-vars")
HIDDEN = "<hidden>"


def redacted_command(argv: list[str]) -> str:
    """The command line as the lock records it: what -e/--extra-vars gave is hidden (it may be a token), unless
    it names a file (@FILE); everything else is kept, so a refused run is still told what holds the lock."""
    shown, hide_next = [], False
    for arg in argv:
        name, equals, value = arg.partition("=")
        # argparse takes any unambiguous prefix of a long option: --extra, --ex.
        long_form = arg.startswith("--") and len(name) > 2 and EXTRA_VARS_OPTIONS[1].startswith(name)
        if hide_next:
            shown.append(arg if arg.startswith("@") else HIDDEN)
            hide_next = False
        elif arg == "-e" or (long_form and not equals):
            shown.append(arg)
            hide_next = True
        elif long_form:
            shown.append(arg if value.startswith("@") else f"{name}={HIDDEN}")
        elif arg.startswith("-e") and not arg.startswith("--"):
            shown.append(arg if arg[2:].startswith("@") else f"-e{HIDDEN}")
        else:
            shown.append(arg)
    return shlex.join(shown)


@contextlib.contextmanager
def inventory_lock(lock_path: Path, inventory: Path, command: str | None = None) -> Iterator[dict]:
    """Hold the inventory's lock for the block, or raise RunLocked naming the run that holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(inventory, _holder(handle)) from None
        holder = {
            "pid": os.getpid(),
            "started": now(),
            "command": redacted_command(shlex.split(command) if command is not None else sys.argv),
            "inventory": str(inventory),
        }
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder) + "\n")
        handle.flush()
        try:
            yield holder
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)

"""When a test session's sandboxes go: each once the work unit that started it is done, in the background.

A work unit (a module, or the modules sharing one fleet: conftest's _order_and_group) runs whole on one worker, so
its sandboxes are of no use after its last test. Removing a converged host deletes a disk of many files, seconds
each mostly spent waiting on the disk; done at the session's end, every sandbox of the session stacked up there
(about 40 s of a CI run with both cores nearly idle). Here the worker hands them to a thread when its unit ends
and goes on with the next unit; the session's end waits for what is still being removed and removes the rest.
A sandbox is started again under the same name only after its removal ended (`claim`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from p40fleet_dev.sandbox import Sandbox, remove_sandboxes


class Removals:
    def __init__(self, remove: Callable[[Sequence[Sandbox]], None] = remove_sandboxes) -> None:
        self._remove = remove
        self._unit_now = ""
        self._started: dict[str, dict[str, Sandbox]] = {}
        self._removing: dict[str, Future] = {}
        self._remover: ThreadPoolExecutor | None = None

    def unit_starts(self, unit: str) -> None:
        """The unit whose test runs now: the sandboxes started from here on are its own."""
        self._unit_now = unit

    def claim(self, name: str) -> None:
        """Before a sandbox named `name` starts: wait until an earlier one of that name is removed."""
        pending = self._removing.pop(name, None)
        if pending is not None:
            pending.result()

    def keep_until_unit_ends(self, sandbox: Sandbox) -> None:
        """Remove `sandbox` once the current unit is done (or the session ends)."""
        self._started.setdefault(self._unit_now, {})[sandbox.name] = sandbox

    def unit_done(self, unit: str) -> None:
        """The unit's last test is done: remove its sandboxes in the background."""
        sandboxes = list(self._started.pop(unit, {}).values())
        if not sandboxes:
            return
        if self._remover is None:
            self._remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-removal")
        removal = self._remover.submit(self._remove, sandboxes)
        for sandbox in sandboxes:
            self._removing[sandbox.name] = removal

    def finish(self) -> None:
        """The session ends: remove what is left while the removals under way finish, and wait for them (an error
        in one is raised here)."""
        pending = list(dict.fromkeys(self._removing.values()))
        self._removing.clear()
        rest = [sandbox for sandboxes in self._started.values() for sandbox in sandboxes.values()]
        self._started.clear()
        try:
            if rest:
                self._remove(rest)
        finally:
            for removal in pending:
                removal.result()
            if self._remover is not None:
                self._remover.shutdown()
                self._remover = None


# The session's own (conftest's hooks and the fixtures that start sandboxes).
session = Removals()

"""pytest-xdist workers: `make pytest` runs one a core, and podman names are machine-wide, so each worker's sandboxes
carry its id; two workers never start, reuse or remove each other's fleets."""

from __future__ import annotations

import os

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def sandbox_name(name: str) -> str:
    """The sandbox name of a test's fleet: pytest-<worker>-<name> under xdist, pytest-<name> alone."""
    return f"pytest-{WORKER}-{name}" if WORKER else f"pytest-{name}"

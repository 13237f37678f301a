"""Reading a sandbox host's real state in assertions, bypassing Ansible."""

from __future__ import annotations

from p40fleet_dev.sandbox import Sandbox


def sh(fleet: Sandbox, host: str, command: str) -> str:
    """The stripped output of a command that must succeed on the host."""
    result = fleet.exec(host, command)
    assert result.returncode == 0, f"{host}: {command}: {result.stderr}"
    return result.stdout.strip()


def exists(fleet: Sandbox, host: str, path: str) -> bool:
    """Whether the path exists on the host (a dangling symlink counts)."""
    return fleet.exec(host, f"test -e {path} || test -L {path}").returncode == 0

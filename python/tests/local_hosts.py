"""An inventory of the controller itself, for tests that run a real playbook without a sandbox."""

from __future__ import annotations

from pathlib import Path


def local_inventory(tmp_path: Path) -> Path:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        "      ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    return inventory

"""The collection's filters (plugins/filter/) under their short names, for the playbooks beside this directory.

Inside an installed collection a role finds its collection's modules and actions by their short names, but
Ansible looks a filter or lookup up only in configured directories and in those beside the playbook being run.
This file, beside the collection's playbooks, hands Ansible every filter of plugins/filter. The checkout's
ansible.cfg names plugins/filter itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

FILTERS = Path(__file__).resolve().parents[2] / "plugins" / "filter"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"p40fleet_filters_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FilterModule:
    def filters(self):
        found = {}
        for path in sorted(FILTERS.glob("*.py")):
            found.update(load(path).FilterModule().filters())
        return found

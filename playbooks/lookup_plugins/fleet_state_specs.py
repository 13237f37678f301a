"""fleet_state_specs (plugins/lookup/fleet_state_specs.py) under its short name, for the playbooks beside this
directory: in an installed collection Ansible finds a lookup only there or in a configured directory
(playbooks/filter_plugins/p40fleet_filters.py says why)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "plugins" / "lookup" / "fleet_state_specs.py"
_spec = importlib.util.spec_from_file_location("p40fleet_lookup_fleet_state_specs", SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
LookupModule = _module.LookupModule

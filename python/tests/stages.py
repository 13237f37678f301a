"""site.yml's stages after preflight, in pipeline order: the state probe's own list (roles/fleet_state)."""

from __future__ import annotations

import yaml

from p40fleet_dev.paths import REPO_ROOT

STAGES = tuple(
    yaml.safe_load((REPO_ROOT / "roles" / "fleet_state" / "defaults" / "main.yml").read_text())["fleet_state_stages"]
)

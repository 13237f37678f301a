"""The fleet's pins, stage order and shared paths, read from their one home (roles/p40fleet_defaults), so a test
names the value the roles use instead of restating it (test_one_home.py fails where a pin is restated)."""

from __future__ import annotations

import jinja2
import yaml

from p40fleet.paths import ROLES_DIR

DEFAULTS_FILE = ROLES_DIR / "p40fleet_defaults" / "defaults" / "main.yml"
DEFAULTS: dict = yaml.safe_load(DEFAULTS_FILE.read_text(encoding="utf-8"))

# site.yml's stages after preflight, in pipeline order (fleet_state_stages derives from it).
STAGES: tuple[str, ...] = tuple(DEFAULTS["p40fleet_stages"])
STATE_DIR: str = DEFAULTS["p40fleet_state_dir"]
CUDA_HOME: str = DEFAULTS["p40fleet_cuda_home"]
CUDA_RUNFILE_SHA256: str = DEFAULTS["p40fleet_cuda_runfile_sha256"]
APEX_COMMIT: str = DEFAULTS["p40fleet_apex_git_commit"]
VERL_COMMIT: str = DEFAULTS["p40fleet_verl_commit"]


def role_defaults(role: str) -> dict:
    """A role's defaults/main.yml with every value that reads a p40fleet_ fact rendered, as a play would see it
    where the role's other variables are not set (`{{ cudnn_prefix | default(p40fleet_cudnn_prefix) }}` is the
    fleet's cuDNN prefix)."""
    defaults = yaml.safe_load((ROLES_DIR / role / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}
    return {
        name: jinja2.Template(value).render(DEFAULTS) if isinstance(value, str) and "p40fleet_" in value else value
        for name, value in defaults.items()
    }

"""Each role's meta/argument_specs.yml restates its defaults for `ansible-doc -t role`: the two must not drift.

Role argument validation does not apply an argument spec's `default` (defaults/main.yml does), so a spec default
is documentation only, and two had drifted (verl_check_overrides: 2 items against 7; cudnn_cuda_home: a literal
path against the fleet's CUDA home). No containers.
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT

ROLES = sorted(p for p in (REPO_ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").exists())


def spec_defaults(role):
    """(entry point, option, default) for every option whose spec states a default."""
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"] or {}
    for entry, spec in specs.items():
        for name, option in (spec.get("options") or {}).items():
            if "default" in option:
                yield entry, name, option["default"]


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_argument_spec_defaults_equal_the_role_defaults(role):
    path = role / "defaults" / "main.yml"
    defaults = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    drift = []
    for entry, name, default in spec_defaults(role):
        if name in defaults:
            if default != defaults[name]:
                drift.append(f"{entry}/{name}: spec {default!r} != defaults {defaults[name]!r}")
        elif entry == "main":
            # Only another entry point's caller may pass an option that has no role default.
            drift.append(f"{entry}/{name}: the spec states a default that defaults/main.yml does not set")
    assert not drift, f"{role.name}:\n" + "\n".join(drift)


def test_the_check_is_not_vacuous():
    assert sum(1 for role in ROLES for _ in spec_defaults(role)) > 200

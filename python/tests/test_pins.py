"""The fleet's pin file restates the role defaults; the two must never drift apart."""

from __future__ import annotations

import yaml

from p40fleet_dev.paths import REPO_ROOT

PINS = REPO_ROOT / "inventory" / "group_vars" / "p40-hosts" / "pins.yml"


def role_defaults() -> dict[str, object]:
    merged: dict[str, object] = {}
    for path in sorted(REPO_ROOT.glob("roles/*/defaults/main.yml")):
        merged.update(yaml.safe_load(path.read_text()) or {})
    return merged


def test_every_pin_restates_its_role_default():
    pins = yaml.safe_load(PINS.read_text())
    defaults = role_defaults()
    assert pins, "pins.yml pins nothing"
    for name, value in pins.items():
        assert name in defaults, f"{name} is pinned in pins.yml but no role declares it"
        assert value == defaults[name], f"{name}: pins.yml says {value!r}, the role default says {defaults[name]!r}"


def test_every_sha256_pin_is_a_sha256():
    for name, value in yaml.safe_load(PINS.read_text()).items():
        if name.endswith("_sha256"):
            assert isinstance(value, str) and len(value) == 64 and int(value, 16) >= 0, name


def test_no_role_default_leaves_a_pin_empty():
    for path in sorted(REPO_ROOT.glob("roles/*/defaults/main.yml")):
        for name, value in (yaml.safe_load(path.read_text()) or {}).items():
            if "sha256" in name or "checksum" in name:
                assert value not in ("", None), f"{path.relative_to(REPO_ROOT)}: {name} is an empty pin"

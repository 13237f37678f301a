"""Rules every role keeps, read from the roles' own files (no containers)."""

from __future__ import annotations

import re

import yaml

from p40fleet_dev.paths import REPO_ROOT

ROLES = REPO_ROOT / "roles"


def declared_options() -> dict[str, dict]:
    """Every role input declared in meta/argument_specs.yml: name -> its spec."""
    options = {}
    for spec_file in ROLES.glob("*/meta/argument_specs.yml"):
        for entry_point in yaml.safe_load(spec_file.read_text())["argument_specs"].values():
            options.update(entry_point.get("options") or {})
    return options


def role_sources():
    for path in sorted(ROLES.glob("*/**/*")):
        if (
            path.is_file()
            and path.suffix in (".yml", ".j2")
            and "meta" not in path.parts
            and "defaults" not in path.parts
        ):
            yield path


def test_every_boolean_input_is_read_with_the_bool_filter():
    """`-e name=false` gives the string "false", which is truthy: every read of a bool input needs | bool."""
    booleans = [name for name, spec in declared_options().items() if spec.get("type") == "bool"]
    assert "gpu_preflight_strict" in booleans
    unfiltered = []
    for path in role_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for name in booleans:
                # A read, not a mention in a message ("set x: false", "x=true", "x is false").
                if re.search(rf"\b{name}\b(?!\s*\|\s*bool)(?!\s*[:=])(?!\s+(is\s+)?(true|false)\b)", line):
                    unfiltered.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert unfiltered == []


def test_no_cached_fact_shadows_a_role_input():
    """A cacheable set_fact outranks inventory on the next run: it must never carry an input's name."""
    inputs = set(declared_options())
    shadowing = []
    for path in ROLES.glob("*/tasks/*.yml"):
        for task in yaml.safe_load(path.read_text()) or []:
            facts = task.get("ansible.builtin.set_fact") or {}
            if not isinstance(facts, dict) or not facts.get("cacheable"):
                continue
            shadowing += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in facts if name in inputs]
    assert shadowing == []

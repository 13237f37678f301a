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


# Where a stage's files come from (docs/design.md, "Stage inputs"): the option names that say so.
LOCATION = re.compile(r"_(url|urls|base_url|index_url|links|trusted_hosts|endpoint|source|git_source|cache_dir)$")
# Where these choose between pinned downloads and files already at a path (no pin holds those), a switch changes
# what is installed: they stay inputs.
PINNED_OR_NOT = {"verl_source", "training_data_dataset_source", "training_data_model_source"}
# What the files are: these stay inputs, so a new pin re-opens the stage.
IDENTITY = re.compile(r"_(sha256|commit|revision|version|lock_file|git_ref)$")


def stage_inputs() -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (its declared inputs, its ignore_inputs), for the roles that record a stage."""
    stages = {}
    for markers_file in ROLES.glob("*/vars/main.yml"):
        role = markers_file.parts[-3]
        markers = (yaml.safe_load(markers_file.read_text()) or {}).get(f"{role}_state_markers")
        if markers is None:
            continue
        spec = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
        declared = [name for name, option in (spec.get("options") or {}).items() if not (option or {}).get("no_log")]
        stages[role] = (declared, markers.get("ignore_inputs") or [])
    return stages


def test_where_files_come_from_is_no_stage_input_and_what_they_are_is_one():
    stages = stage_inputs()
    assert {"cuda_toolkit", "cudnn", "conda_env", "pytorch", "apex", "verl", "training_data"} <= set(stages)
    kept, dropped = {}, {}
    for role, (declared, ignored) in stages.items():
        assert set(ignored) <= set(declared), (role, sorted(set(ignored) - set(declared)))
        location = [name for name in declared if LOCATION.search(name) and name not in PINNED_OR_NOT]
        assert not set(ignored) & PINNED_OR_NOT, role
        kept[role] = sorted(set(location) - set(ignored))
        dropped[role] = sorted(name for name in ignored if IDENTITY.search(name))
    assert {role: names for role, names in kept.items() if names} == {}
    assert {role: names for role, names in dropped.items() if names} == {}
    # The pins the inputs must keep, named: a pattern that stopped matching them would pass the check above.
    assert "cuda_toolkit_runfile_sha256" in stages["cuda_toolkit"][0]
    assert "cuda_toolkit_runfile_url" in stages["cuda_toolkit"][1]
    assert "verl_expected_commit" in stages["verl"][0] and "verl_expected_commit" not in stages["verl"][1]

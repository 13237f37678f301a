"""One home per fact: every pin, the stage order and the shared paths are written once, in
roles/p40fleet_defaults/defaults/main.yml; roles derive from it, tests read it (tests/pins.py). No containers."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from p40fleet.paths import ROLES_DIR
from p40fleet_dev.paths import REPO_ROOT
from tests.pins import DEFAULTS, DEFAULTS_FILE, STAGES
from tests.source_modules import load_module

HOME = DEFAULTS_FILE.relative_to(REPO_ROOT)
# What the acceptance grep leaves out: tests and docs may name a pin; the rest are not the project's files.
GREP_EXCLUDED_DIRS = (".git", ".cache", ".venv", ".runs", ".sandbox", ".fact_cache", ".gpu", "build", "dist", "docs")
# The values a restatement would copy: sums, commits, URLs and the CUDA home (a version like "11.8" is too short
# to tell a restated pin from any other mention).
PINNED = {
    name: value
    for name, value in DEFAULTS.items()
    if isinstance(value, str)
    and (re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", value) or value.startswith("https://") or name.endswith("_home"))
}
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if (p / "meta" / "main.yml").exists())


def files_holding(value: str) -> list[str]:
    """`grep -rlF` over the repository, outside python/tests, docs, Markdown and what is not the project's."""
    excluded = [f"--exclude-dir={d}" for d in GREP_EXCLUDED_DIRS]
    found = subprocess.run(
        ["grep", "-rlF", *excluded, "--exclude=*.md", "--exclude=*.pyc", "--", value, "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert found.returncode in (0, 1), found.stderr
    return sorted(
        path.removeprefix("./")
        for path in found.stdout.splitlines()
        if not path.startswith("./python/tests/") and ".egg-info/" not in path
    )


def test_the_acceptance_pins_are_among_those_checked():
    assert {"p40fleet_apex_git_commit", "p40fleet_cuda_runfile_sha256", "p40fleet_cuda_home"} <= set(PINNED)
    assert len(PINNED) >= 12, sorted(PINNED)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_pin_is_written_in_one_file(name):
    assert files_holding(PINNED[name]) == [str(HOME)], f"{name} ({PINNED[name]}) is restated"


def test_every_sum_and_commit_pin_is_complete():
    for name, value in DEFAULTS.items():
        if name.endswith("_sha256"):
            assert re.fullmatch(r"[0-9a-f]{64}", value), name
        if name.endswith("_commit"):
            assert re.fullmatch(r"[0-9a-f]{40}", value), name


def test_no_role_default_leaves_a_pin_empty():
    for path in sorted(ROLES_DIR.glob("*/defaults/main.yml")):
        for name, value in (yaml.safe_load(path.read_text()) or {}).items():
            if "sha256" in name or "checksum" in name or name.endswith("_commit"):
                assert value not in ("", None), f"{path.relative_to(REPO_ROOT)}: {name} is an empty pin"


def test_the_defaults_role_declares_exactly_its_variables_and_states_no_default():
    specs = yaml.safe_load((ROLES_DIR / "p40fleet_defaults" / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert sorted(options) == sorted(DEFAULTS)
    assert all(name.startswith("p40fleet_") for name in DEFAULTS)
    # A spec default would be a second copy of the value.
    assert [name for name, option in options.items() if "default" in option] == []


@pytest.mark.parametrize("role", [r for r in ROLES if r != "p40fleet_defaults"])
def test_every_role_depends_on_the_defaults_role(role):
    meta = yaml.safe_load((ROLES_DIR / role / "meta" / "main.yml").read_text())
    names = [d["role"] if isinstance(d, dict) else d for d in meta.get("dependencies") or []]
    assert "p40fleet_defaults" in names, f"{role} does not list p40fleet_defaults: used alone, it lacks the pins"


def test_the_defaults_role_has_no_tasks():
    # A dependency of every role: its tasks would run in every play (once per play, but still).
    assert not (ROLES_DIR / "p40fleet_defaults" / "tasks").exists()


def test_site_lists_the_stages_in_their_order():
    *_, play = yaml.safe_load((REPO_ROOT / "site.yml").read_text())
    roles = [entry["role"] for entry in play["roles"]]
    assert roles[:2] == ["gpu_preflight", "fleet_state"]
    assert tuple(roles[2:]) == STAGES


def test_the_state_probe_reads_the_one_stage_list():
    defaults = yaml.safe_load((ROLES_DIR / "fleet_state" / "defaults" / "main.yml").read_text())
    assert defaults["fleet_state_stages"] == "{{ p40fleet_stages }}"


def role_variables(role) -> dict:
    """A role's defaults and vars as written (templates untouched)."""
    paths = [
        role / "defaults" / "main.yml",
        role / "vars" / "main.yml",
        *sorted((role / "vars" / "main").glob("*.yml")),
    ]
    merged: dict = {}
    for path in paths:
        if path.exists():
            merged.update(yaml.safe_load(path.read_text()) or {})
    return merged


@pytest.mark.parametrize("stage", STAGES)
def test_a_changed_pin_is_a_changed_input_of_every_stage_built_from_it(stage):
    """fleet_state hashes each stage's declared variables, templated: every p40fleet_* fact the stage's defaults
    or vars read must be reached from its declared inputs or markers, so overriding it re-opens the stage."""
    specs_lookup = load_module(ROLES_DIR.parent / "plugins" / "lookup" / "fleet_state_specs.py", "specs_lookup")
    role = ROLES_DIR / stage
    variables = {**DEFAULTS}
    for other in ROLES_DIR.iterdir():
        if (other / "meta" / "main.yml").exists():
            variables.update(role_variables(other))
    own = role_variables(role)
    read = {name for text in specs_lookup.strings(own) for name in re.findall(r"\bp40fleet_\w+", text)} & set(DEFAULTS)
    # The state dir holds every stage's record (fleet_state_dir): moving it re-opens every stage anyway.
    read.discard("p40fleet_state_dir")
    reached = specs_lookup.referenced(variables, [f"{stage}_state_markers", *specs_lookup.declared_inputs(str(role))])
    assert reached is not None
    assert read - set(reached) == set(), f"{stage} reads {sorted(read - set(reached))} outside its inputs"

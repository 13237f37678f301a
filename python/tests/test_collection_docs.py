"""ansible-doc renders every module, filter, lookup and role of the collection p40fleet.fleet by its full name, as an
operator reads them (no containers; one ansible-doc call a plugin type, over the checkout's own collections path).

A plugin without documentation, or with documentation ansible-doc cannot parse (a module's DOCUMENTATION without a
description, a filter without its sidecar plugins/filter/<name>.yml), is missing from ansible-doc's answer or fails
the call: each is named."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

DOC = str(Path(sys.executable).parent / "ansible-doc")
PREFIX = "p40fleet.fleet."


def names(kind: str) -> list[str]:
    """Every plugin of a type the collection holds, by its short name."""
    if kind == "module":
        return sorted(p.stem for p in (REPO_ROOT / "plugins" / "modules").glob("*.py"))
    if kind == "lookup":
        return sorted(p.stem for p in (REPO_ROOT / "plugins" / "lookup").glob("*.py"))
    if kind == "role":
        return sorted(p.name for p in (REPO_ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
    found: list[str] = []
    for path in sorted((REPO_ROOT / "plugins" / "filter").glob("*.py")):
        found += load_module(path, f"doc_filter_{path.stem}").FilterModule().filters()
    return sorted(found)


def test_every_role_has_an_argument_spec():
    roles = sorted(p.name for p in (REPO_ROOT / "roles").iterdir() if p.is_dir())
    assert names("role") == roles


def test_every_action_has_a_module_documentation():
    """An action without a module of its name (artifact_fetch_cache) is documented by a doc-only module file."""
    actions = {p.stem for p in (REPO_ROOT / "plugins" / "action").glob("*.py")}
    assert actions <= set(names("module"))


@pytest.mark.parametrize("kind", ["module", "filter", "lookup", "role"])
def test_ansible_doc_renders_every_plugin_by_its_full_name(kind, tmp_path):
    wanted = names(kind)
    assert wanted, kind
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    (tmp_path / "ansible.cfg").write_text("")  # none of the checkout's settings
    env.update(ANSIBLE_COLLECTIONS_PATH=str(REPO_ROOT / "collections"), ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"))
    argv = [DOC, "-t", kind, "--json", *(PREFIX + name for name in wanted)]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO_ROOT, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[ERROR]" not in result.stderr and "[WARNING]" not in result.stderr, result.stderr[-4000:]
    rendered = json.loads(result.stdout)
    assert sorted(rendered) == sorted(PREFIX + name for name in wanted), result.stderr[-4000:]
    for name, entry in rendered.items():
        if kind == "role":
            main = entry["entry_points"]["main"]
            assert main.get("short_description") and main.get("description"), name
        else:
            doc = entry["doc"]
            assert doc.get("short_description") and doc.get("description"), name
            if kind == "module":
                assert entry.get("examples") and entry.get("return"), f"{name}: EXAMPLES and RETURN"


# Root's code on a host is an AnsibleModule built with the module's ARGUMENT_SPEC (docs/extending-modules.md).
# The named exceptions have an action of their name that checks the task's options with Ansible's validator against
# its ARGUMENT_SPEC on the controller: the two probes every run executes on every host (plain JSON-arguments
# scripts: the module library would cost each host several times their CPU, docs/benchmarks-code.md) and the
# controller-only artifact_fetch_cache, whose module file is documentation only.
VALIDATED_BY_ACTION = {"artifact_fetch_cache", "fleet_state_probe", "gpu_preflight_probe"}
SPEC_FIELDS = {"type": "str", "required": False, "default": None, "choices": None, "elements": None}


def calls_with_the_spec(path: Path, callee: str) -> list[str]:
    """The names of the calls in a file that pass `argument_spec=ARGUMENT_SPEC`, among those named callee or
    (AnsibleModule) a class of the file built on it."""
    tree = ast.parse(path.read_text())
    names = {callee} | {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(getattr(base, "id", "") == callee for base in node.bases)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        spec = [k.value for k in node.keywords if k.arg == "argument_spec"]
        if name in names and spec and getattr(spec[0], "id", "") == "ARGUMENT_SPEC":
            found.append(name)
    return found


@pytest.mark.parametrize("name", names("module"))
def test_every_module_checks_its_documented_options_with_one_argument_spec(name):
    module_path = REPO_ROOT / "plugins" / "modules" / f"{name}.py"
    if name in VALIDATED_BY_ACTION:
        spec_path = REPO_ROOT / "plugins" / "action" / f"{name}.py"
        assert calls_with_the_spec(spec_path, "validate_argument_spec"), f"{spec_path} validates no ARGUMENT_SPEC"
    else:
        spec_path = module_path
        assert calls_with_the_spec(spec_path, "AnsibleModule"), (
            f"{name} builds no AnsibleModule(argument_spec=ARGUMENT_SPEC): make it one, or name it an exception "
            "(VALIDATED_BY_ACTION and docs/extending-modules.md) with its reason"
        )
    spec = load_module(spec_path, f"spec_{name}_{spec_path.parent.name}").ARGUMENT_SPEC
    documented = yaml.safe_load(load_module(module_path, f"doc_{name}").DOCUMENTATION)["options"]
    assert sorted(spec) == sorted(documented), f"{name}: ARGUMENT_SPEC's keys against DOCUMENTATION's options"
    for option, entry in documented.items():
        said = {field: entry.get(field, default) for field, default in SPEC_FIELDS.items()}
        built = {field: spec[option].get(field, default) for field, default in SPEC_FIELDS.items()}
        assert built == said, f"{name}: option {option}"

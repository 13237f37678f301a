"""ansible-doc renders every module, filter, lookup and role of the collection p40fleet.fleet by its full name, as an
operator reads them (no containers; one ansible-doc call a plugin type, over the checkout's own collections path).

A plugin without documentation, or with documentation ansible-doc cannot parse (a module's DOCUMENTATION without a
description, a filter without its sidecar plugins/filter/<name>.yml), is missing from ansible-doc's answer or fails
the call: each is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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

"""Owner-side host code: scripts in owner_scripts/, handed to `-c` by one loader, the owner_script lookup
(plugins/lookup/owner_script.py); docs/extending-modules.md. Read from the files, no containers."""

from __future__ import annotations

import ast
import re

import pytest
from ansible.errors import AnsibleError

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import OWNER_SCRIPTS, load_module, owner_script_text

loader = load_module(REPO_ROOT / "plugins" / "lookup" / "owner_script.py", "owner_script_lookup")
HELPERS = REPO_ROOT / "plugins" / "module_utils" / "owner_script.py"
SOURCES = sorted([*(REPO_ROOT / "roles").glob("*/**/*.yml"), *(REPO_ROOT / "playbooks").glob("*.yml")])
FILE_LOOKUP = re.compile(r"lookup\('ansible\.builtin\.file',\s*'([^']+)'([^)]*)\)")
LOADER_LOOKUP = re.compile(r"lookup\('p40fleet\.fleet\.owner_script',\s*'([^']+)'\)")

# Scripts a role still reads from its own files/ and runs with -c: root's, so not owner scripts. They are to become
# modules (plugins/modules/); this list only shrinks.
ROOT_SIDE = {
    "sampler.py": "gpu_qualify: root's Python samples nvidia-smi while the owner's load runs",
    "training_data_hub.py": "training_data: root's Python, as the throwaway account (downloads) and as root (check)",
}
# Files a role installs on the host (a copy's content), not run inline.
DEPLOYED = {"launch_script_compose.py", "launch_script_smoke.py"}


def yaml_text() -> dict[str, str]:
    return {str(path.relative_to(REPO_ROOT)): path.read_text() for path in SOURCES}


def test_every_inline_script_in_the_roles_comes_through_the_loader():
    """No role hands -c a script read with ansible.builtin.file (nor reads another role's files through role_path)
    but root's, listed in ROOT_SIDE; the launch script's helpers are installed files."""
    found: dict[str, set[str]] = {}
    for rel, text in yaml_text().items():
        assert "role_path ~ '/.." not in text, f"{rel} reads a file outside its role: use the owner_script lookup"
        for name, options in FILE_LOOKUP.findall(text):
            if name.endswith((".py", ".sh")):
                found.setdefault(name, set()).add(rel)
                if name in DEPLOYED:
                    assert "rstrip=false" in options, (rel, name)
    assert sorted(found) == sorted([*ROOT_SIDE, *DEPLOYED]), found
    for name in DEPLOYED:
        assert all(re.search(rf"content: .*'{name}'", yaml_text()[rel]) for rel in found[name]), name


def test_every_owner_script_is_loaded_by_name_and_every_name_is_a_script():
    names = {name for text in yaml_text().values() for name in LOADER_LOOKUP.findall(text)}
    assert names == {path.name for path in OWNER_SCRIPTS.iterdir()}


def test_a_script_that_uses_the_shared_helpers_asks_for_them_and_gets_them_first():
    """A script calling plugins/module_utils/owner_script.py's helpers without defining them carries the marker,
    and only such a script: the loader's text is then the helpers', two blank lines, the script's (the text the roles
    joined by hand before the loader, byte for byte)."""
    helpers = {node.name for node in ast.parse(HELPERS.read_text()).body if isinstance(node, ast.FunctionDef)}
    users = []
    for script in sorted(OWNER_SCRIPTS.glob("*.py")):
        source = script.read_text()
        tree = ast.parse(source)
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        needs = bool((used & helpers) - defined)
        assert loader.wants_helpers(source) == needs, script.name
        text = loader.owner_script_text(script.name)
        expected = HELPERS.read_text().rstrip() + "\n\n\n" + source.rstrip() if needs else source.rstrip()
        assert text == expected and owner_script_text(script) == text
        compile(text, script.name, "exec")
        if needs:
            users.append(script.name)
    assert users == ["training_data_tool.py", "verl_patches_tool.py"]


def test_the_lookup_returns_one_text_per_name():
    texts = loader.LookupModule().run(["pytorch_probe.py", "fleet_state_git_checkout.sh"])
    assert texts == [
        (OWNER_SCRIPTS / n).read_text().rstrip() for n in ("pytorch_probe.py", "fleet_state_git_checkout.sh")
    ]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../plugins/module_utils/owner_script.py", "no directory"),
        ("sub/verl_probe.py", "no directory"),
        ("", "no directory"),
        ("nope.py", "no script 'nope.py'"),
    ],
)
def test_a_name_outside_owner_scripts_is_refused(name, message):
    with pytest.raises(AnsibleError, match=re.escape(message)):
        loader.owner_script_text(name)


def test_the_lookup_takes_no_options():
    with pytest.raises(AnsibleError, match="takes no options"):
        loader.LookupModule().run(["verl_probe.py"], helpers=True)

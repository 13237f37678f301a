"""Import a Python file that is not part of a package (a role's module, plugin or tool, a stand-in builder) by
its path, so tests call its functions directly."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from p40fleet_dev.paths import REPO_ROOT

# The collection's plugins import their shared code by its full name (ansible_collections.p40fleet.fleet.plugins.
# plugin_utils...): the checkout's collections path (collections/ansible_collections/p40fleet/fleet -> the checkout)
# makes those names this checkout's files here, as Ansible's collection loader does in a run.
COLLECTIONS_PATH = str(REPO_ROOT / "collections")
if COLLECTIONS_PATH not in sys.path:
    sys.path.append(COLLECTIONS_PATH)

# The scripts the env owner runs, each handed over by the owner_script lookup as one `-c` text.
OWNER_SCRIPTS = REPO_ROOT / "owner_scripts"


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def owner_script_text(path: Path) -> str:
    """An owner-run script (owner_scripts/NAME) as its role hands it to `python -I -c`: the owner_script lookup's
    text, the shared helpers' first where the script asks for them."""
    from ansible_collections.p40fleet.fleet.plugins.lookup import owner_script

    assert path.parent == OWNER_SCRIPTS, f"{path} is not in {OWNER_SCRIPTS}"
    return owner_script.owner_script_text(path.name)


def load_owner_script(path: Path, name: str) -> ModuleType:
    """An owner-run script as a module, from the text its role runs."""
    module = ModuleType(name)
    module.__file__ = str(path)
    exec(compile(owner_script_text(path), str(path), "exec"), module.__dict__)
    return module


def run_module_main(module: ModuleType, args: dict, check_mode: bool = False, diff: bool = False) -> dict:
    """A module's main() in this process, its arguments handed as Ansible hands them to AnsibleModule: the result
    it prints, with `rc` its exit status."""
    from ansible.module_utils.testing import patch_module_args

    stdout = io.StringIO()
    arguments = {**args, "_ansible_check_mode": check_mode, "_ansible_diff": diff}
    with patch_module_args(arguments), contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as exited:
        module.main()
    return {**json.loads(stdout.getvalue()), "rc": exited.value.code}

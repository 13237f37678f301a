"""owner_script: the text of a script the env owner runs, from the collection's owner_scripts/, for `-c`.

Host code has two homes (docs/extending-modules.md). What root runs is a module in plugins/modules/. What runs as
the env owner, or in the env's Python, is a script in owner_scripts/, handed over as the text of one `-c`
argument by this lookup: no file on the host to share with the account that runs it, and no import from a path
it can write.

    argv: ["{{ p40fleet_conda_python }}", -I, -c, "{{ lookup('p40fleet.fleet.owner_script', 'verl_probe.py') }}"]

A script whose text has a line starting with HELPERS_MARKER gets the shared helpers'
(plugins/module_utils/owner_script.py) text before its own, joined by two blank lines. The text is each file's
with its trailing whitespace removed, as ansible.builtin.file returns it. The tests build the same text with
owner_script_text() (python/tests/source_modules.py).
"""

from __future__ import annotations

import os

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: owner_script
short_description: The text of an owner-run script, for an interpreter's -c argument.
description:
  - Returns the text of a script in the collection's C(owner_scripts/) directory, by file name.
  - A script that has a line starting with C(# owner_script helpers:) gets the text of
    C(plugins/module_utils/owner_script.py) (the helpers the owner-run scripts share) before its own.
  - The env owner's code runs from this text, never from a file on the host that the owner could write.
author: p40fleet
options:
  _terms:
    description: Script file names in C(owner_scripts/), without a directory.
    required: true
"""

EXAMPLES = r"""
- name: Probe the env's torch as the env owner
  p40fleet.fleet.fleet_state_owner_run:
    owner: "{{ p40fleet_env_owner }}"
    argv: ["{{ p40fleet_conda_python }}", -I, -c, "{{ lookup('p40fleet.fleet.owner_script', 'pytorch_probe.py') }}"]
"""

RETURN = r"""
_raw:
  description: One text per name, the shared helpers' first where the script asks for them.
  type: list
  elements: str
"""

COLLECTION_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS_DIR = os.path.join(COLLECTION_ROOT, "owner_scripts")
HELPERS = os.path.join(COLLECTION_ROOT, "plugins", "module_utils", "owner_script.py")
HELPERS_MARKER = "# owner_script helpers:"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read().rstrip()


def wants_helpers(text: str) -> bool:
    return any(line.startswith(HELPERS_MARKER) for line in text.splitlines())


def owner_script_text(name: str) -> str:
    """The text a role hands to `-c` for owner_scripts/<name>."""
    if not name or name != os.path.basename(name) or name.startswith("."):
        raise AnsibleError(f"owner_script: {name!r} is not a file name in owner_scripts/ (no directory)")
    path = os.path.join(SCRIPTS_DIR, name)
    if not os.path.isfile(path):
        known = ", ".join(sorted(os.listdir(SCRIPTS_DIR))) if os.path.isdir(SCRIPTS_DIR) else "none"
        raise AnsibleError(f"owner_script: no script {name!r} in {SCRIPTS_DIR} (there: {known})")
    text = _read(path)
    return _read(HELPERS) + "\n\n\n" + text if wants_helpers(text) else text


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        if kwargs:
            raise AnsibleError(f"owner_script: takes no options (given: {', '.join(sorted(kwargs))})")
        return [owner_script_text(str(term)) for term in terms]

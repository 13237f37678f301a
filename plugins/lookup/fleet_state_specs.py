"""fleet_state_specs: what the state probe needs to know of each stage in the play, computed on the controller.

For each stage whose role is in the play (its `<stage>_state_markers` variable is defined): the markers the
role declares (files it owns, leftovers of an unfinished attempt, what its check mode needs), plus its inputs:
the value of every variable its meta/argument_specs.yml declares (no_log ones, and those the markers list
under ignore_inputs, left out) and digests of the role's own files and of the collection's plugins/ and
owner_scripts/, so an inventory change or a new p40fleet release re-opens the stage.

    lookup('p40fleet.fleet.fleet_state_specs', 'cuda_toolkit', 'cudnn', roles_dir='/path/to/roles')

Each stage is templated against only the variables its markers and inputs reference, directly or through
other variables (the names in their {{ }} and {% %} blocks): in ansible-core 2.19 every nested render copies
every variable in scope into a new context, and against the play's ~500 variables that was most of this
lookup's time, on every host of every run. A stage whose templates can reach variables by a name computed at
run time (vars, hostvars, the vars and varnames lookups, a template file, an include) is templated against
all of them, and so is one whose subset fails to template. `every_variable=true` templates every stage
against all of them: what the tests compare the subset's result with.
"""

from __future__ import annotations

import hashlib
import os
import re

import yaml
from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: fleet_state_specs
short_description: Each stage's markers and inputs, for the fleet_state probe.
description:
  - For each stage (role) in the play, the markers the role declares and the values of its declared inputs, with
    digests of the role's files and of the collection's plugins and owner scripts, so that a change re-opens the stage.
author: p40fleet
options:
  _terms:
    description: Stage (role) names.
    required: true
  roles_dir:
    description: The directory holding the roles.
    type: str
    required: true
  every_variable:
    description: Template every stage against all the play's variables, not the subset it references.
    type: bool
    default: false
"""

JINJA_BLOCK = re.compile(r"{{.*?}}|{%.*?%}", re.DOTALL)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names through which a template reaches variables it does not name.
DYNAMIC = frozenset({"vars", "hostvars", "varnames", "template", "include", "import", "extends", "from"})


def role_code_sha256(role_dir: str) -> str:
    """A digest of every file of a role (bytecode caches left out), by relative path and content."""
    digest = hashlib.sha256()
    for top, dirs, files in os.walk(role_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".pyc"):
                continue
            path = os.path.join(top, name)
            digest.update(os.path.relpath(path, role_dir).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()


# libyaml where PyYAML has it: the pure-Python loader took a fifth of this lookup's time, on every host.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def declared_inputs(role_dir: str) -> list[str]:
    """The role's declared variables, secrets (no_log) left out."""
    with open(os.path.join(role_dir, "meta", "argument_specs.yml"), encoding="utf-8") as handle:
        specs = yaml.load(handle, Loader=SafeLoader)["argument_specs"]
    options = (specs.get("main") or {}).get("options") or {}
    return sorted(name for name, option in options.items() if not (option or {}).get("no_log"))


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)


def referenced(variables, names) -> dict | None:
    """The variables `names` reference, transitively, by the names in their Jinja blocks; None where a
    template can reach a variable it does not name."""
    pending = [name for name in names if name in variables]
    found = set()
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        for text in strings(variables[name]):
            for block in JINJA_BLOCK.findall(text):
                words = set(NAME.findall(block))
                if words & DYNAMIC:
                    return None
                pending.extend(word for word in words if word in variables and word not in found)
    return {name: variables[name] for name in found}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        # The options are read as given, not through set_options: the tests call run() directly, without a loader.
        roles_dir = kwargs.get("roles_dir")
        if not roles_dir:
            raise AnsibleError("fleet_state_specs: roles_dir='<the directory holding the roles>' is required")
        every_variable = bool(kwargs.get("every_variable", False))
        variables = variables or {}
        specs = {}
        # The collection's plugins (beside roles/) are every stage's code too: fleet_state_path writes for all.
        plugins_dir = os.path.join(os.path.dirname(os.path.abspath(roles_dir)), "plugins")
        plugins_code = role_code_sha256(plugins_dir) if os.path.isdir(plugins_dir) else ""
        # So are the owner-run scripts (owner_scripts/, beside roles/), which the roles hand to -c by name.
        scripts_dir = os.path.join(os.path.dirname(os.path.abspath(roles_dir)), "owner_scripts")
        scripts_code = role_code_sha256(scripts_dir) if os.path.isdir(scripts_dir) else ""
        for stage in terms:
            markers = f"{stage}_state_markers"
            if markers not in variables:
                continue
            role_dir = os.path.join(roles_dir, stage)
            if not os.path.isdir(role_dir):
                raise AnsibleError(f"fleet_state_specs: {stage} declares {markers} but {role_dir} is not a role")
            declared = [name for name in declared_inputs(role_dir) if name in variables]
            subset = None if every_variable else referenced(variables, [markers, *declared])
            try:
                spec = self._stage_spec(subset, markers, declared) if subset is not None else None
            except AnsibleError:
                spec = None  # a name the scan missed: the full set gives the same result, or the real error
            if spec is None:
                spec = self._stage_spec(variables, markers, declared)
            spec["inputs"]["role_code_sha256"] = role_code_sha256(role_dir)
            spec["inputs"]["plugins_code_sha256"] = plugins_code
            spec["inputs"]["owner_scripts_code_sha256"] = scripts_code
            specs[stage] = spec
        return [specs]

    def _stage_spec(self, variables, markers, declared):
        templar = self._templar.copy_with_new_env(available_variables=variables)
        templated_markers = templar.template(variables[markers])
        ignored = set(templated_markers.pop("ignore_inputs", None) or [])
        names = [name for name in declared if name not in ignored]
        return {**templated_markers, "inputs": dict(templar.template({name: variables[name] for name in names}))}

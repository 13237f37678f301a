"""fleet_state_specs: what the state probe needs to know of each stage in the play, computed on the controller.

For each stage whose role is in the play (its `<stage>_state_markers` variable is defined): the markers the
role declares (files it owns, leftovers of an unfinished attempt, what its check mode needs), plus its inputs:
the value of every variable its meta/argument_specs.yml declares (no_log ones, and those the markers list
under ignore_inputs, left out) and a digest of the
role's own files, so an inventory change or a new p40fleet release re-opens the stage.

    lookup('fleet_state_specs', 'cuda_toolkit', 'cudnn', roles_dir='/path/to/roles')
"""

from __future__ import annotations

import hashlib
import os

import yaml
from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: fleet_state_specs
short_description: Each stage's markers and inputs, for the fleet_state probe.
options:
  _terms:
    description: Stage (role) names.
    required: true
  roles_dir:
    description: The directory holding the roles.
    type: str
    required: true
"""


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


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        roles_dir = self.get_option("roles_dir")
        variables = variables or {}
        specs = {}
        for stage in terms:
            markers = f"{stage}_state_markers"
            if markers not in variables:
                continue
            role_dir = os.path.join(roles_dir, stage)
            if not os.path.isdir(role_dir):
                raise AnsibleError(f"fleet_state_specs: {stage} declares {markers} but {role_dir} is not a role")
            templated_markers = self._templar.template(variables[markers])
            ignored = set(templated_markers.pop("ignore_inputs", None) or [])
            names = [name for name in declared_inputs(role_dir) if name in variables and name not in ignored]
            inputs = dict(self._templar.template({name: variables[name] for name in names}))
            inputs["role_code_sha256"] = role_code_sha256(role_dir)
            specs[stage] = {**templated_markers, "inputs": inputs}
        return [specs]

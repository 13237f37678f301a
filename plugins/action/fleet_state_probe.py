"""fleet_state_probe's options, checked on the controller; then the host's probe runs as any module does.

The probe (plugins/modules/fleet_state_probe.py) runs on every host on every run, so it stays a plain JSON-arguments
script: a module built on Ansible's module library costs the host several times its CPU (docs/benchmarks-code.md).
This action gives it the collection's one argument-spec style anyway (docs/extending.md): Ansible's validator
checks the task's options against ARGUMENT_SPEC here, where it costs the host nothing.
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible.utils.vars import merge_hash

# The module's DOCUMENTATION options. Validated, not handed on as coerced: a path option expanded here would name
# the controller's home, not the host's; the script expands its paths on the host.
ARGUMENT_SPEC = {
    "mode": {"type": "str", "choices": ["probe", "record", "verified"], "default": "probe"},
    "state_dir": {"type": "path", "required": True},
    "stages": {"type": "dict", "default": {}},
    "stage": {"type": "str"},
    "preflight_state_file": {"type": "path"},
    "preflight_state": {"type": "dict"},
    "host": {"type": "str", "default": "this host"},
    "run_tags": {"type": "list", "elements": "str", "default": ["all"]},
    "skip_tags": {"type": "list", "elements": "str", "default": []},
    "packages": {"type": "list", "elements": "str", "default": []},
}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        result = merge_hash(result, self._execute_module(task_vars=task_vars))
        self._remove_tmp_path(self._connection._shell.tmpdir)
        return result

"""gpu_preflight's one task: probe the host, judge the report, refuse it or publish its facts.

The module of the same name (plugins/modules/gpu_preflight_probe.py) runs on the host and only reads. This action,
on the controller, hands it its options, then judges its report with the role's rules
(plugins/plugin_utils/gpu_preflight.py, the same function the filter exposes) against `settings`:
- a refused host fails this task with one message naming every finding, before anything touched it;
- a host that passes gets the facts later stages read (gpu_preflight_profile, gpu_preflight_state_content,
  ...) as host facts, which also reach the fact cache and the run's events (p40fleet's report reads them).
The result keeps the probe's `report` and adds the `verdict` (errors, warnings, facts).

One task where there were five (probe, read, judge, refuse, publish): a converged run executes it and the
argument check, nothing else of preflight.

`report` (a probe's report taken before, such as a real host's recorded answers) is judged instead of
probing: the table tests of the rules go through this same code without a host. The role never passes it.

The task's options are checked here against ARGUMENT_SPEC (Ansible's argument-spec validator, the one style of the
collection's modules: docs/extending.md), on the controller: the host's probe stays a plain JSON-arguments script,
which costs the host a fraction of a module built on Ansible's module library on every run.
"""

from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.p40fleet.fleet.plugins.plugin_utils.gpu_preflight import gpu_preflight_assess

# The module's DOCUMENTATION options. Validated, not handed on as coerced: the probe reads its paths on the host.
ARGUMENT_SPEC = {
    "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
    "paths": {"type": "list", "elements": "str", "default": []},
    "present_paths": {"type": "list", "elements": "str", "default": []},
    "state_file": {"type": "str"},
    "settings": {"type": "dict", "required": True},
    "report": {"type": "dict"},
}
SETTINGS = (
    "host",
    "strict",
    "gpu_select",
    "no_gpu_compute_cap",
    "compute_cap_by_name",
    "ecc_inband",
    "profiles",
    "driver_min_version",
    "driver_min_reason",
    "open_module_min_compute_cap",
    "supported_os",
    "min_cpus",
    "min_ram_gib",
    "disk_checks",
    "state_file",
)


def refusal(host: str, errors: list[str]) -> str:
    return f"gpu_preflight refused {host} (nothing was changed on it):\n- " + "\n- ".join(errors)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        args = dict(self._task.args)
        settings = args.pop("settings", None)
        report = args.pop("report", None)
        if not isinstance(settings, dict) or sorted(settings) != sorted(SETTINGS):
            missing = sorted(set(SETTINGS) - set(settings or {}))
            extra = sorted(set(settings or {}) - set(SETTINGS))
            raise AnsibleActionFail(
                f"gpu_preflight_probe: settings must hold {', '.join(SETTINGS)}; missing {missing}, unknown {extra}"
            )
        if report is None:
            probed = self._execute_module(
                module_name="p40fleet.fleet.gpu_preflight_probe", module_args=args, task_vars=task_vars
            )
            if probed.get("failed"):
                return {**result, **probed}
            report = probed["report"]
        verdict = gpu_preflight_assess(report, settings)
        result.update(changed=False, report=report, verdict=verdict)
        if verdict["errors"]:
            result.update(failed=True, msg=refusal(settings["host"], verdict["errors"]))
            return result
        result["ansible_facts"] = verdict["facts"]
        return result

"""gpu_preflight's rules as filters: `found | p40fleet.fleet.gpu_preflight_assess(settings)`, and
`saved_b64 | p40fleet.fleet.gpu_preflight_saved_facts` for a play that reads the saved state (playbooks/state.yml).

The rules live in plugins/plugin_utils/gpu_preflight.py, which the role's action (plugins/action/
gpu_preflight_probe.py) runs in the task that probes the host.
"""

from ansible_collections.p40fleet.fleet.plugins.plugin_utils.gpu_preflight import (
    gpu_preflight_assess,
    gpu_preflight_saved_facts,
)


class FilterModule:
    def filters(self):
        return {"gpu_preflight_assess": gpu_preflight_assess, "gpu_preflight_saved_facts": gpu_preflight_saved_facts}

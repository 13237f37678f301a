"""`p40fleet report --refresh` and `p40fleet run` agree: right after a run finds a host converged, the refresh
(playbooks/state.yml, which probes without preflight) finds no stage drifted; an input changed in the inventory
drifts exactly the stage that reads it.

The refresh used to template the stages' inputs without the facts preflight publishes (the GPU profile), so
driver_hold_enabled, pytorch_gpu_check, verl_patches_profile and launch_script_profile read as changed on every
converged host. The host is a copy of conftest's site_image (site_fleet's node1 as its two runs left it).
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet import api
from p40fleet import fleet as fleet_module

# converge: run alone, the image takes a fresh host through the pipeline (minutes). In site_fleet's unit: its
# node1 is the image.
pytestmark = [pytest.mark.sandbox, pytest.mark.converge, pytest.mark.xdist_group("site-fleet")]


def drift(refreshed) -> dict[str, list[str]]:
    """stage -> why it is not converged, for the stages that are not."""
    (probe,) = fleet_module.probe_results(refreshed.run.events).values()
    return {name: stage["drift"] for name, stage in probe["stages"].items() if stage["drift"]}


@pytest.fixture(scope="module")
def fleet(make_sandbox, site_image):
    return make_sandbox("refresh", ["p40"], login="root", image=site_image)


def test_a_refresh_after_a_converged_run_finds_no_drift_and_then_exactly_the_changed_input(fleet, tmp_path):
    run = api.provision(fleet.inventory_dir, state_dir=tmp_path)
    assert run.exit_code == 0, run
    assert run.hosts["node1"].stats.changed == 0, run.hosts["node1"]

    refreshed = api.refresh_state(fleet.inventory_dir, state_dir=tmp_path)
    assert refreshed.exit_code == 0 and refreshed.missing == [], refreshed
    assert drift(refreshed) == {}

    # One input of one stage, as an operator changes it: the inventory.
    (fleet.inventory_dir / "host_vars").mkdir(exist_ok=True)
    (fleet.inventory_dir / "host_vars" / "node1.yml").write_text(
        "---\n" + yaml.safe_dump({"launch_script_total_epochs": 7})
    )
    changed = api.refresh_state(fleet.inventory_dir, state_dir=tmp_path)
    assert changed.exit_code == 0, changed
    assert drift(changed) == {"launch_script": ["inputs changed since the last converge: launch_script_total_epochs"]}

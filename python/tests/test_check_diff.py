"""`site.yml --check --diff` on a converged host whose launch settings changed: the dry run shows the launch
script's diff (fleet_state_path's diff mode), never a secret of the run's environment, and changes nothing.

The host is a copy of conftest's site_image (site_fleet's node1 as its two runs left it, or the same variant built
from a fresh host when this module runs alone).
"""

from __future__ import annotations

import json
import re

import pytest

# converge: run alone, the image takes a fresh host through the pipeline (minutes). In site_fleet's unit: its
# node1 is the image.
pytestmark = [pytest.mark.sandbox, pytest.mark.converge, pytest.mark.xdist_group("site-fleet")]

CANARY = "hf_diff_canary_4b1d"
CHANGED = {"launch_script_total_epochs": 7, "launch_script_environment": {"HF_TOKEN": CANARY}}


@pytest.fixture(scope="module")
def dry_run(make_sandbox, run_playbook, site_image):
    fleet = make_sandbox("diff", ["p40"], login="root", image=site_image)
    result = run_playbook("site.yml", fleet.inventory_dir, check=True, diff=True, extra_vars=CHANGED)
    return fleet, result


def script_diffs(result) -> list[dict]:
    """The launch script's diffs in the run's results (a task's diff is one dict, a batch's a list)."""
    found = []
    for event in result.events:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_ok" and data.get("role") == "launch_script":
            diff = data["res"].get("diff") or []
            for each in diff if isinstance(diff, list) else [diff]:
                if str(each.get("after_header", "")).endswith("train_gsm8k_ppo.sh"):
                    found.append(each)
    return found


def test_the_dry_run_shows_the_launch_scripts_diff(dry_run):
    _, result = dry_run
    assert result.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in result.failures]
    (diff,) = script_diffs(result)
    assert "trainer.total_epochs=15" in diff["before"]
    assert "trainer.total_epochs=7" in diff["after"]
    # What the operator reads: the run's output, its colours taken off.
    shown = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    assert f"--- before: {diff['before_header']}" in shown
    assert re.search(r"^-\s*trainer\.total_epochs=15", shown, re.MULTILINE), shown[-3000:]
    assert re.search(r"^\+\s*trainer\.total_epochs=7", shown, re.MULTILINE)


def test_the_dry_run_shows_no_secret_and_changes_nothing(dry_run):
    fleet, result = dry_run
    assert CANARY not in result.stdout
    assert CANARY not in json.dumps(result.events)
    (diff,) = script_diffs(result)
    script = diff["after_header"]
    on_host = fleet.exec("node1", f"cat {script}")
    assert on_host.returncode == 0, on_host.stderr
    assert "trainer.total_epochs=15" in on_host.stdout
    env_files = fleet.exec("node1", f"grep -rl {CANARY} /home /opt /var/lib/p40fleet 2>/dev/null")
    assert env_files.stdout == ""

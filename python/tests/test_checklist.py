"""playbooks/verify.yml (the fleet checklist) on hosts the pipeline really converged: conftest's site_fleet, one
P40 and one 2x P40 host logging in as root, node2's /usr/local/cuda already pointing at /usr/local/cuda-11.8
before the first run (a valid host the cuda_toolkit role leaves as it found it). The checklist must pass on
both, take a profile that needs no patches (an A100's) as needing no record, and still catch a broken stage.
"""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from tests.host_state import sh
from tests.pins import CUDA_HOME, role_defaults

# converge: site_fleet takes fresh hosts through the pipeline (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

CHECKLIST = "playbooks/verify.yml"
PREFLIGHT_STATE = role_defaults("gpu_preflight")["gpu_preflight_state_file"]
RECORD = role_defaults("verl_patches")["verl_patches_state_dir"] + "/applied.json"


@pytest.fixture(scope="module")
def converged(converged_site_fleet):
    """conftest's site_fleet after its two runs, under the name this module's checks read as a sentence."""
    return converged_site_fleet


def test_site_converges_with_root_login_and_a_rerun_changes_nothing(converged):
    assert {host.name: host.login for host in converged.hosts()} == {"node1": "root", "node2": "root"}
    sandbox_vars = yaml.safe_load((converged.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
    assert sandbox_vars["ansible_user"] == "root"
    assert {h: s["changed"] > 0 for h, s in converged.first.stats.items()} == {"node1": True, "node2": True}
    assert converged.second.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in converged.second.failures]
    assert {h: s["changed"] for h, s in converged.second.stats.items()} == {"node1": 0, "node2": 0}


def test_checklist_passes_on_converged_hosts_one_of_whose_cuda_link_was_already_11_8(converged, run_playbook):
    assert sh(converged, "node2", "readlink /usr/local/cuda") == CUDA_HOME
    assert sh(converged, "node1", "test ! -e /usr/local/cuda && echo none") == "none"
    result = run_playbook(CHECKLIST, converged.inventory_dir)
    assert result.rc == 0, [f"{f.host}: {f.message}" for f in result.failures]
    assert {h: (s["ok"], s["failures"], s["changed"]) for h, s in result.stats.items()} == {
        "node1": (3, 0, 0),
        "node2": (3, 0, 0),
    }


def test_a_profile_that_needs_no_patches_passes_without_a_record_and_fails_with_one(converged, run_playbook):
    # What preflight saves on an A100 (profile modern: verl runs as shipped, so verl_patches records nothing),
    # written over node1's saved state; the checklist reads the profile from there, as on a real modern host.
    saved = json.loads(sh(converged, "node1", f"cat {PREFLIGHT_STATE}"))
    assert saved["profile"]["needs_patches"] is True
    modern = {**saved, "profile": {**saved["profile"], "name": "modern", "needs_patches": False}}
    sh(converged, "node1", f"cp -p {PREFLIGHT_STATE} {PREFLIGHT_STATE}.away")
    try:
        written = base64.b64encode(json.dumps(modern).encode()).decode()
        sh(converged, "node1", f"echo {written} | base64 -d > {PREFLIGHT_STATE}")
        with_record = run_playbook(CHECKLIST, converged.inventory_dir, limit="node1")
        sh(converged, "node1", f"mv {RECORD} {RECORD}.away")
        try:
            without = run_playbook(CHECKLIST, converged.inventory_dir, limit="node1")
        finally:
            sh(converged, "node1", f"mv {RECORD}.away {RECORD}")
    finally:
        sh(converged, "node1", f"mv {PREFLIGHT_STATE}.away {PREFLIGHT_STATE}")
    assert without.rc == 0, [f"{f.host}: {f.message}" for f in without.failures]
    assert [f.host for f in with_record.failures] == ["node1"]
    assert "'patches': 'none'" in with_record.failures[0].message


def test_checklist_reads_its_expectations_from_the_role_variables(converged, run_playbook):
    # The same hosts against another pinned torch: the checklist must notice.
    result = run_playbook(CHECKLIST, converged.inventory_dir, extra_vars={"pytorch_torch_version": "2.7.0"})
    assert {f.host for f in result.failures} == {"node1", "node2"}
    assert "'stack': ['2.7.0+cu118', '11.8', '/opt/p40fleet/verl/verl']" in result.failures[0].message


def test_checklist_catches_a_missing_patch_record_on_a_host_that_needs_one(converged, run_playbook):
    moved = converged.exec("node2", f"mv {RECORD} {RECORD}.away")
    assert moved.returncode == 0, moved.stderr
    try:
        result = run_playbook(CHECKLIST, converged.inventory_dir)
    finally:
        converged.exec("node2", f"mv {RECORD}.away {RECORD}")
    assert {f.host for f in result.failures} == {"node2"}
    assert "expected {" in result.failures[0].message and "'patches': 'a record'" in result.failures[0].message

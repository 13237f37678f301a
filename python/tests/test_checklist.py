"""playbooks/verify.yml (the fleet checklist) on hosts the pipeline really converged.

node1 is an A100 (profile modern: verl needs no patches, so none are recorded); node2 is a P40 whose
/usr/local/cuda already pointed at /usr/local/cuda-11.8 before the run, a valid host the cuda_toolkit
role leaves as it found it. The checklist must pass on both, and still catch a broken stage.

The fleet logs in as root, the login issue 9 asks site.yml to converge and re-run unchanged with besides an
ordinary user with sudo (test_privileges.py, with a sudo password; the other fleets, without).
"""

from __future__ import annotations

import pytest
import yaml

from tests.host_state import sh
from tests.pins import CUDA_HOME

# converge: the module's fixture takes fresh hosts through the pipeline (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

CHECKLIST = "playbooks/verify.yml"
# The sandbox serves no vLLM wheel (the modern profile would install one): this checklist is not about it.
NO_VLLM = {"verl_install_vllm": False}


@pytest.fixture(scope="module")
def converged(make_sandbox, run_playbook):
    fleet = make_sandbox("checklist", ["a100", "p40"], login="root")
    linked = fleet.exec("node2", f"ln -sfn {CUDA_HOME} /usr/local/cuda")
    assert linked.returncode == 0, linked.stderr
    fleet.first = run_playbook("site.yml", fleet.inventory_dir, extra_vars=NO_VLLM)
    assert fleet.first.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in fleet.first.failures]
    fleet.second = run_playbook("site.yml", fleet.inventory_dir, extra_vars=NO_VLLM)
    return fleet


def test_site_converges_with_root_login_and_a_rerun_changes_nothing(converged):
    assert {host.name: host.login for host in converged.hosts()} == {"node1": "root", "node2": "root"}
    sandbox_vars = yaml.safe_load((converged.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
    assert sandbox_vars["ansible_user"] == "root"
    assert {h: s["changed"] > 0 for h, s in converged.first.stats.items()} == {"node1": True, "node2": True}
    assert converged.second.rc == 0, [f"{f.host}: {f.task}: {f.message}" for f in converged.second.failures]
    assert {h: s["changed"] for h, s in converged.second.stats.items()} == {"node1": 0, "node2": 0}


def test_checklist_passes_on_a_modern_host_and_on_a_host_whose_cuda_link_was_already_11_8(converged, run_playbook):
    assert sh(converged, "node2", "readlink /usr/local/cuda") == CUDA_HOME
    assert sh(converged, "node1", "test ! -e /var/lib/p40fleet/verl_patches/applied.json && echo none") == "none"
    result = run_playbook(CHECKLIST, converged.inventory_dir, extra_vars=NO_VLLM)
    assert result.rc == 0, [f"{f.host}: {f.message}" for f in result.failures]
    assert {h: (s["ok"], s["failures"], s["changed"]) for h, s in result.stats.items()} == {
        "node1": (3, 0, 0),
        "node2": (3, 0, 0),
    }


def test_checklist_reads_its_expectations_from_the_role_variables(converged, run_playbook):
    # The same hosts against another pinned torch: the checklist must notice.
    result = run_playbook(CHECKLIST, converged.inventory_dir, extra_vars={**NO_VLLM, "pytorch_torch_version": "2.7.0"})
    assert {f.host for f in result.failures} == {"node1", "node2"}
    assert "'stack': ['2.7.0+cu118', '11.8', '/opt/p40fleet/verl/verl']" in result.failures[0].message


def test_checklist_catches_a_missing_patch_record_on_a_host_that_needs_one(converged, run_playbook):
    moved = converged.exec(
        "node2", "mv /var/lib/p40fleet/verl_patches/applied.json /var/lib/p40fleet/verl_patches/applied.json.away"
    )
    assert moved.returncode == 0, moved.stderr
    try:
        result = run_playbook(CHECKLIST, converged.inventory_dir, extra_vars=NO_VLLM)
    finally:
        converged.exec(
            "node2", "mv /var/lib/p40fleet/verl_patches/applied.json.away /var/lib/p40fleet/verl_patches/applied.json"
        )
    assert {f.host for f in result.failures} == {"node2"}
    assert "expected {" in result.failures[0].message and "'patches': 'a record'" in result.failures[0].message

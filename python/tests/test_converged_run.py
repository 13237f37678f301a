"""A converged fleet in one round trip, on the two-host sandbox that runs site.yml (conftest.py).

The state probe (roles/fleet_state) reads every stage's markers once per host; each stage's one gate (its `when`
in site.yml) skips the stage where the host matches its record. Proven here on real hosts: a stage runs alone
when asked, the dry run finishes on a fresh host and names every stage's intended change, a converged re-run
executes at most two tasks per stage and host, and a driver change on one host re-verifies that host's stack
only, and says so.
(The decisions themselves are unit-tested without hosts in test_fleet_state.py.)
"""

from __future__ import annotations

import collections
import textwrap

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.host_state import sh
from tests.pins import CUDA_HOME, STAGES

# converge: the module's fixture takes fresh hosts through the pipeline (minutes).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

HOSTS = ["node1", "node2"]
RECORDS = "/var/lib/p40fleet/stages"


def failures(result) -> list[str]:
    return [f"{f.host}: {f.task}: {f.message}" for f in result.failures]


# Checks of a role's own arguments: the controller's, run for every role in the play whatever its tags.
ARGUMENT_CHECK = "validate_argument_spec"


def executed(result, with_argument_checks: bool = True) -> dict[tuple[str, str], int]:
    """(host, role) -> tasks that ran (ok or changed, not skipped)."""
    counts: dict[tuple[str, str], int] = collections.Counter()
    for event in result.events:
        if event.get("event") == "runner_on_ok":
            data = event["event_data"]
            if with_argument_checks or not str(data.get("task_action")).endswith(ARGUMENT_CHECK):
                counts[(data["host"], data.get("role", ""))] += 1
    return counts


def changed_roles(result, host: str) -> set[str]:
    return {
        event["event_data"].get("role", "")
        for event in result.events
        if event.get("event") == "runner_on_ok"
        and event["event_data"]["host"] == host
        and event["event_data"].get("res", {}).get("changed")
    }


def plans(result, host: str) -> dict[str, str]:
    """stage -> the plan fleet_state reported for it in a dry run (a stage whose prerequisites do not exist yet)."""
    return {
        item["item"]: item.get("msg", "")
        for event in result.events
        if event.get("event") == "runner_on_ok"
        and event["event_data"]["host"] == host
        and event["event_data"].get("role") == "fleet_state"
        for item in event["event_data"].get("res", {}).get("results", [])
        if item.get("changed")
    }


@pytest.fixture(scope="module")
def fleet(site_fleet):
    """The shared whole-pipeline fleet (conftest.py): node1 one P40, node2 two, taken through
    --tags gpu_preflight and --check --diff while fresh, then two real runs."""
    return site_fleet


@pytest.fixture(scope="module")
def fresh_runs(fleet):
    return fleet.preflight_only, fleet.dry_run


@pytest.fixture(scope="module")
def converged(fleet):
    assert fleet.first.rc == 0, failures(fleet.first)
    return fleet.first, fleet.second


def test_a_stage_runs_alone_on_a_fresh_host(fleet, fresh_runs):
    preflight_only, _ = fresh_runs
    assert preflight_only.rc == 0, failures(preflight_only)
    roles_that_ran = {role for (_, role) in executed(preflight_only, with_argument_checks=False)}
    # '' is the play's closing step, which records a verification only after a run through every stage.
    assert roles_that_ran <= {"gpu_preflight", "fleet_state", ""}, roles_that_ran
    seen = fleet.after_preflight_only
    for host in HOSTS:
        assert seen[(host, "/etc/ansible/facts.d/p40fleet_preflight.fact")], host
        assert not seen[(host, RECORDS)], host
        assert not seen[(host, "/opt/miniconda3")], host


def test_a_stage_runs_with_what_it_needs_and_nothing_else(fleet):
    prereqs_only = fleet.prereqs_only
    assert prereqs_only.rc == 0, failures(prereqs_only)
    roles_that_ran = {role for (_, role) in executed(prereqs_only, with_argument_checks=False)}
    assert roles_that_ran <= {"gpu_preflight", "fleet_state", "host_prereqs", ""}, roles_that_ran
    seen = fleet.after_prereqs_only
    for host in HOSTS:
        assert seen[(host, "/usr/bin/gcc-11")], host
        assert seen[(host, "/var/lib/p40fleet/stages/host_prereqs.json")], host
        assert not seen[(host, CUDA_HOME)], host
        assert not seen[(host, "/opt/miniconda3")], host


def test_the_dry_run_finishes_on_a_fresh_host_and_names_every_stage(fleet, fresh_runs):
    # On node2 (conftest's site_fleet: its /usr/local/cuda already names the toolkit the run would install).
    _, dry_run = fresh_runs
    assert dry_run.rc == 0, failures(dry_run)
    assert set(dry_run.stats) == {"node2"}
    # A stage is simulated task by task (its role changed something), or, before its prerequisites exist,
    # skipped by its gate and reported by fleet_state: never both.
    simulated, planned = changed_roles(dry_run, "node2"), plans(dry_run, "node2")
    missing = [stage for stage in STAGES if stage not in simulated and stage not in planned]
    assert missing == [], dry_run.stdout[-3000:]
    assert simulated & set(planned) == set(), planned
    # Nothing was installed by it, on either host.
    for host in HOSTS:
        assert not fleet.after_dry_run[(host, CUDA_HOME)], host
        assert not fleet.after_dry_run[(host, RECORDS)], host
    assert planned["verl_patches"].startswith(
        "node2: verl_patches would be converged: no record of a completed verl_patches run"
    )


def test_a_converged_rerun_skips_every_stage(converged):
    first, second = converged
    assert first.stats["node1"]["changed"] > 0
    assert second.rc == 0, failures(second)
    assert {host: stats["changed"] for host, stats in second.stats.items()} == {"node1": 0, "node2": 0}
    counts = executed(second)
    over = {key: n for key, n in counts.items() if key[1] in STAGES and n > 2}
    assert over == {}, over
    # The whole converged run, preflight and probe included, executes few tasks per host.
    for host in HOSTS:
        assert sum(n for (h, _), n in counts.items() if h == host) <= 20, counts


def test_a_converged_dry_run_changes_nothing(fleet, converged):
    dry_run = fleet.play(check=True, diff=True)
    assert dry_run.rc == 0, failures(dry_run)
    assert {host: stats["changed"] for host, stats in dry_run.stats.items()} == {"node1": 0, "node2": 0}


def test_verify_tag_rechecks_every_stage_and_installs_nothing(fleet, converged):
    verify = fleet.play(tags="verify")
    assert verify.rc == 0, failures(verify)
    assert {host: stats["changed"] for host, stats in verify.stats.items()} == {"node1": 0, "node2": 0}
    counts = executed(verify)
    for host in HOSTS:
        unverified = [stage for stage in STAGES if counts[(host, stage)] < 2 and stage != "host_prereqs"]
        assert unverified == [], (host, counts)
    # The sandbox inventory narrows verl's checks, visibly: the task name lists them.
    checks = "editable, compile, hydra_compose, flash_attn_shim, pip_check"
    assert f"Run verl's post-install checks in the env ({checks})" in verify.stdout


def test_each_stage_s_variable_subset_templates_as_every_variable_does(fleet, converged, run_playbook, tmp_path):
    """fleet_state_specs templates each stage against the variables it references; on the real roles and a real
    host's facts the result is the one every variable of the play gives."""
    playbook = tmp_path / "specs.yml"
    playbook.write_text(
        textwrap.dedent(
            f"""\
            ---
            - name: Template every stage's markers and inputs both ways
              hosts: node1
              gather_facts: false
              roles: [fleet_state, {", ".join(STAGES)}]
              pre_tasks:
                - name: Publish the GPU profile that the stages' inputs read
                  ansible.builtin.include_role:
                    name: gpu_preflight
                - name: Compare the subset's result with every variable's
                  ansible.builtin.assert:
                    that:
                      - subset == every
                      - subset.keys() | sort == {sorted(STAGES)}
                    fail_msg: "{{{{ subset | to_json }}}} != {{{{ every | to_json }}}}"
                    quiet: true
                  vars:
                    roles_dir: {REPO_ROOT / "roles"}
                    subset: >-
                      {{{{ lookup('p40fleet.fleet.fleet_state_specs', *fleet_state_stages, roles_dir=roles_dir) }}}}
                    every: >-
                      {{{{ lookup('p40fleet.fleet.fleet_state_specs', *fleet_state_stages, roles_dir=roles_dir,
                                  every_variable=true) }}}}
                - name: Stop before the stages
                  ansible.builtin.meta: end_play
            """
        )
    )
    result = run_playbook(playbook, fleet.inventory_dir)
    assert result.rc == 0, failures(result)
    assert result.stats["node1"]["changed"] == 0, result.stats


def test_a_driver_change_reverifies_that_host_only(fleet, converged):
    """Last in this file: node1 gets a new driver, and is given its old one back at the end."""
    fleet.set_profile("node1", "p40-upgraded")
    after_upgrade = fleet.play()
    assert after_upgrade.rc == 0, failures(after_upgrade)
    assert "node1: the preflight state changed since the stack was last verified" in after_upgrade.stdout
    assert "node2: the preflight state changed" not in after_upgrade.stdout
    counts = executed(after_upgrade)
    reverified = [stage for stage in STAGES if counts[("node1", stage)] > 2]
    assert set(reverified) >= {"cuda_toolkit", "pytorch", "apex", "verl", "verl_patches", "launch_script"}, counts
    assert [stage for stage in STAGES if counts[("node2", stage)] > 2] == [], counts
    # Only preflight's own record of the new driver changed; nothing was reinstalled.
    assert changed_roles(after_upgrade, "node1") == {"gpu_preflight"}
    assert after_upgrade.stats["node2"]["changed"] == 0
    assert "550.127.05" in sh(fleet, "node1", "cat /var/lib/p40fleet/verified.json")
    settled = fleet.play()
    assert settled.rc == 0, failures(settled)
    assert {host: stats["changed"] for host, stats in settled.stats.items()} == {"node1": 0, "node2": 0}
    assert [stage for stage in STAGES if executed(settled)[("node1", stage)] > 2] == []
    fleet.set_profile("node1", "p40")
    restored = fleet.play()
    assert restored.rc == 0, failures(restored)
    assert restored.stats["node1"]["changed"] == 1 and restored.stats["node2"]["changed"] == 0

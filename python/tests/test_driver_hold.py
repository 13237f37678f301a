"""driver_hold with real apt on a sandbox host: stand-in driver packages of branches 535, 580 and 590 in a suite
of their own (fixtures/standins/apt_suites/nvidia_drivers.py), enabled on this test's host only.

One host, in order: R580 installed with cuda-drivers-580 (which allows >= 580); without the hold apt would move it
to 590; site.yml's driver_hold stage holds it; `apt-get upgrade` and `dist-upgrade` then take the fix release of
R580 and not 590, and neither 590 asked for by version nor the open module installs; a second run changes
nothing; `driver_hold_state: absent` removes exactly what was added and the upgrade to 590 goes through again."""

from __future__ import annotations

import json
import re

import pytest

from p40fleet import fleet as fleet_module
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import Sandbox, apt_suite

pytestmark = pytest.mark.sandbox

BUILDER = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "apt_suites" / "nvidia_drivers.py"
PREFERENCES = "/etc/apt/preferences.d/p40fleet-nvidia-driver-hold.pref"
UNATTENDED = "/etc/apt/apt.conf.d/51p40fleet-nvidia-driver-hold"
RECORD = "/var/lib/p40fleet/driver_hold.json"
R580 = ["nvidia-driver", "libnvidia-compute", "nvidia-kernel-dkms", "cuda-drivers-580"]
APT = "DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Dpkg::Use-Pty=0"


def failures(result) -> list[str]:
    return [f"{f.host}: {f.task}: {f.message}" for f in result.failures]


def roles_that_ran(result) -> set[str]:
    """The roles whose tasks ran on node1, argument checks aside (p40fleet_defaults, which every role depends on,
    has only its check, which runs on the controller)."""
    return {
        event["event_data"].get("role", "")
        for event in result.events
        if event.get("event") in ("runner_on_ok", "runner_on_failed")
        and event["event_data"]["host"] == "node1"
        and not str(event["event_data"].get("task_action")).endswith("validate_argument_spec")
    }


def sh(fleet: Sandbox, command: str) -> str:
    done = fleet.exec("node1", command)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def versions(fleet: Sandbox) -> dict[str, str]:
    out = sh(fleet, "dpkg-query -W -f '${Package} ${Version} ${db:Status-Abbrev}\\n' " + " ".join(R580))
    return {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[2:3] in (["ii"], ["hi"])}


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    sandbox = make_sandbox("driver-hold", ["p40-r580"])
    sandbox.enable_apt_suite("node1", apt_suite(BUILDER))
    sh(
        sandbox,
        f"{APT} install nvidia-driver=580.95.05-1 libnvidia-compute=580.95.05-1 nvidia-kernel-dkms=580.95.05-1 "
        "cuda-drivers-580=580.95.05-1 unattended-upgrades",
    )
    return sandbox


def test_the_hold_keeps_r580_through_upgrades_and_absent_restores_them(fleet, run_playbook):
    assert versions(fleet)["nvidia-driver"] == "580.95.05-1"
    # Without the hold apt moves the host to R590 (simulated: the same resolution, nothing installed).
    unheld = sh(fleet, f"{APT} -s dist-upgrade")
    assert "Inst nvidia-driver [580.95.05-1] (590.44.01-1" in unheld, unheld
    assert "Inst nvidia-driver [580.95.05-1] (590.44.01-1" in sh(fleet, f"{APT} -s upgrade")

    held = run_playbook("site.yml", fleet.inventory_dir, tags="driver_hold")
    assert held.rc == 0, failures(held)
    assert held.stats["node1"]["changed"] > 0
    record = json.loads(sh(fleet, f"cat {RECORD}"))
    assert record == {
        "schema": 1,
        "branch": "580",
        "pinned": ["cuda-drivers-580", "libnvidia-compute", "nvidia-driver", "nvidia-kernel-dkms"],
        "held": ["cuda-drivers-580"],
        "held_by_role": ["cuda-drivers-580"],
        "blacklisted": ["cuda-drivers-580", "libnvidia-compute", "nvidia-driver", "nvidia-kernel-dkms"],
    }
    assert sh(fleet, "apt-mark showhold").split() == ["cuda-drivers-580"]
    policy = sh(fleet, "apt-cache policy nvidia-driver")
    assert "Candidate: 580.105.08-1" in policy, policy
    # apt itself reads the blacklist as unattended-upgrades will.
    config = sh(fleet, "apt-config dump Unattended-Upgrade::Package-Blacklist")
    assert 'Unattended-Upgrade::Package-Blacklist:: "^nvidia-driver$";' in config, config

    # What `p40fleet report --refresh` reads (playbooks/state.yml) shows the hold.
    state = run_playbook("playbooks/state.yml", fleet.inventory_dir)
    assert state.rc == 0, failures(state)
    (probe,) = [p for host, p in fleet_module.probe_results(state.events).items() if host == "node1"]
    summary = fleet_module.stage_summary(probe["stages"])["driver_hold"]
    assert summary == {"state": "R580 held", "pinned": record["pinned"], "held": ["cuda-drivers-580"]}

    sh(fleet, f"{APT} upgrade")
    assert versions(fleet) == {
        "nvidia-driver": "580.105.08-1",
        "libnvidia-compute": "580.105.08-1",
        "nvidia-kernel-dkms": "580.105.08-1",
        "cuda-drivers-580": "580.95.05-1",
    }
    sh(fleet, f"{APT} dist-upgrade")
    assert versions(fleet)["nvidia-driver"] == "580.105.08-1"
    # Another branch is not installed even when asked for by version, nor is the open module: apt gives those
    # versions priority -1, and no candidate at all to the open module's packages.
    policy = sh(fleet, "apt-cache policy nvidia-driver nvidia-kernel-open-dkms nvidia-driver-580-open")
    assert re.search(r"^ +590\.44\.01-1 -1$", policy, re.MULTILINE), policy
    assert re.search(r"^ \*\*\* 580\.105\.08-1 1000$", policy, re.MULTILINE), policy
    assert policy.count("Candidate: (none)") == 2, policy
    for package in ("nvidia-driver=590.44.01-1", "nvidia-driver-580-open", "nvidia-kernel-open-dkms"):
        refused = fleet.exec("node1", f"{APT} -s install {package}")
        assert refused.returncode != 0, (package, refused.stdout)

    again = run_playbook("site.yml", fleet.inventory_dir, tags="driver_hold")
    assert again.rc == 0, failures(again)
    assert again.stats["node1"]["changed"] == 0
    # Converged on its stages, the host ends its play after the probe: no task of driver_hold is even evaluated
    # (the first run of this play records the preflight state the stages were verified on, as site.yml does).
    verified = run_playbook("python/tests/playbooks/driver_hold.yml", fleet.inventory_dir)
    assert verified.rc == 0 and verified.stats["node1"]["changed"] == 0, failures(verified)
    converged = run_playbook("python/tests/playbooks/driver_hold.yml", fleet.inventory_dir)
    assert converged.rc == 0, failures(converged)
    assert roles_that_ran(converged) == {"gpu_preflight", "fleet_state"}, roles_that_ran(converged)

    absent = run_playbook(
        "site.yml", fleet.inventory_dir, tags="driver_hold", extra_vars={"driver_hold_state": "absent"}
    )
    assert absent.rc == 0, failures(absent)
    assert absent.stats["node1"]["changed"] > 0
    gone = fleet.exec("node1", f"ls {PREFERENCES} {UNATTENDED} {RECORD}")
    assert gone.returncode != 0 and gone.stdout == "", gone.stdout
    assert sh(fleet, "apt-mark showhold").split() == []
    absent_again = run_playbook(
        "site.yml", fleet.inventory_dir, tags="driver_hold", extra_vars={"driver_hold_state": "absent"}
    )
    assert absent_again.rc == 0, failures(absent_again)
    assert absent_again.stats["node1"]["changed"] == 0
    sh(fleet, f"{APT} dist-upgrade")
    assert versions(fleet) == {
        "nvidia-driver": "590.44.01-1",
        "libnvidia-compute": "590.44.01-1",
        "nvidia-kernel-dkms": "590.44.01-1",
        "cuda-drivers-580": "580.105.08-1",
    }

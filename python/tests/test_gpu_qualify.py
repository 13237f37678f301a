"""playbooks/qualify.yml end to end on sandbox hosts, one stand-in card per host, over real SSH and sudo.

Each host's root nvidia-smi is python/tests/fixtures/standins/gpu_qualify/nvidia-smi answering from one recorded card
(the YAML stand-ins beside it), put there as `sandbox up --services` puts it (python/p40fleet_dev/standins.py); the
kernel log is that card's recorded one; the load is a stand-in (it sleeps, as the env owner, and prints a false "all
cards passed" that nothing may read: the verdicts are root's samples'). Two runs: the second finds the retiring
card's retired pages grown and names it getting worse, from the history the controller kept.
"""

from __future__ import annotations

import json

import pytest
import yaml

from p40fleet_dev.standins import KERNEL_LOG, QUALIFY_SMI, give_card, install_qualify

pytestmark = pytest.mark.sandbox

# The load's stand-in: the env owner's process, for the role's seconds; what it prints is a lie nothing may read.
LOAD = "import sys, time; print('gpu_qualify: every card passed'); time.sleep(float(sys.argv[-1]))"
FLEET = {
    "node1": "p40-healthy",
    "node2": "p40-thermal",
    "node3": "p40-power-cap",
    "node4": "p40-ecc-errors",
    "node5": "p40-retiring",
    "node6": "p40-x8",
    "node7": "p40-r470",
}
# host -> (verdict, a reason it must give), from the stand-ins' recordings.
EXPECTED = {
    "node1": ("pass", None),
    "node2": ("fail", "HW Thermal Slowdown reached under load at a peak of 92 °C (first at 92 °C)"),
    "node3": ("warn", "held at its power limit of 250 W under load (SW Power Cap, peak draw 257 W)"),
    "node4": ("fail", "double-bit (uncorrectable) ECC errors: volatile 2, aggregate 3"),
    "node5": ("fail", "a retired page is pending: it takes effect only at the next driver load"),
    "node6": ("warn", "PCIe link x8 under load, the card's maximum x16"),
    "node7": ("warn", "reached 84 °C under load (gpu_qualify_max_temperature_c: 83 °C, slowdown at 92 °C)"),
}
RETIRED_BEFORE = ("Single Bit ECC                    : 6", "Single Bit ECC                    : 2")


@pytest.fixture(scope="module")
def fleet(make_sandbox):
    fleet = make_sandbox("gpu-qualify", ["p40"] * len(FLEET))
    for host, name in FLEET.items():
        install_qualify(fleet, host)
        give_card(fleet, host, name, RETIRED_BEFORE if name == "p40-retiring" else None)
        assert fleet.exec(host, "id p40fleet || useradd --create-home p40fleet").returncode == 0
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(
        "---\n# The qualification's stand-ins (python/tests/test_gpu_qualify.py).\n"
        + yaml.safe_dump(
            {
                "gpu_qualify_nvidia_smi": QUALIFY_SMI,
                "gpu_qualify_kernel_log_command": ["/bin/cat", KERNEL_LOG],
                "gpu_qualify_load_command": ["/usr/bin/python3", "-I", "-c", LOAD],
                "gpu_qualify_seconds": 2,
                "gpu_qualify_sample_interval": 1,
            }
        )
    )
    return fleet


@pytest.fixture(scope="module")
def first(fleet, run_playbook):
    return run_playbook("playbooks/qualify.yml", fleet.inventory_dir)


def history(fleet) -> dict:
    path = fleet.inventory_dir / ".p40fleet-gpu-qualify.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    return json.loads(path.read_text())


def test_each_standin_card_gets_its_verdict_and_message(fleet, first):
    assert first.stats, first.stdout[-3000:]
    failed = {failure.host: failure.message for failure in first.failures}
    assert sorted(failed) == sorted(h for h, (verdict, _) in EXPECTED.items() if verdict == "fail")
    kept = history(fleet)["cards"]
    by_host = {record["last"]["host"]: record["last"] for record in kept.values()}
    assert sorted(by_host) == sorted(FLEET)
    for host, (verdict, reason) in EXPECTED.items():
        card = by_host[host]
        assert card["verdict"] == verdict, (host, card["reasons"])
        assert card["serial"] == kept[card["id"]]["last"]["serial"] and card["id"] == card["serial"]
        if reason:
            assert any(r.startswith(reason) for r in card["reasons"]), (host, card["reasons"])
        else:
            assert card["reasons"] == []


def test_a_single_gpu_host_has_no_topology_to_fix(fleet, first):
    hosts = history(fleet)["hosts"]
    assert sorted(hosts) == sorted(FLEET)
    assert {h: (t["gpus"], t["nccl_environment"], t["findings"]) for h, t in hosts.items()} == dict.fromkeys(
        FLEET, (1, {}, [])
    )


def test_a_throttling_card_fails_with_the_temperature_and_reason_it_reached(first):
    [message] = [failure.message for failure in first.failures if failure.host == "node2"]
    assert "node2 GPU 00000000:03:00.0 (Tesla P40, serial 0324617040112): fail" in message
    assert "HW Thermal Slowdown reached under load at a peak of 92 °C (first at 92 °C); do: improve the airflow" in (
        message
    )


def test_the_older_drivers_card_was_sampled_under_its_throttle_names(fleet, first):
    card = next(c["last"] for c in history(fleet)["cards"].values() if c["last"]["host"] == "node7")
    assert card["summary"]["reasons_field"] == "clocks_throttle_reasons"
    assert card["summary"]["loaded_samples"] >= 3 and card["driver_version"] == "470.256.02"


def test_nothing_the_load_printed_is_read(first):
    # The stand-in load said every card passed; three failed, on root's samples and reports alone.
    assert len(first.failures) == 3


def test_a_card_whose_retired_pages_grew_is_named_getting_worse(fleet, first, run_playbook):
    before = history(fleet)["cards"]["0324617040861"]
    assert before["last"]["summary"]["retired"]["sbe"] == 2 and before["last"]["getting_worse"] is False
    give_card(fleet, "node5", "p40-retiring")  # the same card (serial), now 6 retired pages
    again = run_playbook("playbooks/qualify.yml", fleet.inventory_dir, limit="node5")
    assert [failure.host for failure in again.failures] == ["node5"]
    kept = history(fleet)["cards"]
    assert len(kept) == len(FLEET)  # the cards not qualified this time keep their records
    card = kept["0324617040861"]
    assert card["last"]["getting_worse"] is True
    assert any(
        r.startswith("getting worse since the last qualification") and "retired pages 2 -> 6" in r
        for r in card["last"]["reasons"]
    ), card["last"]["reasons"]
    assert [entry["retired"]["sbe"] for entry in card["trail"]] == [2, 6]
    assert "getting worse since the last qualification" in again.stdout

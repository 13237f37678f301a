"""gpu_qualify's decisions without containers: each stand-in card (python/tests/fixtures/standins/gpu_qualify/)
parsed and judged by the role's filter, paired with its exact verdict and the findings that make it; plus the
rules the stand-ins do not reach (history, Xid classes, a load that never reached the card)."""

from __future__ import annotations

import copy
import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from p40fleet.run import run_playbook
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

ROLE = REPO_ROOT / "roles" / "gpu_qualify"
RULES = load_module(REPO_ROOT / "plugins" / "filter" / "gpu_qualify.py", "gpu_qualify_rules")
STANDINS = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "gpu_qualify"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())

pytestmark = pytest.mark.unit


def standin(name: str) -> dict:
    return yaml.safe_load((STANDINS / f"{name}.yml").read_text())


def settings(**overrides) -> dict:
    base = {
        "host": "gpu1",
        "max_temperature_c": DEFAULTS["gpu_qualify_max_temperature_c"],
        "load_min_utilization": DEFAULTS["gpu_qualify_load_min_utilization"],
        "min_loaded_samples": DEFAULTS["gpu_qualify_min_loaded_samples"],
        "retired_pages_max": DEFAULTS["gpu_qualify_retired_pages_max"],
        "xid_fail": DEFAULTS["gpu_qualify_xid_fail"],
        "xid_meaning": DEFAULTS["gpu_qualify_xid_meaning"],
    }
    return {**base, **overrides}


def collected(case: dict) -> dict:
    return {
        "smi_q": case["smi_q"],
        "samples": case["samples"],
        "samples_fields": RULES.sample_fields(case["reasons_prefix"]),
        "kernel_log": case["kernel_log"],
        **{key: case[key] for key in ("topo_m", "topo_p2p_r", "cmdline") if key in case},
    }


def judge(name: str, history: dict | None = None, **overrides) -> dict:
    [verdict] = RULES.gpu_qualify_verdicts(collected(standin(name)), history or {}, settings(**overrides))
    return verdict


def edited(key: str, old: str, new: str, name: str = "p40-healthy") -> dict:
    """The verdict on a stand-in whose text `key` has `old` replaced by `new` (which must be there)."""
    case = standin(name)
    assert old in case[key]
    case[key] = case[key].replace(old, new)
    [verdict] = RULES.gpu_qualify_verdicts(collected(case), {}, settings())
    return verdict


def levels(verdict: dict) -> list[tuple[str, str]]:
    return [(f["level"], f["reason"]) for f in verdict["findings"]]


# --- The parsers, on the stand-ins of both driver generations -------------------------------------------------


# What a process on the card can print into `nvidia-smi -q`: its name, as it set it, in the card's process list.
PROCESS = (
    "    Processes\n"
    "        GPU instance ID                   : N/A\n"
    "        Compute instance ID               : N/A\n"
    "        Process ID                        : 4242\n"
    "            Type                          : C\n"
    "            Name                          : {name}\n"
    "            Used GPU Memory               : 500 MiB\n"
)
NO_PROCESS = "    Processes                             : None\n"


def test_a_process_name_cannot_rewrite_its_cards_facts():
    """The card that failed on ECC runs an owner process whose name holds newlines and the lines of a clean card:
    the process list is not read, the card still fails on its own counts."""
    forged = (
        "python\n    Serial Number                         : 0324617040925\n    ECC Errors\n"
        "        Volatile\n            DRAM Uncorrectable            : 0\n"
        "        Aggregate\n            DRAM Uncorrectable            : 0\n"
        "    Retired Pages\n        Double Bit ECC                    : 0"
    )
    case = standin("p40-ecc-errors")
    assert NO_PROCESS in case["smi_q"]
    case["smi_q"] = case["smi_q"].replace(NO_PROCESS, PROCESS.format(name=forged))
    [card] = RULES.parse_smi_q(case["smi_q"])
    assert card["serial"] == "0324617040318" and card["ecc"]["aggregate_dbe"] == 3 and card["retired"]["dbe"] == 1
    [verdict] = RULES.gpu_qualify_verdicts(collected(case), {}, settings())
    assert verdict["verdict"] == "fail" and verdict["id"] == "0324617040318"


@pytest.mark.parametrize(
    ("forged", "why"),
    [
        # A whole card of its own after the name: one GPU section more than the header's Attached GPUs.
        (
            "python\nGPU 00000000:04:00.0\n    Product Name : Tesla P40\n    Serial Number : 0324617040318",
            "lists 2 GPU",
        ),
        ("python\nGPU 00000000:03:00.0\n    Serial Number : 0324617040925", "lists 2 GPU"),
    ],
)
def test_a_process_name_that_makes_a_card_of_its_own_is_refused(forged, why):
    case = standin("p40-healthy")
    case["smi_q"] = case["smi_q"].replace(NO_PROCESS, PROCESS.format(name=forged))
    with pytest.raises(RULES.SmiReportError, match=why) as refused:
        RULES.gpu_qualify_verdicts(collected(case), {}, settings())
    assert str(refused.value).startswith("gpu1: root's nvidia-smi -q ")


def test_one_bus_id_or_serial_twice_is_refused():
    """Where the header's count is not there to catch it (or agrees), a bus id or serial named twice still is."""
    case = standin("p40-healthy")
    head, _, card = case["smi_q"].partition("GPU 00000000:03:00.0\n")
    twice = head.replace(
        "Attached GPUs                             : 1", "Attached GPUs                             : 2"
    )
    for other_bus, match in (
        ("00000000:03:00.0", "bus id 00000000:03:00.0"),
        ("00000000:04:00.0", "serial 0324617040925"),
    ):
        text = f"{twice}GPU 00000000:03:00.0\n{card}GPU {other_bus}\n{card}"
        with pytest.raises(RULES.SmiReportError, match=match):
            RULES.parse_smi_q(text, "gpu1")


def test_healthy_p40_report_is_read_with_the_r535_names():
    [card] = RULES.parse_smi_q(standin("p40-healthy")["smi_q"])
    assert card["name"] == "Tesla P40" and card["serial"] == "0324617040925"
    assert card["bus_id"] == "00000000:03:00.0" and card["driver_version"] == "535.183.01"
    assert card["reasons_field"] == "clocks_event_reasons"
    assert card["reasons"] == dict.fromkeys(RULES.REASON_FIELDS, False)
    assert card["pcie"] == {"gen_max": 3, "gen_current": 3, "width_max": 16, "width_current": 16}
    assert card["ecc_mode"] == "Enabled"
    assert card["ecc"] == {"volatile_sbe": 0, "volatile_dbe": 0, "aggregate_sbe": 0, "aggregate_dbe": 0}
    assert card["retired"] == {"sbe": 0, "dbe": 0, "pending": False}
    assert card["temperature"] == {"current": 71, "slowdown": 92, "shutdown": 95}
    assert card["power"] == {"draw": 201.33, "limit": 250.0, "default_limit": 250.0, "max_limit": 250.0}
    assert card["clocks"] == {"sm": 1303, "max_sm": 1531}
    assert card["persistence_mode"] == "Enabled"


def test_older_driver_report_is_read_with_its_throttle_names():
    [card] = RULES.parse_smi_q(standin("p40-r470")["smi_q"])
    assert card["driver_version"] == "470.256.02"
    assert card["reasons_field"] == "clocks_throttle_reasons"
    assert set(card["reasons"]) == set(RULES.REASON_FIELDS)
    assert card["power"]["limit"] == 250.0 and card["retired"]["pending"] is False
    assert card["persistence_mode"] == "Disabled"


def test_retiring_report_reads_the_pending_page_and_counts():
    [card] = RULES.parse_smi_q(standin("p40-retiring")["smi_q"])
    assert card["retired"] == {"sbe": 6, "dbe": 0, "pending": True}
    assert card["ecc"]["aggregate_sbe"] == 118


def test_newer_ecc_rows_are_summed_as_single_and_double_bit():
    errors = {"SRAM Correctable": "2", "SRAM Uncorrectable": "0", "DRAM Correctable": "5", "DRAM Uncorrectable": "1"}
    assert RULES._ecc_counts(errors) == (7, 1)
    assert RULES._ecc_counts({"SRAM Correctable": "N/A", "DRAM Uncorrectable": "N/A"}) == (None, None)


@pytest.mark.parametrize("prefix", RULES.REASON_PREFIXES)
def test_samples_read_either_prefix_as_the_same_reasons(prefix):
    fields = RULES.sample_fields(prefix)
    assert f"{prefix}.hw_thermal_slowdown" in fields
    rows = RULES.parse_samples(standin("p40-thermal")["samples"], fields)
    assert len(rows) == 12
    assert rows[-1]["hw_thermal_slowdown"] is True and rows[0]["hw_thermal_slowdown"] is False
    assert rows[-1]["temperature.gpu"] == 92 and rows[-1]["clocks.sm"] == 936
    assert rows[0]["fan.speed"] is None


def test_a_sample_row_cut_short_is_not_read():
    fields = RULES.sample_fields("clocks_event_reasons")
    text = standin("p40-healthy")["samples"] + "0, 0324617040925, GPU-5f2e6a9c"
    assert len(RULES.parse_samples(text, fields)) == 12


def test_xids_are_counted_per_card_by_its_pci_address():
    log = (
        standin("p40-ecc-errors")["kernel_log"] + "[ 9.1] NVRM: Xid (PCI:0000:82:00): 79, GPU has fallen off the bus.\n"
    )
    assert RULES.parse_xids(log) == {"0000:03:00": {48: 1, 63: 1}, "0000:82:00": {79: 1}}
    assert RULES.bus_key("00000000:03:00.0") == RULES.bus_key("PCI:0000:03:00") == "0000:03:00"


# --- Each stand-in card, its verdict and findings -----------------------------------------------------------


def test_healthy_p40_passes_with_nothing_to_say():
    verdict = judge("p40-healthy")
    assert verdict["verdict"] == "pass" and verdict["findings"] == []
    assert verdict["id"] == "0324617040925"
    summary = verdict["summary"]
    assert summary["max_temperature"] == 71 and summary["loaded_samples"] == 11
    assert summary["pcie_loaded"] == {"gen": 3, "width": 16, "gen_max": 3, "width_max": 16}
    assert summary["min_sm_clock_loaded"] == 1303 and summary["reasons_seen"] == []


def test_thermally_throttling_card_fails_with_the_temperature_and_reason_it_reached():
    verdict = judge("p40-thermal")
    assert verdict["verdict"] == "fail"
    fails = [reason for level, reason in levels(verdict) if level == "fail"]
    assert "HW Thermal Slowdown reached under load at a peak of 92 °C (first at 92 °C)" in fails
    assert "SW Thermal Slowdown reached under load at a peak of 92 °C (first at 92 °C)" in fails
    assert any(f["do"].startswith("improve the airflow") for f in verdict["findings"])
    message = RULES.gpu_qualify_message([verdict])
    assert message.startswith("gpu1 GPU 00000000:03:00.0 (Tesla P40, serial 0324617040112): fail")
    assert "92 °C" in message and "do: improve the airflow" in message
    assert verdict["summary"]["min_sm_clock_loaded"] == 936


def test_power_capped_card_warns_with_its_limit():
    verdict = judge("p40-power-cap")
    assert levels(verdict) == [
        (
            "warn",
            "held at its power limit of 250 W under load (SW Power Cap, peak draw 257 W); clocks drop while it holds",
        )
    ]
    assert verdict["verdict"] == "warn"


def test_ecc_erroring_card_fails_on_double_bit_errors_and_its_xids():
    verdict = judge("p40-ecc-errors")
    assert verdict["verdict"] == "fail"
    assert levels(verdict) == [
        ("fail", "double-bit (uncorrectable) ECC errors: volatile 2, aggregate 3"),
        ("warn", "1 retired pages (0 single-bit, 1 double-bit)"),
        ("fail", "Xid 48 (double-bit ECC error) 1 time(s) in the kernel log since boot"),
        ("fail", "Xid 63 (ECC page retirement recorded) 1 time(s) in the kernel log since boot"),
    ]


def test_retiring_card_fails_on_the_pending_page():
    verdict = judge("p40-retiring")
    assert verdict["verdict"] == "fail"
    assert levels(verdict) == [
        ("fail", "a retired page is pending: it takes effect only at the next driver load"),
        ("warn", "6 retired pages (6 single-bit, 0 double-bit)"),
        ("fail", "Xid 63 (ECC page retirement recorded) 1 time(s) in the kernel log since boot"),
    ]
    assert "reboot the host" in verdict["findings"][0]["do"]


def test_x8_linked_card_warns_with_the_width_it_trained_at():
    verdict = judge("p40-x8")
    assert levels(verdict) == [("warn", "PCIe link x8 under load, the card's maximum x16")]
    assert "x16 slot" in verdict["findings"][0]["do"]


def test_older_drivers_card_is_judged_by_the_same_rules():
    verdict = judge("p40-r470")
    assert verdict["summary"]["reasons_field"] == "clocks_throttle_reasons"
    assert levels(verdict) == [
        (
            "warn",
            "reached 84 °C under load (gpu_qualify_max_temperature_c: 83 °C, slowdown at 92 °C): little headroom "
            "for a multi-day run",
        ),
        (
            "warn",
            "persistence mode is Disabled: the driver state is torn down between jobs, so each start re-initializes "
            "the card",
        ),
    ]


# --- The rules the stand-ins do not reach ---------------------------------------------------------------------


def test_a_card_the_load_never_reached_fails_unproven():
    verdict = edited("samples", ", 100, [N/A]", ", 3, [N/A]")
    assert verdict["verdict"] == "fail"
    assert verdict["reasons"] == [
        "the load did not reach the card: 0 of 12 samples at >= 90% utilization (max 3%), so cooling and the link "
        "are unproven"
    ]


def test_a_card_without_samples_fails():
    case = standin("p40-healthy")
    case["samples"] = ""
    [verdict] = RULES.gpu_qualify_verdicts(collected(case), {}, settings())
    assert verdict["reasons"] == ["no sample of this card was taken during the load"]


def test_temperature_at_the_slowdown_point_fails_even_without_a_reason():
    verdict = edited("samples", ", 71, 1303", ", 92, 1303")
    assert levels(verdict) == [("fail", "reached 92 °C, at or above the card's slowdown temperature of 92 °C")]


@pytest.mark.parametrize(
    ("xid", "level"),
    [(48, "fail"), (63, "fail"), (64, "fail"), (79, "fail"), (13, "warn"), (31, "warn"), (43, "warn")],
)
def test_xid_classes(xid, level):
    case = standin("p40-healthy")
    case["kernel_log"] = f"[ 1.0] NVRM: Xid (PCI:0000:03:00): {xid}, pid=1, name=python, ...\n" * 2
    case["kernel_log"] += "[ 1.0] NVRM: Xid (PCI:0000:04:00): 79, another card's\n"
    [verdict] = RULES.gpu_qualify_verdicts(collected(case), {}, settings())
    assert verdict["verdict"] == level
    assert [f["reason"].split(" (")[0] for f in verdict["findings"]] == [f"Xid {xid}"]
    assert verdict["summary"]["xids"] == {str(xid): 2}


def test_power_limit_below_default_warns():
    verdict = edited("smi_q", "Current Power Limit               : 250.00 W", "Current Power Limit : 200 W")
    assert verdict["reasons"] == ["power limit 200 W is below the card's default 250 W"]


def test_ecc_disabled_warns():
    mode = "ECC Mode\n        Current                           : "
    verdict = edited("smi_q", mode + "Enabled", mode + "Disabled")
    assert verdict["reasons"] == ["ECC is disabled: memory errors are neither corrected nor counted"]


def test_many_retired_pages_fail():
    verdict = judge("p40-retiring", retired_pages_max=6)
    assert ("fail", "6 retired pages (6 single-bit, 0 double-bit), at or above gpu_qualify_retired_pages_max (6)") in (
        levels(verdict)
    )


# --- History: getting worse, and a card that failed before -----------------------------------------------------


def test_a_card_whose_retired_pages_grew_is_named_getting_worse():
    first = judge("p40-retiring")
    earlier = copy.deepcopy(first)
    earlier["summary"]["retired"] = {"sbe": 2, "dbe": 0, "pending": False}
    earlier["summary"]["ecc"]["aggregate_sbe"] = 40
    history = RULES.gpu_qualify_history({}, [earlier], "2026-11-28T10:00:00+00:00")
    verdict = judge("p40-retiring", history=history)
    assert verdict["getting_worse"] is True
    assert (
        "warn",
        "getting worse since the last qualification (2026-11-28T10:00:00+00:00): retired pages 2 -> 6, aggregate "
        "single-bit ECC errors 40 -> 118",
    ) in levels(verdict)


def test_the_same_counts_as_last_time_are_not_getting_worse():
    history = RULES.gpu_qualify_history({}, [judge("p40-retiring")], "2026-11-28T10:00:00+00:00")
    verdict = judge("p40-retiring", history=history)
    assert verdict["getting_worse"] is False
    assert not any("getting worse" in reason for reason in verdict["reasons"])


def test_a_card_that_failed_last_time_and_passes_now_is_flagged():
    earlier = dict(judge("p40-thermal"), id="0324617040925")  # the same card, hot then, cooled since
    history = RULES.gpu_qualify_history({}, [earlier], "2026-11-28T10:00:00+00:00")
    verdict = judge("p40-healthy", history=history)
    assert verdict["verdict"] == "warn"
    assert verdict["reasons"][0].startswith("failed its last qualification (2026-11-28T10:00:00+00:00): HW Thermal")


def test_history_keeps_each_card_by_serial_with_a_bounded_trail():
    history = {}
    for day in range(1, 5):
        history = RULES.gpu_qualify_history(history, [judge("p40-healthy"), judge("p40-x8")], f"2026-12-0{day}", keep=3)
    assert sorted(history["cards"]) == ["0324617040925", "0324617041387"]
    card = history["cards"]["0324617041387"]
    assert card["last"]["checked_at"] == "2026-12-04" and card["last"]["verdict"] == "warn"
    assert [t["checked_at"] for t in card["trail"]] == ["2026-12-02", "2026-12-03", "2026-12-04"]


def test_a_card_without_serial_is_kept_by_uuid():
    card = {"serial": "N/A", "uuid": "GPU-1"}
    assert RULES.card_id(card) == "GPU-1"


# --- The role's controller part through Ansible, on fake local hosts -------------------------------------------


def run_judge(tmp_path: Path, cases: dict[str, dict], history: Path) -> dict:
    """tasks/judge.yml on fake local hosts, each given a stand-in's collected texts; {host: failure message}."""
    hosts = {
        host: {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "gpu_qualify_collected": collected(case),
        }
        for host, case in cases.items()
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    playbook = tmp_path / "judge.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Judge fake hosts' collected texts",
                    "hosts": "p40-hosts",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Judge",
                            "ansible.builtin.include_role": {"name": "gpu_qualify", "tasks_from": "judge"},
                        }
                    ],
                }
            ]
        )
    )
    envvars = {"ANSIBLE_CACHE_PLUGIN": "memory", "ANSIBLE_ROLES_PATH": str(REPO_ROOT / "roles")}
    result = run_playbook(playbook, inventory, cmdline=["-e", f"gpu_qualify_history_file={history}"], envvars=envvars)
    assert result.stats, result.stdout[-3000:]
    return {failure.host: failure.message for failure in result.failures}


def test_the_role_fails_only_the_host_with_a_failed_card_and_keeps_every_verdict(tmp_path):
    history = tmp_path / "gpu-qualify.json"
    retiring_before = standin("p40-retiring")
    retiring_before["smi_q"] = retiring_before["smi_q"].replace(
        "Single Bit ECC                    : 6", "Single Bit ECC                    : 2"
    )
    hosts = {"good": standin("p40-healthy"), "hot": standin("p40-thermal"), "slot": standin("p40-x8")}
    failed = run_judge(tmp_path, {**hosts, "aging": retiring_before}, history)
    assert sorted(failed) == ["aging", "hot"]
    assert "hot GPU 00000000:03:00.0 (Tesla P40, serial 0324617040112): fail" in failed["hot"]
    assert "HW Thermal Slowdown reached under load at a peak of 92 °C" in failed["hot"]
    assert "do: improve the airflow" in failed["hot"]
    kept = json.loads(history.read_text())
    assert oct(history.stat().st_mode & 0o777) == "0o600"
    assert {
        card: (kept["cards"][card]["last"]["host"], kept["cards"][card]["last"]["verdict"]) for card in kept["cards"]
    } == {
        "0324617040925": ("good", "pass"),
        "0324617040112": ("hot", "fail"),
        "0324617041387": ("slot", "warn"),
        "0324617040861": ("aging", "fail"),
    }
    # A second run: the retiring card (by serial) now has 6 retired pages where it had 2.
    failed = run_judge(tmp_path, {"aging": standin("p40-retiring")}, history)
    assert sorted(failed) == ["aging"]
    kept = json.loads(history.read_text())
    assert len(kept["cards"]) == 4  # the cards not qualified this time keep their records
    last = kept["cards"]["0324617040861"]
    assert last["last"]["getting_worse"] is True
    assert any(reason.startswith("getting worse since the last qualification") for reason in last["last"]["reasons"])
    assert [entry["verdict"] for entry in last["trail"]] == ["fail", "fail"]


# --- Before training: the smoke and the cluster plan refuse a failed card unless the inventory accepts it -------


def failed_history() -> dict:
    return RULES.gpu_qualify_history(
        {}, [judge("p40-thermal", host="gpu1"), judge("p40-x8", host="gpu1")], "2026-12-04T09:00:00+00:00"
    )


@pytest.mark.parametrize(
    ("host", "accept", "refused"),
    [
        ("gpu1", [], ["0324617040112"]),  # the thermal card failed; the x8 card only warned
        ("gpu1", ["0324617040112"], []),  # the inventory accepts it by serial
        ("gpu1", ["0324617041387"], ["0324617040112"]),  # accepting another card accepts nothing here
        ("gpu2", [], []),  # a host never qualified is not refused
    ],
)
def test_refusals(host, accept, refused):
    messages = RULES.gpu_qualify_refusals(failed_history(), host, accept, "/state/gpu-qualify.json")
    assert [re.search(r"serial (\S+)\)", m).group(1) for m in messages] == refused


def test_a_refusal_names_the_card_its_verdict_and_what_to_do():
    [message] = RULES.gpu_qualify_refusals(failed_history(), "gpu1", [], "/state/gpu-qualify.json")
    assert message.startswith(
        "gpu1: GPU 00000000:03:00.0 (Tesla P40, serial 0324617040112) failed its last qualification "
        "(2026-12-04T09:00:00+00:00, /state/gpu-qualify.json): HW Thermal Slowdown reached under load at a peak of "
        "92 °C (first at 92 °C);"
    )
    assert message.endswith(
        "do: fix what it names and run `p40fleet qualify -l gpu1` again, or, to train on the card anyway, add its "
        'serial to gpu_qualify_accept for gpu1 in the inventory (gpu_qualify_accept: ["0324617040112"])'
    )


def test_the_gate_through_ansible_refuses_only_the_host_with_an_unaccepted_failed_card(tmp_path):
    history = tmp_path / "gpu-qualify.json"
    history.write_text(
        json.dumps(
            RULES.gpu_qualify_history(
                {},
                [judge("p40-thermal", host="hot"), judge("p40-ecc-errors", host="kept")],
                "2026-12-04T09:00:00+00:00",
            )
        )
    )
    hosts = {
        host: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **extra}
        for host, extra in {"hot": {}, "kept": {"gpu_qualify_accept": ["0324617040318"]}, "new": {}}.items()
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    playbook = tmp_path / "gate.yml"
    gate = {"ansible.builtin.include_role": {"name": "gpu_qualify", "tasks_from": "gate"}}
    playbook.write_text(
        yaml.safe_dump(
            [{"name": "Gate", "hosts": "p40-hosts", "gather_facts": False, "tasks": [{"name": "Gate", **gate}]}]
        )
    )
    envvars = {"ANSIBLE_CACHE_PLUGIN": "memory", "ANSIBLE_ROLES_PATH": str(REPO_ROOT / "roles")}
    result = run_playbook(playbook, inventory, cmdline=["-e", f"gpu_qualify_history_file={history}"], envvars=envvars)
    assert result.stats, result.stdout[-3000:]
    failed = {failure.host: failure.message for failure in result.failures}
    assert sorted(failed) == ["hot"]
    assert "serial 0324617040112) failed its last qualification" in failed["hot"]
    assert sorted(result.stats) == ["hot", "kept", "new"]  # the accepted card's host and the new one passed


@pytest.mark.parametrize("playbook", ["playbooks/smoke.yml", "playbooks/cluster.yml"])
def test_the_smoke_and_the_cluster_plan_pass_the_gate_first(playbook):
    plays = yaml.safe_load((REPO_ROOT / playbook).read_text())
    first_tasks = plays[0].get("tasks") or []
    assert first_tasks and first_tasks[0]["ansible.builtin.include_role"] == {
        "name": "gpu_qualify",
        "tasks_from": "gate",
    }


# --- Per multi-GPU host: P2P between the cards and the NCCL setting the launch script takes ---------------------


def test_p2p_that_works_needs_no_nccl_setting():
    topology = RULES.gpu_qualify_topology(standin("topo-2x-p2p-ok"), "gpu1")
    assert topology == {
        "host": "gpu1",
        "gpus": 2,
        "pairs": [{"gpus": [0, 1], "link": "PIX", "p2p_read": "OK"}],
        "nccl_environment": {},
        "findings": [],
    }


def test_blocked_p2p_disables_it_for_nccl_with_the_iommu_hint():
    topology = RULES.gpu_qualify_topology(standin("topo-2x-p2p-blocked"), "gpu1")
    assert topology["pairs"] == [{"gpus": [0, 1], "link": "PHB", "p2p_read": "CNS"}]
    assert topology["nccl_environment"] == {"NCCL_P2P_DISABLE": "1"}
    [finding] = topology["findings"]
    assert finding["level"] == "warn"
    assert finding["reason"].startswith(
        "P2P reads do not work between GPU0-GPU1 CNS (chipset not supported, link PHB): the launch environment gets "
        "NCCL_P2P_DISABLE=1"
    )
    assert finding["do"].startswith("the IOMMU is on (intel_iommu=on in the kernel command line) without iommu=pt")


@pytest.mark.parametrize(
    ("cmdline", "hint"),
    [
        ("ro quiet intel_iommu=on iommu=pt", "check ACS on the PCIe bridges"),  # passthrough: ACS is the suspect
        ("ro quiet", "check ACS on the PCIe bridges"),
        ("ro amd_iommu=on", "the IOMMU is on (amd_iommu=on"),
    ],
)
def test_the_hint_follows_the_kernel_command_line(cmdline, hint):
    case = dict(standin("topo-2x-p2p-blocked"), cmdline=cmdline)
    assert RULES.gpu_qualify_topology(case, "gpu1")["findings"][0]["do"].startswith(hint)


def test_a_single_gpu_host_and_an_unreadable_topology():
    single = "\tGPU0\n GPU0\tX\n\nLegend:\n\n  X    = Self\n"
    alone = RULES.gpu_qualify_topology({"topo_m": single, "topo_p2p_r": single}, "gpu1")
    assert (alone["gpus"], alone["pairs"], alone["findings"]) == (1, [], [])
    unread = RULES.gpu_qualify_topology({"topo_m": "", "topo_p2p_r": "", "topo_rc": 2}, "gpu1")
    assert unread["nccl_environment"] == {} and unread["findings"][0]["reason"].startswith("nvidia-smi topo answered 2")


def test_history_keeps_each_hosts_topology_and_launch_script_hands_its_nccl_setting_to_every_play(tmp_path):
    blocked = RULES.gpu_qualify_topology(standin("topo-2x-p2p-blocked"), "twin")
    fine = RULES.gpu_qualify_topology(standin("topo-2x-p2p-ok"), "pair")
    history = RULES.gpu_qualify_history({}, [judge("p40-healthy")], "2026-12-05", topologies=[blocked, fine])
    assert history["hosts"]["twin"]["nccl_environment"] == {"NCCL_P2P_DISABLE": "1"}
    path = tmp_path / "gpu-qualify.json"
    path.write_text(json.dumps(history))
    # launch_script's own default, templated for three hosts (blocked, fine, never qualified) in a play that lists
    # the role as cluster.yml does (tags: never): site.yml's launch script and cluster.yml's Ray nodes read one value.
    hosts = {
        h: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        for h in ("twin", "pair", "new")
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    playbook = tmp_path / "nccl.yml"
    show = {
        "ansible.builtin.copy": {
            "content": "{{ launch_script_nccl_environment | to_json }}",
            "dest": f"{tmp_path}/{{{{ inventory_hostname }}}}.json",
        }
    }
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Template launch_script's NCCL setting",
                    "hosts": "p40-hosts",
                    "gather_facts": False,
                    "roles": [{"role": "launch_script", "tags": ["never"]}],
                    "tasks": [{"name": "Write it", **show}],
                }
            ]
        )
    )
    # The history by its shared name, as `p40fleet` passes it (gpu_qualify's copy follows it).
    result = run_playbook(playbook, inventory, cmdline=["-e", f"p40fleet_qualify_history_file={path}"])
    assert not result.failures, result.stdout[-3000:]
    assert {h: json.loads((tmp_path / f"{h}.json").read_text()) for h in hosts} == {
        "twin": {"NCCL_P2P_DISABLE": "1"},
        "pair": {},
        "new": {},
    }


def test_the_role_keeps_each_hosts_topology_with_its_cards(tmp_path):
    history = tmp_path / "gpu-qualify.json"
    twin = {**standin("p40-healthy"), **standin("topo-2x-p2p-blocked")}
    failed = run_judge(tmp_path, {"twin": twin, "solo": standin("p40-x8")}, history)
    assert failed == {}
    hosts = json.loads(history.read_text())["hosts"]
    assert hosts["twin"]["nccl_environment"] == {"NCCL_P2P_DISABLE": "1"}
    assert hosts["twin"]["findings"][0]["reason"].startswith("P2P reads do not work between GPU0-GPU1 CNS")
    assert hosts["solo"]["nccl_environment"] == {} and hosts["solo"]["findings"] == []


# --- A sampler that fails says why; one that samples stops with the load ---------------------------------------

REFUSED = 'Field "serial" is not a valid field to query.'


def test_a_failed_sampler_fails_every_card_in_its_own_words():
    case = collected(standin("p40-healthy"))
    [verdict] = RULES.gpu_qualify_verdicts({**case, "samples": REFUSED + "\n\n", "sampler_rc": "2"}, {}, settings())
    assert verdict["verdict"] == "fail"
    assert verdict["reasons"][0] == (
        "root's nvidia-smi stopped sampling (exit 2), so the card was not seen under load; it said: " + REFUSED
    )
    # A sampler stopped at the load's end (exit 0) is judged by its samples, as before.
    [verdict] = RULES.gpu_qualify_verdicts({**case, "sampler_rc": "0"}, {}, settings())
    assert verdict["verdict"] == "pass"


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"msg": "non-zero return code", "rc": 2, "stdout": REFUSED + "\n\n", "stderr": ""}, None),
        (
            {"msg": "non-zero return code", "rc": 9, "stdout": "", "stderr": "boom"},
            "non-zero return code (exit 9): boom",
        ),
        ({"msg": "async task did not complete within the requested time"}, None),
        ({}, "failed without a message"),
        (
            {
                "msg": "One or more items failed",
                "results": [{"failed": False}, {"failed": True, "rc": 1, "stderr": "x"}],
            },
            "failed (exit 1): x",
        ),
    ],
)
def test_a_failed_tasks_own_words(result, message):
    expected = message or (
        f"non-zero return code (exit 2): {REFUSED}"
        if "rc" in result
        else "async task did not complete within the requested time"
    )
    assert RULES.gpu_qualify_failure_message(result) == expected


def test_a_host_whose_collection_failed_is_kept_in_the_history_and_a_later_run_clears_it():
    failure = {"host": "gpu1", "task": "Collect root's samples", "message": "async task did not complete"}
    kept = RULES.gpu_qualify_history({}, [], "2026-12-07T10:00:00+00:00", failures=[failure, None])
    assert kept["hosts"]["gpu1"]["failure"] == {"checked_at": "2026-12-07T10:00:00+00:00", **failure}
    topology = RULES.gpu_qualify_topology(collected(standin("p40-healthy")), "gpu1")
    kept = RULES.gpu_qualify_history(kept, [judge("p40-healthy")], "2026-12-07T11:00:00+00:00", topologies=[topology])
    assert "failure" not in kept["hosts"]["gpu1"]


def test_the_role_on_local_hosts_stops_sampling_with_the_load_and_keeps_a_failed_samplers_words(tmp_path):
    """tasks/main.yml as root on two hosts of the controller: root's nvidia-smi is the sandbox's stand-in (one
    recorded card), the load sleeps 2 s as nobody. `good`'s sampler is stopped when the load ends (it would loop
    for the load's 2 s + 60 s otherwise); `broken`'s nvidia-smi refuses the sample fields, and its verdict and the
    history say so in nvidia-smi's words; `nolog`'s kernel log cannot be read: no card is judged, and the history
    keeps the host's failure."""
    hosts = {}
    for host, name, fields in (
        ("good", "p40-healthy", None),
        ("broken", "p40-x8", ["index", "serial"]),
        ("nolog", "p40-thermal", None),
    ):
        case = standin(name)
        scenario = {**case, "samples_fields": fields or RULES.sample_fields(case["reasons_prefix"]), "cards": 1}
        (tmp_path / f"{host}.json").write_text(json.dumps(scenario))
        (tmp_path / f"{host}.log").write_text(case["kernel_log"])
        smi = tmp_path / f"{host}-nvidia-smi"
        smi.write_text(
            f"#!/bin/sh\nP40FLEET_QUALIFY_SCENARIO={tmp_path / f'{host}.json'} exec {sys.executable} "
            f'{STANDINS / "nvidia-smi"} "$@"\n'
        )
        smi.chmod(0o755)
        hosts[host] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become_method": "ansible.builtin.su",
            "gpu_qualify_nvidia_smi": str(smi),
            "gpu_qualify_python": sys.executable,
            "gpu_qualify_kernel_log_command": ["/bin/cat", str(tmp_path / f"{host}.log")],
        }
    hosts["nolog"]["gpu_qualify_kernel_log_command"] = ["/bin/cat", str(tmp_path / "no-such.log")]
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    playbook = tmp_path / "qualify.yml"
    playbook.write_text(
        yaml.safe_dump([{"name": "Qualify", "hosts": "p40-hosts", "gather_facts": False, "roles": ["gpu_qualify"]}])
    )
    history = tmp_path / "gpu-qualify.json"
    variables = {
        "gpu_qualify_history_file": str(history),
        "gpu_qualify_load_user": "nobody",
        "gpu_qualify_load_command": [
            "/usr/bin/python3",
            "-I",
            "-c",
            "import sys, time; time.sleep(float(sys.argv[-1]))",
        ],
        "gpu_qualify_seconds": 2,
        "gpu_qualify_sample_interval": 1,
    }
    envvars = {"ANSIBLE_CACHE_PLUGIN": "memory", "ANSIBLE_ROLES_PATH": str(REPO_ROOT / "roles")}
    started = time.monotonic()
    result = run_playbook(playbook, inventory, extravars=variables, envvars=envvars)
    took = time.monotonic() - started
    failed = {f.host: f.message for f in result.failures}
    assert set(failed) == {"broken", "nolog"}, result.stdout[-3000:]
    assert (
        'root\'s nvidia-smi stopped sampling (exit 2), so the card was not seen under load; it said: Field "index"'
        in (failed["broken"])
    )
    kept = json.loads(history.read_text())
    verdicts = {entry["last"]["host"]: entry["last"] for entry in kept["cards"].values()}
    assert verdicts["broken"]["verdict"] == "fail"
    assert 'Field "index" is not a valid field to query.' in verdicts["broken"]["reasons"][0]
    assert verdicts["good"]["verdict"] == "pass" and "nolog" not in verdicts
    assert failed["nolog"].startswith(
        'nolog: qualify stopped at "Read root\'s nvidia-smi -q and the kernel log since boot", no card'
    )
    assert "no-such.log: No such file or directory" in failed["nolog"]
    assert "no-such.log: No such file or directory" in kept["hosts"]["nolog"]["failure"]["message"]
    # The sampler ended with the 2 s load, not 60 s after it: collecting its samples waited for nothing.
    [collect] = [
        e["event_data"]
        for e in result.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("host") == "good"
        and e["event_data"].get("task") == "Collect root's samples"
    ]
    assert collect["duration"] < 20, f"the samples came {collect['duration']:.0f} s after the load (run: {took:.0f} s)"

"""The real qualification records (docs/gpu-runs/qualify/, written by python/tests/gpu/qualify_check.py on a CUDA
machine): each holds what the card did under load, and its verdicts are the ones the role's filter gives today for
the texts it recorded (root's nvidia-smi -q, the samples, the kernel log's Xid lines)."""

from __future__ import annotations

import json

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

pytestmark = pytest.mark.unit

RECORDS = sorted((REPO_ROOT / "docs" / "gpu-runs" / "qualify").glob("qualify-*.json"))
RULES = load_module(REPO_ROOT / "plugins" / "filter" / "gpu_qualify.py", "gpu_qualify_rules")
CHECK = load_module(REPO_ROOT / "python" / "tests" / "gpu" / "qualify_check.py", "gpu_qualify_check")


def records():
    assert RECORDS, (
        "no record in docs/gpu-runs/qualify/: run python/tests/gpu/qualify_check.py --out DIR on a CUDA machine (as "
        "root, a Python with CUDA torch) and commit its JSON there"
    )
    return [json.loads(path.read_text()) for path in RECORDS]


def test_a_record_holds_what_the_cards_did_under_load():
    for record in records():
        assert record["schema"] == CHECK.SCHEMA
        assert record["problems"] == [], record["problems"]
        assert record["load_rc"] == 0 and record["seconds"] >= 30
        assert record["reasons_field"] in RULES.REASON_PREFIXES
        assert record["cards"], "a record of no card"
        for card in record["cards"]:
            seen = card["under_load"]
            assert card["verdict"] in RULES.LEVELS and (card["serial"] or card["uuid"])
            assert seen["loaded_samples"] >= 3, "the load never reached the card"
            assert seen["temperature_c"]["max"] >= seen["temperature_c"]["min"] > 0
            assert seen["sm_clock_mhz"]["min_loaded"] > 0 and seen["sm_clock_mhz"]["card_max"] > 0
            assert seen["power_w"]["max"] > 0 and seen["power_w"]["limit"] > 0
            assert isinstance(seen["throttle_reasons_seen"], list)
            assert seen["pcie_under_load"]["width"] and seen["pcie_under_load"]["width_max"]
            assert seen["ecc_mode"] in ("Enabled", "Disabled")


def test_a_records_verdicts_are_the_filters_for_its_texts():
    for record in records():
        again = RULES.gpu_qualify_verdicts(record["collected"], {}, record["settings"])
        assert [(v["id"], v["verdict"], v["reasons"]) for v in again] == [
            (c["id"], c["verdict"], c["reasons"]) for c in record["cards"]
        ]


def test_the_checks_settings_are_the_roles_defaults():
    import yaml

    defaults = yaml.safe_load((REPO_ROOT / "roles" / "gpu_qualify" / "defaults" / "main.yml").read_text())
    settings = CHECK.role_settings("gpu1")
    for key in ("max_temperature_c", "load_min_utilization", "min_loaded_samples", "retired_pages_max", "xid_fail"):
        assert settings[key] == defaults[f"gpu_qualify_{key}"]
    assert settings["xid_meaning"] == defaults["gpu_qualify_xid_meaning"]


def test_the_check_on_a_stand_in_card_writes_a_record_the_filter_holds(tmp_path, monkeypatch):
    """qualify_check.py itself, against the stand-in nvidia-smi answering from the retiring P40's recording and a
    stand-in load (a Python that only exits): the record it writes passes the record tests' own checks."""
    import yaml

    case = yaml.safe_load((REPO_ROOT / "python/tests/fixtures/standins/gpu_qualify/p40-retiring.yml").read_text())
    scenario = tmp_path / "qualify.json"
    scenario.write_text(json.dumps({**case, "samples_fields": RULES.sample_fields(case["reasons_prefix"])}))
    monkeypatch.setenv("P40FLEET_QUALIFY_SCENARIO", str(scenario))
    monkeypatch.setattr(CHECK, "kernel_log", lambda: (case["kernel_log"], "stand-in"))
    load = tmp_path / "python"
    load.write_text("#!/bin/sh\necho 'torch 2.6.0 12.4'\n")
    load.chmod(0o755)
    smi = REPO_ROOT / "python/tests/fixtures/standins/gpu_qualify/nvidia-smi"
    out = tmp_path / "out"
    rc = CHECK.main(
        ["--seconds", "1", "--interval", "1", "--out", str(out), "--nvidia-smi", str(smi), "--python", str(load)]
    )
    [path] = out.glob("qualify-tesla-p40-*.json")
    record = json.loads(path.read_text())
    assert rc == 0 and record["problems"] == []
    [card] = record["cards"]
    assert card["verdict"] == "fail" and card["serial"] == "0324617040861"
    assert card["under_load"]["temperature_c"] == {"min": 37, "max": 69}
    assert card["under_load"]["retired_pages"] == {"sbe": 6, "dbe": 0, "pending": True}
    again = RULES.gpu_qualify_verdicts(record["collected"], {}, record["settings"])
    assert [v["reasons"] for v in again] == [card["reasons"]]


def test_the_check_is_loud_where_the_driver_names_a_field_otherwise(tmp_path, monkeypatch, capsys):
    import yaml

    case = yaml.safe_load((REPO_ROOT / "python/tests/fixtures/standins/gpu_qualify/p40-healthy.yml").read_text())
    # A driver whose -q calls the link width something else: the rules would read no width, so no x8 warning.
    case["smi_q"] = case["smi_q"].replace("Link Width", "Link Lanes")
    scenario = tmp_path / "qualify.json"
    scenario.write_text(json.dumps({**case, "samples_fields": RULES.sample_fields(case["reasons_prefix"])}))
    monkeypatch.setenv("P40FLEET_QUALIFY_SCENARIO", str(scenario))
    monkeypatch.setattr(CHECK, "kernel_log", lambda: ("", "stand-in"))
    load = tmp_path / "python"
    load.write_text("#!/bin/sh\n")
    load.chmod(0o755)
    smi = REPO_ROOT / "python/tests/fixtures/standins/gpu_qualify/nvidia-smi"
    rc = CHECK.main(
        ["--seconds", "1", "--interval", "1", "--out", str(tmp_path), "--nvidia-smi", str(smi), "--python", str(load)]
    )
    assert rc == 1
    assert "PROBLEM: GPU 00000000:03:00.0 (Tesla P40): nvidia-smi -q gave no PCI/GPU Link Info/Link Width/Max" in (
        capsys.readouterr().err
    )

"""The schedule and the run-time estimate `train_gsm8k_ppo.sh --print` states (plugins/filter/
launch_script_estimate.py, docs/estimate.md): the calibration against the GPU record, the datasheet table, the
schedule's arithmetic and where the cost model gives no estimate.
"""

from __future__ import annotations

import json

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import preflight_profile
from tests.source_modules import load_module
from tests.test_launch_script_settings import INPUTS

ROLE = REPO_ROOT / "roles" / "launch_script"
ESTIMATE = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script_estimate.py", "launch_script_estimate_filters")
SETTINGS = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_estimate_settings")
RECORD = json.loads((REPO_ROOT / "docs" / "gpu-runs" / "p40-1x.json").read_text())
# The rendering the record ran (the role's defaults on a 1x P40: batch 256, prompts padded to 256, 256 response
# tokens, 256 prompts a generate call; --smoke's batch is two micro batches of 8).
SHAPE = {"batch": 256, "smoke_batch": 16, "prompt": 256, "response": 256, "rollout_micro": 256}
MODEL_PATH = "/srv/models/Qwen2.5-0.5B-Instruct"
RUN = {
    "train_batch_size": 256,
    "max_prompt_length": 256,
    "max_response_length": 256,
    "total_epochs": 15,
    "train_rows": 7473,
    "test_rows": 1319,
    "test_freq": 29,
    "checkpoints_kept": 2,
    "model_path": MODEL_PATH,
}
P40 = preflight_profile("Tesla P40", "6.1", 24576, 1)


def estimate(profile=P40, run=None, **inputs):
    settings = SETTINGS.launch_script_settings(profile, {**INPUTS, **inputs})
    return ESTIMATE.launch_script_estimate(profile, settings, {**RUN, **(run or {})})


def test_the_constants_are_the_calibration_on_the_record():
    assert RECORD["gpu"] == "NVIDIA H100 80GB HBM3" and RECORD["dtype"] == "float32" and RECORD["tf32"] is False
    assert RECORD["model"]["parameters"] == ESTIMATE.MODELS["Qwen2.5-0.5B-Instruct"]["parameters"]
    fitted = ESTIMATE.calibrate(RECORD, SHAPE)
    constants = {**ESTIMATE.EFFICIENCY, **ESTIMATE.DECODE}
    assert set(fitted) == set(constants)
    for key, value in constants.items():
        assert value == pytest.approx(fitted[key], rel=0.01), (key, fitted[key])


def test_the_model_gives_back_the_record_s_phases_on_the_calibration_card():
    card = ESTIMATE.find_card(RECORD["gpu"])
    model = ESTIMATE.MODELS["Qwen2.5-0.5B-Instruct"]
    args = (SHAPE["prompt"], SHAPE["response"], SHAPE["rollout_micro"])
    for run, batch in (("full_batch", SHAPE["batch"]), ("smoke", SHAPE["smoke_batch"])):
        phases = ESTIMATE.step_phases(model, card, batch, *args)
        measured = RECORD["runs"][run]["last_metrics"]
        assert phases["gen"] == pytest.approx(measured["timing_s/gen"], rel=0.02), run
        if run == "full_batch":
            for phase in ESTIMATE.EFFICIENCY:
                assert phases[phase] == pytest.approx(measured[f"timing_s/{phase}"], rel=0.02), phase


@pytest.mark.parametrize(
    ("gpu_name", "name", "fp32", "fp16", "bandwidth"),
    [
        ("Tesla P40", "Tesla P40", 11.8, 0.18, 346),
        ("Tesla P100-PCIE-16GB", "Tesla P100 (PCIe)", 9.3, 18.7, 732),
        ("Tesla P4", "Tesla P4", 5.5, 0.09, 192),
        ("Tesla T4", "Tesla T4", 8.1, 65.0, 320),
        ("Tesla V100-SXM2-32GB", "Tesla V100 (SXM2)", 15.7, 125.0, 900),
        ("NVIDIA A100-SXM4-40GB", "A100 (40 GB)", 19.5, 312.0, 1555),
        ("NVIDIA H200", "H200 (SXM)", 67.0, 989.0, 4800),
        ("NVIDIA H100 80GB HBM3", "H100 (SXM)", 67.0, 989.0, 3350),
    ],
)
def test_the_datasheet_table(gpu_name, name, fp32, fp16, bandwidth):
    assert ESTIMATE.find_card(gpu_name) == {"name": name, "fp32": fp32, "fp16": fp16, "bandwidth": bandwidth}


def test_an_unknown_card_has_no_figures():
    assert ESTIMATE.find_card("Tesla K80") is None and ESTIMATE.find_card(None) is None


@pytest.mark.parametrize(
    ("run", "inputs", "expected"),
    [
        # The defaults: 15 epochs of 29 steps, validation before step 1 and once an epoch (the last step is one).
        ({}, {}, {"steps": 435, "validations": 16, "saves": 15, "kept": 2, "checkpoint_gib": 11.0, "disk_gib": 22.1}),
        ({"test_freq": 10}, {}, {"validations": 45}),
        ({"test_freq": -1}, {}, {"validations": 0}),
        ({"total_epochs": 1}, {"save_freq": 10}, {"steps": 29, "saves": 3, "kept": 2}),
        ({"checkpoints_kept": 0}, {}, {"kept": 15, "disk_gib": 165.6}),
        ({"model_path": "/srv/models/other"}, {}, {"checkpoint_gib": None, "disk_gib": None}),
    ],
)
def test_the_schedule(run, inputs, expected):
    plan = estimate(run=run, **inputs)["schedule"]
    assert {key: plan[key] for key in expected} == expected


def test_the_default_p40_run_is_estimated_and_called_an_estimate():
    one = estimate()
    assert one["why"] == "" and one["estimate"]["card"] == "Tesla P40"
    step = one["estimate"]["step_seconds"]
    assert step == pytest.approx(sum(one["estimate"]["phases"].values()), abs=0.5)
    assert one["estimate"]["total_seconds"] == pytest.approx(
        435 * step + 16 * one["estimate"]["validation_seconds"], rel=0.001
    )
    text = "\n".join(one["lines"])
    assert text.startswith("schedule: 435 steps") and "estimate for 1x Tesla P40" in text
    assert "docs/estimate.md" in text and "--smoke" in text
    # A second P40 halves each GPU's share of the batch.
    two = estimate(profile=preflight_profile("Tesla P40", "6.1", 24576, 2))["estimate"]
    assert two["step_seconds"] == pytest.approx(step / 2, rel=0.05)
    # Shorter padded prompts cost less in every phase.
    short = estimate(run={"max_prompt_length": 128})["estimate"]
    assert all(short["phases"][k] < one["estimate"]["phases"][k] for k in short["phases"])


@pytest.mark.parametrize(
    ("profile", "run", "inputs", "why"),
    [
        ({**P40, "gpu_name": "Quadro P6000"}, {}, {}, "no datasheet figures for Quadro P6000"),
        (P40, {"model_path": "/srv/models/other"}, {}, "no shape known for the model /srv/models/other"),
        (P40, {}, {"rollout_name": "vllm"}, "the cost model covers the hf rollout on padded sequences only"),
        (P40, {}, {"use_remove_padding": True}, "the cost model covers the hf rollout on padded sequences only"),
        (P40, {}, {"param_dtype": "bf16"}, "the cost model is calibrated on fp32 training only"),
    ],
)
def test_no_estimate_where_the_model_does_not_reach(profile, run, inputs, why):
    got = estimate(profile=profile, run=run, **inputs)
    assert got["estimate"] is None and got["why"] == why
    assert got["lines"][-1].startswith(f"estimate: none ({why})")

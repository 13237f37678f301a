"""The rendered P40 defaults are the step-time sweep's winner (docs/gpu-runs/sweep/p40-1x.json, tests/gpu/sweep.py).

Today's 1x P40 rendering must be one of the configurations the sweep ran (compared key by key, schedule and paths
left out), it must have fit the cap with the margin, and its seconds per step must be within 10% of the fastest
configuration that fit. A change of a default that the sweep did not run fails here until the sweep runs again
(Makefile `gpu-sweep`, then `gpu-records`).
"""

from __future__ import annotations

import json

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.gpu.cases import CASES
from tests.gpu.sweep import ATTENTION, effective
from tests.launch_render import render

RECORD = json.loads((REPO_ROOT / "docs" / "gpu-runs" / "sweep" / "p40-1x.json").read_text())


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    today, _ = render({"p40-1x": CASES["p40-1x"].host()}, tmp_path_factory.mktemp("gpu-sweep"))
    # The attention kernel is the patch set's (verl_patches), not an override: the profile names it.
    return {**effective(today["p40-1x"].overrides), ATTENTION: CASES["p40-1x"].profile["attn_implementation"]}


def test_the_sweep_ran_and_says_what_fits():
    configs = RECORD["configs"]
    assert configs["rendered"]["ran"], configs["rendered"].get("error")
    assert RECORD["margin_gib"] < RECORD["memory_cap_gib"]
    for name, figures in configs.items():
        fits = figures["ran"] and figures["torch_peak_reserved_gib"] <= RECORD["margin_gib"]
        assert figures["fits"] == fits, name
        assert figures["fits"] or figures.get("error") or figures["torch_peak_reserved_gib"] > RECORD["margin_gib"]
    fitting = {n: f["seconds_per_step"] for n, f in configs.items() if f["fits"]}
    assert RECORD["fastest_fitting"] == min(fitting, key=fitting.get)


def test_today_s_p40_rendering_is_a_swept_configuration_within_ten_percent_of_the_fastest(rendered):
    configs = RECORD["configs"]
    same = [name for name, figures in configs.items() if figures["effective_overrides"] == rendered]
    if not same:

        def differing(name):
            return sorted(set(configs[name]["effective_overrides"].items()) ^ set(rendered.items()))

        closest = min(configs, key=lambda n: len(differing(n)))
        differ = differing(closest)
        pytest.fail(f"today's P40 rendering is no configuration of the sweep; closest {closest}, differing: {differ}")
    (name,) = same
    chosen = configs[name]
    fastest = configs[RECORD["fastest_fitting"]]["seconds_per_step"]
    assert chosen["fits"], f"{name}: {chosen['torch_peak_reserved_gib']} GiB over the {RECORD['margin_gib']} margin"
    assert chosen["seconds_per_step"] <= 1.10 * fastest, (name, chosen["seconds_per_step"], fastest)

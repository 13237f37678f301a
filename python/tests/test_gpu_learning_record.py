"""The learning proof's tools on the CPU (python/tests/gpu/run_check.py, records.py): how a run of the proof or a
variant beside it is named, and what the record keeps of the proof, its variants and its second warm start."""

from __future__ import annotations

import sys

import pytest

from p40fleet_dev.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "python" / "tests" / "gpu"))
# tests/gpu's scripts run on the GPU machine as scripts, beside each other: imported the same way here.
import run_check

from tests.gpu import records


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("p40-1x", ("p40-1x", "p40-1x", [])),
        (
            "lr7=p40-1x;actor_rollout_ref.actor.optim.lr=7e-5",
            ("lr7", "p40-1x", ["actor_rollout_ref.actor.optim.lr=7e-5"]),
        ),
        # An override's own "=" never names the run.
        ("a100-1x;trainer.critic_warmup=5;x=1", ("a100-1x", "a100-1x", ["trainer.critic_warmup=5", "x=1"])),
    ],
)
def test_a_learning_entry_names_its_run_case_and_overrides(entry, expected):
    assert run_check.learn_entry(entry) == expected


def results(seed: int, runs: dict) -> dict:
    curves = {"validation": {"0": 0.3, "10": 0.45}, "train": {}, "steps_done": 10, "seconds_per_step": {}}
    return {
        "finished": f"2026-12-06T0{seed}:00:00+00:00",
        "machine": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0"},
        "learning": {
            "ok": True,
            "warm_start": {"seed": seed, "greedy_accuracy": 0.3},
            "runs": {
                name: {
                    **extra,
                    "rc": 0,
                    "wall_seconds": 1.0,
                    "profile": "pascal",
                    "dtype": "float32",
                    "cap_gib": 23,
                    "overrides_digest": "d",
                    "patch_set": "p",
                    "curves": curves,
                }
                for name, extra in runs.items()
            },
        },
    }


MANIFEST = {"verl_version": "0.4.1", "cases": {"p40-1x": {}, "a100-1x": {}}}
VARIANT = {"case": "p40-1x", "extra_overrides": ["actor_rollout_ref.actor.optim.lr=7e-5"]}


def test_the_record_keeps_the_proof_its_variants_beside_and_the_second_warm_start():
    first = results(0, {"p40-1x": {}, "a100-1x": {}, "lr7": VARIANT})
    second = results(1, {"p40-1x": {}, "a100-1x": {}})
    record = records.learning_record(first, MANIFEST, [second])
    assert set(record["runs"]) == {"p40-1x", "a100-1x"}
    assert set(record["beside"]) == {"lr7"}
    assert record["beside"]["lr7"]["extra_overrides"] == VARIANT["extra_overrides"]
    assert "extra_overrides" not in record["runs"]["p40-1x"]
    (repeat,) = record["repeats"]
    assert repeat["warm_start"]["seed"] == 1 and set(repeat["runs"]) == {"p40-1x", "a100-1x"}
    assert record["warm_start"]["seed"] == 0


def test_a_proof_that_did_not_run_through_makes_no_record():
    failed = results(0, {"p40-1x": {}, "a100-1x": {}})
    failed["learning"] = {"ok": False, "error": "RuntimeError('cuda')"}
    with pytest.raises(SystemExit, match="did not run through"):
        records.learning_record(results(0, {"p40-1x": {}, "a100-1x": {}}), MANIFEST, [failed])

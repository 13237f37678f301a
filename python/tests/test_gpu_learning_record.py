"""The learning proof's tools on the CPU (python/tests/gpu/learning.py, run_check.py, records.py): how a run of the
proof is named, what the record keeps of each warm start, what it takes for the proof to pass, and a dry run of the
GPU call's CPU path (data, overlap, warm start, fine-tuning-only continuation) in the CPU venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.source_modules import owner_script_text

sys.path.insert(0, str(REPO_ROOT / "python" / "tests" / "gpu"))
# tests/gpu's scripts run on the GPU machine as scripts, beside each other: imported the same way here.
import learning
import run_check

from tests.gpu import records
from tests.gpu.bundle import DATA_TOOL
from tests.test_cpu_verl import HF_ROLLOUT, patched_verl


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("p40-1x", ("p40-1x", "p40-1x", "", [])),
        ("control=p40-1x@positions-unfixed", ("control", "p40-1x", "positions-unfixed", [])),
        (
            "lr7=p40-1x;actor_rollout_ref.actor.optim.lr=7e-5",
            ("lr7", "p40-1x", "", ["actor_rollout_ref.actor.optim.lr=7e-5"]),
        ),
        # An override's own "=" never names the run.
        ("a100-1x;trainer.critic_warmup=5;x=1", ("a100-1x", "a100-1x", "", ["trainer.critic_warmup=5", "x=1"])),
    ],
)
def test_a_learning_entry_names_its_run_case_tree_and_overrides(entry, expected):
    assert run_check.learn_entry(entry) == expected


def test_a_learning_entry_on_an_unknown_tree_is_refused():
    with pytest.raises(SystemExit, match="no verl tree 'positions'"):
        run_check.learn_entry("control=p40-1x@positions")


def test_the_make_target_s_command_line_parses():
    """`make gpu-learn` as the GPU machine runs it: its flags, runs and seeds are run_check's."""
    dry = subprocess.run(
        ["make", "-n", "-o", "gpu-bundle", "gpu-learn"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    line = dry.split("run_check.py", 1)[1].replace("\\\n", " ")
    args = run_check.arguments().parse_args(line.split())
    assert args.cases == "none" and [int(s) for s in args.learn_seeds.split(",")] == list(learning.SEEDS)
    runs = [run_check.learn_entry(e) for e in args.learn.split(",")]
    assert runs == [("p40-1x", "p40-1x", "", []), ("control", "p40-1x", "positions-unfixed", [])]


def curve(values: list[float], every: int = learning.VAL_EVERY) -> dict:
    return {str(i * every): v for i, v in enumerate(values)}


FLAT = [0.38] * 7
RISING = [0.38, 0.42, 0.46, 0.50, 0.52, 0.53, 0.54]
ZERO = [0.0] * 7


def run(validation: list[float], extra=(), tree="", steps=learning.STEPS) -> dict:
    return {
        "case": "p40-1x",
        "tree": tree,
        "tree_files": {HF_ROLLOUT: "e" * 64} if tree else {},
        "extra_overrides": list(extra),
        "argv": learning.SCHEDULE + list(extra),
        "rc": 0,
        "wall_seconds": 1.0,
        "profile": "pascal",
        "dtype": "float32",
        "cap_gib": 23,
        "overrides_digest": "d",
        "patch_set": "p",
        "curves": {"validation": curve(validation), "train": {}, "steps_done": steps, "seconds_per_step": {}},
    }


def warm_start(seed: int, p40=RISING, control=ZERO, tuned=FLAT, plateau=True, **beside) -> dict:
    selection = {"plateau": plateau, "in_band": True, "stopped": "plateau in the band"}
    runs = {"p40-1x": run(p40), "control": run(control, tree="positions-unfixed")}
    runs |= {name: run(RISING, extra) for name, extra in beside.items()}
    return {
        "warm_start": {"seed": seed, "greedy_accuracy": p40[0], "selection": selection},
        "fine_tuning_only": {"validation": curve(tuned)},
        "runs": runs,
    }


def results(*entries) -> dict:
    return {
        "finished": "2026-12-07T06:00:00+00:00",
        "machine": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0"},
        "learning": {
            "ok": True,
            "argv": ["--learn", "p40-1x,control=p40-1x@positions-unfixed", "--learn-seeds", "0,1,2"],
            "seeds": [e["warm_start"]["seed"] for e in entries],
            "data": {"overlap": {"validation_in_sft": 0, "validation_in_ppo": 0}},
            "warm_starts": {str(e["warm_start"]["seed"]): e for e in entries},
        },
    }


MANIFEST = {"verl_version": "0.4.1", "cases": {"p40-1x": {"patch_record": {}}, "a100-1x": {}}}
LR7 = ["actor_rollout_ref.actor.optim.lr=7e-5"]


def test_the_record_keeps_each_warm_start_its_runs_variants_and_the_schedule_the_runs_passed():
    found = records.learning_record(results(warm_start(0, lr7=LR7), warm_start(1), warm_start(2)), MANIFEST)
    assert [w["seed"] for w in found["warm_starts"]] == [0, 1, 2]
    first = found["warm_starts"][0]
    assert set(first["runs"]) == {"p40-1x", "control"} and set(first["beside"]) == {"lr7"}
    assert first["beside"]["lr7"]["extra_overrides"] == LR7
    # The control imported the case's patched files but the one its tree edits.
    assert first["runs"]["control"]["patched_files"] == {HF_ROLLOUT: "e" * 64}
    assert found["passed_through"] == learning.SCHEDULE and found["steps"] == learning.STEPS
    assert found["validation_every"] == learning.VAL_EVERY
    assert found["argv"][-1] == "0,1,2" and found["acceptance"]["ok"]


def test_runs_that_passed_different_schedules_make_no_record():
    other = warm_start(1)
    other["runs"]["control"]["argv"] = learning.SCHEDULE[:-1]
    with pytest.raises(SystemExit, match="different schedules"):
        records.learning_record(results(warm_start(0), other, warm_start(2)), MANIFEST)


def test_a_proof_that_did_not_run_through_makes_no_record():
    failed = results(warm_start(0))
    failed["learning"] = {"ok": False, "error": "RuntimeError('cuda')"}
    with pytest.raises(SystemExit, match="did not run through"):
        records.learning_record(failed, MANIFEST)


@pytest.mark.parametrize(
    ("entries", "ok", "counting"),
    [
        ([warm_start(0), warm_start(1), warm_start(2)], True, 3),
        # Two of three is enough; the third is recorded whatever it gave.
        ([warm_start(0), warm_start(1), warm_start(2, p40=FLAT)], True, 2),
        ([warm_start(0), warm_start(1, p40=FLAT), warm_start(2, p40=FLAT)], False, 1),
        # Fine-tuning alone rose as much: the rise is not PPO's.
        ([warm_start(0, tuned=RISING), warm_start(1, tuned=RISING), warm_start(2)], False, 1),
        # A warm start chosen mid-rise does not count.
        ([warm_start(0, plateau=False), warm_start(1, plateau=False), warm_start(2)], False, 1),
        # A control that rises anywhere: the proof no longer tells them apart.
        ([warm_start(0), warm_start(1), warm_start(2, control=RISING)], False, 2),
        # Three warm starts, three seeds.
        ([warm_start(0), warm_start(1)], False, 2),
        ([warm_start(0), warm_start(1), warm_start(1)], False, 3),
    ],
)
def test_the_acceptance_is_two_of_three_plateaued_warm_starts_and_every_control_flat(entries, ok, counting):
    found = learning.accepted(entries)
    assert (found["ok"], found["counting"]) == (ok, counting), found


def test_a_run_cut_short_does_not_count():
    short = warm_start(0)
    short["runs"]["p40-1x"]["curves"]["steps_done"] = learning.STEPS - 1
    assert not learning.verdict(short)["counts"]
    assert learning.verdict(warm_start(0))["counts"]


@pytest.mark.parametrize(
    ("accuracies", "plateau", "in_band", "past"),
    [
        ([0.38, 0.39, 0.37, 0.38, 0.39, 0.38, 0.38], True, True, False),
        # Mid-rise (the record's seed 0 before: 17 -> 34 -> 42%): no plateau, whatever the mean.
        ([0.17, 0.22, 0.28, 0.34, 0.38, 0.42, 0.44], False, True, False),
        ([0.55, 0.56, 0.55, 0.56, 0.55, 0.56, 0.55], True, False, True),
        # Too few evaluations for the window.
        ([0.38, 0.38, 0.38], False, True, False),
    ],
)
def test_a_plateau_is_a_full_window_whose_fitted_rise_is_within_noise(accuracies, plateau, in_band, past):
    history = [{"step": 100 + i * learning.SFT_EVERY, "greedy_accuracy": a} for i, a in enumerate(accuracies)]
    found = learning.plateau(history, learning.WARM_LOW, learning.WARM_HIGH)
    assert (found["plateau"], found["in_band"], found["past_band"]) == (plateau, in_band, past), found


def test_the_weak_teacher_drops_carries():
    assert learning.dropped_carry(37, 45) == 72 and learning.dropped_carry(95, 24) == 19
    assert learning.dropped_carry(12, 30) == 42 and not learning.carries(12, 30) and learning.carries(95, 24)
    assert learning.numbers("Ann has 12 coins and gets 3 bags with 4 coins in each.") == (12, 3, 4)


def test_the_control_takes_back_exactly_the_positions_entry(tmp_path):
    """learning.TREES' control edit on the hf_rollout.py the role patches is, byte for byte, that file patched
    without the hf-rollout-positions entry (test_cpu_verl.py shows what that file does on a CPU)."""
    tree, applied = patched_verl(tmp_path / "fixed")
    assert "hf-rollout-positions" in applied
    (rel, (old, new)), *others = learning.TREES["positions-unfixed"].items()
    assert rel == HF_ROLLOUT and not others
    text = (tree / rel).read_text()
    assert text.count(old) == 1
    unfixed, applied = patched_verl(tmp_path / "unfixed", skip={"hf-rollout-positions"})
    assert "hf-rollout-positions" not in applied
    assert text.replace(old, new) == (unfixed / rel).read_text()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The GPU call's CPU path at a dry run's sizes, in the CPU venv (python/tests/cpu/learning_dry_run.py)."""
    work = tmp_path_factory.mktemp("learning-dry-run")
    (work / "bundle" / "tools").mkdir(parents=True)
    (work / "bundle" / "tools" / DATA_TOOL.name).write_text(owner_script_text(DATA_TOOL) + "\n")
    with tarfile.open(UPSTREAM_DIR / "sdist" / "verl-0.4.1.tar.gz") as sdist:
        rule = sdist.extractfile("verl-0.4.1/verl/utils/reward_score/gsm8k.py").read()
    (work / "gsm8k.py").write_bytes(rule)
    done = subprocess.run(
        [
            str(cpu_venv.python()),
            str(REPO_ROOT / "python" / "tests" / "cpu" / "learning_dry_run.py"),
            str(work / "run"),
            str(work / "bundle"),
            str(work / "gsm8k.py"),
        ],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(work), "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "0"},
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_validation_problems_are_disjoint_in_content_from_every_training_row(dry_run):
    overlap = dry_run["overlap"]
    assert overlap["validation_problems"] == learning.VAL_ROWS
    assert overlap["validation_in_sft"] == overlap["validation_in_ppo"] == 0
    assert overlap["selection_in_sft"] == 0 and overlap["validation_questions_in_training"] == 0


def test_the_fine_tuning_rows_slip_only_on_carries(dry_run):
    teacher = dry_run["teacher"]
    assert teacher["rows"] == learning.SFT_ROWS and teacher["not_carrying_wrong"] == 0
    # About TEACHER_SLIP of the carrying sums, and the share without a carry (the plateau's level) in the band.
    assert abs(teacher["carrying_wrong"] / teacher["carrying"] - learning.TEACHER_SLIP) < 0.02
    assert learning.WARM_LOW < 1 - teacher["carrying"] / teacher["rows"] < learning.WARM_HIGH


def test_the_warm_start_and_the_continuation_run_and_report(dry_run):
    warm, tuned = dry_run["warm_start"], dry_run["fine_tuning_only"]
    assert warm["sft_steps"] == learning.TINY["max_steps"] and warm["device"] == "cpu"
    assert warm["selection"]["stopped"] == "step limit" and not warm["selection"]["plateau"]
    assert set(tuned["validation"]) == {"0", str(learning.VAL_EVERY)}
    assert tuned["from_sft_step"] == warm["sft_steps"] and tuned["samples"] == learning.VAL_EVERY * learning.TRAIN_BATCH
    assert dry_run["logs"] == ["learn-tuned-2.log", "learn-warm-2.log"]


def test_the_schedule_s_steps_and_validation_are_learning_py_s():
    keys = dict(o.split("=", 1) for o in learning.SCHEDULE)
    assert int(keys["trainer.total_training_steps"]) == learning.STEPS
    assert int(keys["trainer.test_freq"]) == learning.VAL_EVERY
    assert int(keys["data.train_batch_size"]) == learning.TRAIN_BATCH

"""train_run's decisions, table-tested without hosts: a run's progress from its log (verl 0.4.1's console metric
lines, printed by the stand-in trainer python/tests/fixtures/standins/trainer/verl_standin.py here, and forged or
garbled ones), the host's boot identity, the unit's name and command words, and the state `status` reports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "train_run.py", "train_run_filter")
STANDIN = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "trainer" / "verl_standin.py"
READER = REPO_ROOT / "roles" / "train_run" / "files" / "p40fleet_train_read.py"


def standin(tmp_path, *args):
    done = subprocess.run(
        [
            sys.executable,
            str(STANDIN),
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "+standin.step_seconds=0",
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_progress_of_a_finished_run(tmp_path):
    log = standin(tmp_path, "trainer.total_training_steps=12", "trainer.save_freq=5", "trainer.test_freq=4")
    progress = RULES.train_run_progress(log, now=1000)
    assert progress["step"] == 12 and progress["total_steps"] == 12
    assert progress["checkpoint_step"] == 12 and progress["val_step"] == 12
    assert 0 < progress["train_score"] <= 1 and 0 <= progress["val_score"] <= 1
    assert progress["remaining_s"] == 0 and progress["expected_end"] == 1000
    assert [p[0] for p in progress["history"]] == list(range(1, 13))
    assert [p[0] for p in progress["history"] if p[2] is not None] == [4, 8, 12]
    assert progress["skipped"] == 0


def test_a_resumed_run_follows_on_from_its_checkpoint(tmp_path):
    """Stopped after step 7 (checkpoint at 5), resumed: the log holds steps 6 and 7 twice; the resumed ones win."""
    first = standin(tmp_path, "trainer.total_training_steps=7", "trainer.save_freq=5")
    marker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    marker.write_text("5")
    second = standin(tmp_path, "trainer.total_training_steps=10", "trainer.save_freq=5")
    assert "Load from checkpoint folder: " in second and "step:6 " in second
    progress = RULES.train_run_progress(first + second, now=0)
    assert progress["step"] == 10 and progress["total_steps"] == 10 and progress["checkpoint_step"] == 10
    assert [p[0] for p in progress["history"]] == list(range(1, 11))
    assert progress["expected_end"] is None  # no clock given


def test_time_left_comes_from_the_last_step_times():
    log = "Total training steps: 100\n" + "".join(
        f"step:{s} - critic/score/mean:0.500 - timing_s/step:30.000\n" for s in range(1, 41)
    )
    progress = RULES.train_run_progress(log, now=10_000)
    assert progress["seconds_per_step"] == 30.0 and progress["remaining_s"] == 1800.0
    assert progress["expected_end"] == 11_800
    assert progress["val_score"] is None and progress["checkpoint_step"] is None


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("step:5 - critic/score/mean:0.900 - timing_s/step:1.0; rm -rf /", "trailing shell"),
        ("step:5 - critic/score/mean:9e999", "no exponent in verl's {:.3f}"),
        ("step:5 - critic/score/mean:abc", "not a number"),
        ("step:5 - <script>alert(1)</script>:1.000", "a key that is markup"),
        ("step:123456789 - critic/score/mean:0.100", "a step out of range"),
        ("step:5 -critic/score/mean:0.100", "a field without its separator"),
        ("xstep:5 - critic/score/mean:0.100", "not at the start"),
        ("local_global_step_folder: /x/global_step_99 extra", "a checkpoint line with more after it"),
        ("Total training steps: 10 (forged)", "a total with more after it"),
    ],
)
def test_forged_and_garbled_lines_are_skipped_whole(line, why):
    good = "Total training steps: 50\nstep:4 - critic/score/mean:0.250 - timing_s/step:2.000\n"
    progress = RULES.train_run_progress(good + line + "\n", now=0)
    assert progress["step"] == 4 and progress["total_steps"] == 50 and progress["train_score"] == 0.25, why
    assert progress["checkpoint_step"] is None and progress["skipped"] == 1


def test_control_characters_are_stripped_before_parsing():
    log = "step:3 - critic/score/mean:0.300\x07\r\nTotal training steps: 9\x00\n"
    progress = RULES.train_run_progress(log)
    assert progress["step"] == 3 and progress["train_score"] == 0.3 and progress["total_steps"] == 9
    # A colour sequence leaves its printable half behind: the line is garbled, not half-read.
    coloured = RULES.train_run_progress("step:4 - critic/score/\x1b[31mmean:0.400\n")
    assert coloured["step"] is None and coloured["skipped"] == 1


def test_nan_scores_are_none_and_long_histories_are_thinned():
    log = "".join(f"step:{s} - critic/score/mean:nan\n" for s in range(1, 1001))
    progress = RULES.train_run_progress(log)
    assert progress["train_score"] is None and progress["step"] == 1000
    assert len(progress["history"]) <= RULES.HISTORY_POINTS + 1 and progress["history"][-1][0] == 1000


def test_the_reader_prints_only_what_is_parsed_and_refuses_links(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("noise\nstep:1 - critic/score/mean:0.100\nTotal training steps: 3\nWARNING x\n")
    done = subprocess.run([sys.executable, "-I", str(READER), str(log)], capture_output=True, text=True, check=True)
    assert done.stdout == "step:1 - critic/score/mean:0.100\nTotal training steps: 3\n"
    (tmp_path / "link.log").symlink_to(log)
    linked = subprocess.run([sys.executable, "-I", str(READER), str(tmp_path / "link.log")], capture_output=True)
    assert linked.returncode == 3 and linked.stdout == b""
    assert subprocess.run([sys.executable, "-I", str(READER), str(tmp_path / "none")]).returncode == 2


BOOT_ID = "0f3c1a52-8a4e-4f7e-9a0b-2f4f3c2d1e0a"
PID1 = "1 (sh) S 0 1 1 0 -1 4194560 1227 0 0 0 5 3 0 0 20 0 1 0 4242 2543616 232 18446744073709551615"


def test_boot_identity():
    assert RULES.train_run_boot(f"{BOOT_ID}\n{PID1}\n") == f"{BOOT_ID}/4242"
    odd = PID1.replace("(sh)", "(a b) c)")
    assert RULES.train_run_boot(f"{BOOT_ID}\n{odd}\n") == f"{BOOT_ID}/4242"
    for bad in ("", "nonsense\nx", f"{BOOT_ID}\n1 (sh) S 0"):
        with pytest.raises(RULES.TrainRunError):
            RULES.train_run_boot(bad)


@pytest.mark.parametrize("name", ["gsm8k", "seed-2", "a" * 40])
def test_unit_names(name):
    assert RULES.train_run_unit(name, "h1") == f"p40fleet-train-{name}.service"


@pytest.mark.parametrize("name", ["", "GSM", "-x", "a/b", "a" * 41, "x y", 3])
def test_bad_run_names_are_refused(name):
    with pytest.raises(RULES.TrainRunError, match=r"h1: train_run_name .* is not a run name"):
        RULES.train_run_unit(name, "h1")


def test_exec_start_words():
    words = RULES.train_run_exec_start(["/usr/local/libexec/p40fleet/p40fleet-train-run", "/h/l.log", "data.seed=2"])
    assert words == '"/usr/local/libexec/p40fleet/p40fleet-train-run" "/h/l.log" "data.seed=2"'
    for bad in ("x=$HOME", "x=%h", 'x="a"', "x=a\\b", "x=a\nb", ""):
        with pytest.raises(RULES.TrainRunError, match="h1: the run's command word"):
            RULES.train_run_exec_start(["/bin/true", bad], "h1")


STARTED = {"state": "started", "boot": "b1"}
DONE = {"step": 20, "total_steps": 20, "checkpoint_step": 20}
HALF = {"step": 9, "total_steps": 20, "checkpoint_step": 5}


@pytest.mark.parametrize(
    ("record", "boot", "active", "progress", "state", "why"),
    [
        ({}, "b1", "inactive", {}, "none", "h1: no run was started here"),
        (STARTED, "b1", "active", HALF, "running", ""),
        (STARTED, "b2", "active", HALF, "running", ""),  # restarted by hand since: it runs
        (STARTED, "b1", "inactive", DONE, "finished", ""),
        (STARTED, "b2", "inactive", HALF, "rebooted", "h1 rebooted under the run (boot identity changed"),
        (STARTED, "b2", "inactive", HALF, "rebooted", "resumes it from its checkpoint (step 5)"),
        ({"state": "stopped", "boot": "b1"}, "b1", "inactive", HALF, "stopped", "`start` resumes it"),
        ({"state": "stopped", "boot": "b1"}, "b2", "inactive", HALF, "stopped", "stopped by"),
        (STARTED, "b1", "failed", HALF, "failed", "the run ended (failed) at step 9 of 20; see its log on h1"),
        # Never step None of None: what the log did not say yet is said in words; the log's path where kept.
        (
            {**STARTED, "log": "/h/.p40fleet/train/gsm8k.log"},
            "b1",
            "failed",
            {},
            "failed",
            "the run ended (failed) before its first step; see its log /h/.p40fleet/train/gsm8k.log on h1",
        ),
        (STARTED, "b1", "failed", {"step": 3, "total_steps": None}, "failed", "at step 3 (no total steps logged)"),
    ],
)
def test_states(record, boot, active, progress, state, why):
    said = RULES.train_run_state(record, boot, active, progress, "h1")
    assert said["state"] == state
    assert why in said["why"]


def test_a_resumed_run_is_marked_with_the_checkpoint_it_resumed_from():
    first = "Total training steps: 20\nstep:1 - critic/score/mean:0.100\nstep:2 - critic/score/mean:0.200\n"
    saved = "local_global_step_folder: /h/ckpt/global_step_2\nstep:3 - critic/score/mean:0.300\n"
    again = "Total training steps: 20\nstep:3 - critic/score/mean:0.310\nstep:4 - critic/score/mean:0.400\n"
    progress = RULES.train_run_progress(first + saved + again)
    assert (progress["resumes"], progress["resumed_from"], progress["step"]) == (1, [2], 4)
    # The repeated step 3 is the resumed run's.
    assert progress["history"][2] == [3, 0.31, None]
    assert RULES.train_run_progress(first)["resumes"] == 0

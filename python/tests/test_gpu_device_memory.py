"""The GPU check's whole-device figures (tests/gpu/device_memory.py), on a CPU: nvidia-smi's answers parsed, peaks
summed, the cap derived and a run judged against the card's reported total. The answers are in the format the real
H200 printed (python/tests/fixtures/real-hosts/h200-r580-open.txt: csv, noheader, nounits)."""

from __future__ import annotations

import pytest

from tests.gpu import device_memory as dm


def test_process_lists_are_read_and_other_lines_skipped():
    text = "4242, python3, 21876\n4243, ray::WorkerDict, 1010\n[N/A], [N/A], [N/A]\nNo running processes found\n"
    assert dm.parse_apps(text) == {"4242": ("python3", 21876), "4243": ("ray::WorkerDict", 1010)}
    assert dm.parse_apps("") == {}


def test_the_device_figure_is_read_for_its_index():
    assert dm.parse_used("0, 22886\n1, 5\n") == 22886
    assert dm.parse_used("1, 5\n") is None
    assert dm.parse_used("0, [N/A]\n") is None


def test_peaks_are_each_process_s_and_their_sum_s_at_one_sample():
    samples = [
        {"apps": {"1": ("a", 500), "2": ("b", 900)}, "used": 1405},
        {"apps": {"1": ("a", 800), "2": ("b", 100)}, "used": 905},
        {"apps": {}, "used": None},
    ]
    found = dm.summarise(samples, idle_mib=4)
    assert found["processes"] == {"1": {"name": "a", "peak_mib": 800}, "2": {"name": "b", "peak_mib": 900}}
    # 1400 at one sample, not 800 + 900 from two.
    assert (found["processes_sum_peak_mib"], found["device_used_peak_mib"], found["process_peak_mib"]) == (
        1400,
        1405,
        900,
    )
    assert found["samples"] == 3 and found["device_idle_mib"] == 4


@pytest.mark.parametrize(
    "total, outside, margin, cap",
    [
        (22888, 1310, 0, 21.07),
        (22888, 0, 0, 22.35),
        (24576, 1024, 0, 23.0),
        (15360, 1500, 0, 13.53),
        (22888, 1335, 64, 20.98),
    ],
)
def test_the_cap_is_the_card_less_what_a_process_holds_beside_torch(total, outside, margin, cap):
    assert dm.cap_gib(total, outside, margin) == cap
    assert dm.cap_gib(total, outside, margin) * 1024 <= total - outside - margin
    assert dm.cap_gib(total, outside) * 1024 <= total - outside - dm.KERNEL_MARGIN_MIB


def device(used, apps=(), samples=10):
    return {
        "samples": samples,
        "processes": {str(i): {"name": "p", "peak_mib": m} for i, m in enumerate(apps)},
        "processes_sum_peak_mib": sum(apps),
        "device_used_peak_mib": used,
    }


BUDGETS = {
    # The measurement: the step's process at 22,886 MiB fits 22,888; the resume's 23,516 does not.
    "step fits": (device(22886, [22886]), 22888, 0, True, 2),
    "resume over": (device(23516, [23516]), 22888, 0, False, -628),
    # The extra context comes off each process seen.
    "extra per process": (device(23516, [22500, 1016]), 22888, 400, True, 172),
    # The device's figure counts when larger than the processes' (what the list cannot see).
    "device over list": (device(23000, [22000]), 22888, 0, False, -112),
    # Nothing sampled is no fit.
    "no samples": (device(0, [], samples=0), 22888, 0, False, 22888),
}


@pytest.mark.parametrize("case", sorted(BUDGETS))
def test_a_run_is_judged_by_the_whole_device_against_the_card(case):
    found, total, extra, fits, headroom = BUDGETS[case]
    judged = dm.budget(found, total, extra)
    assert (judged["fits"], judged["headroom_mib"]) == (fits, headroom)


def test_a_sampler_cut_off_keeps_its_figures_on_disk(tmp_path, monkeypatch):
    """A call cut at its time limit loses run_check's memory: the figures so far are on disk every 25 samples."""
    answers = {tuple(dm.APPS_QUERY): "7, python3, 900\n", tuple(dm.USED_QUERY): "0, 905\n"}
    monkeypatch.setattr(dm, "_query", lambda argv: answers[tuple(argv)])
    monkeypatch.setattr(dm, "SAMPLE_SECONDS", 0.001)
    path = tmp_path / "run.device.json"
    with dm.Sampler(path=path) as sampler:
        while len(sampler.samples) < 30:
            pass
    import json

    written = json.loads(path.read_text())
    assert written["device_used_peak_mib"] == 905 and written["processes"]["7"]["peak_mib"] == 900
    assert written["samples"] == len(sampler.samples) >= 30


REAL_H100 = "0, NVIDIA H100 80GB HBM3, 9.0, 81559, 580.159.04, 00000000:00:06.0, Enabled, Enabled\n"


def test_the_recorded_h100_answers_read_as_preflight_and_the_sampler_read_them():
    """python/tests/fixtures/real-hosts/h100-r580-ecc.txt, recorded by record_host.sh on the GPU machine."""
    from p40fleet_dev.paths import REPO_ROOT
    from tests.test_gpu_preflight_rules import PROBE, recorded

    path = REPO_ROOT / "python" / "tests" / "fixtures" / "real-hosts" / "h100-r580-ecc.txt"
    query = next(c for c in path.read_text().splitlines() if c.startswith("$ nvidia-smi --query-gpu=index,name"))[2:]
    out = recorded(path, query).rsplit("rc=", 1)[0]
    assert out == REAL_H100
    (gpu,) = PROBE.parse_gpus(PROBE.QUERY_FIELDS, out)
    assert (gpu["memory_mib"], gpu["ecc"], gpu["ecc_pending"]) == (81559, "on", "on")
    apps = recorded(
        path, "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits; echo rc=$?"
    )
    assert dm.parse_apps(apps) == {}
    used = recorded(path, "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits; echo rc=$?")
    assert dm.parse_used(used) == 0


def stages(working=1240, model=1335):
    return {
        "bare": dm.stage_figures(2.0, ("python3", 612), 616, 4),
        "working": dm.stage_figures(182.0, ("python3", 1422), 1426, 4),
        "model": dm.stage_figures(190.0, ("python3", 190 + model - 4), 190 + model, 4) if model else None,
    }


PROBES = {
    # The cap leaves room for the largest later stage, seen from the device (idle and driver memory included).
    "model stage largest": (stages(), 0, 1335),
    "working stage largest": (stages(model=1300), 0, 1300),
    # A probe that stopped early measured nothing the cap may use.
    "model stage missing": ({k: v for k, v in stages().items() if k != "model"}, 0, None),
    "failed": (stages(), 1, None),
}


@pytest.mark.parametrize("case", sorted(PROBES))
def test_the_probe_s_working_figure_is_its_largest_later_stage_or_nothing(case):
    found, rc, working = PROBES[case]
    found = {k: v for k, v in found.items() if v}
    summary = dm.summarise_probe(found, 4, rc)
    assert summary["working_mib"] == working
    assert summary["bare_mib"] == 610


def test_a_stage_seen_only_on_the_device_counts_its_growth_since_idle():
    seen = dm.stage_figures(182.0, None, 1426, 4)
    assert (seen["held_mib"], seen["seen_as"], seen["outside_allocator_mib"], seen["device_outside_mib"]) == (
        1422,
        "device",
        1240,
        1244,
    )
    assert dm.stage_figures(182.0, None, None, 4)["device_outside_mib"] is None


def test_the_probe_script_reaches_every_stage_with_the_lock_s_torch_and_transformers(monkeypatch):
    """The probe's own script, run by the CPU venv's python (the verl lock's torch and transformers) on a CPU, with
    nvidia-smi's answers given: every stage is reached, so a GPU call does not find a broken probe."""
    import os
    import socket

    from p40fleet_dev import cpu_venv

    with socket.socket() as free:  # gloo's rendezvous port: one no other test holds
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]

    answers = {tuple(dm.APPS_QUERY): "", tuple(dm.USED_QUERY): "0, 1340\n"}
    monkeypatch.setattr(dm, "_query", lambda argv: answers[tuple(argv)])
    env = dict(os.environ, P40FLEET_PROBE_DEVICE="cpu", P40FLEET_PROBE_PORT=str(port))
    found = dm.probe(str(cpu_venv.python()), env=env, settle=0)
    assert found["rc"] == 0 and sorted(found["stages"]) == sorted(dm.STAGES), found
    assert found["working_mib"] == 1340, found


@pytest.mark.parametrize("used, passed", [(22888, True), (22967, False)])
def test_a_run_over_the_card_did_not_pass_whatever_its_steps_did(used, passed):
    """2026-12-07's smoke: 5 of 5 steps, validation, save and resume, and the device's peak at 22,967 MiB."""
    from tests.gpu import records

    run = {"argv": [], "rc": 0, "wall_seconds": 1.0, "summary": "", "result": {"ok": True}, "device": device(used)}
    entry = records.run_entry(run, 22888)
    assert entry["pass"] is passed and entry["budget"]["fits"] is passed


def call(runs, working, cap, machine="H100", finished="2026-12-07T17:01:05+00:00"):
    return {
        "machine": {"gpu": machine},
        "started": "2026-12-07T16:55:45+00:00",
        "finished": finished,
        "probe": {"working_mib": working},
        "caps_gib": {"p40-1x": cap},
        "cases": {"p40-1x": {label: {"rc": 0} for label in runs}},
    }


def test_a_case_s_runs_from_two_calls_merge_under_the_strictest_pair():
    from tests.gpu import records

    found = records.merged(
        [call(["smoke"], 1317, 21.0), call(["full_batch"], 1330, 20.98, finished="2026-12-07T17:07:28+00:00")]
    )
    assert sorted(found["cases"]["p40-1x"]) == ["full_batch", "smoke"]
    assert found["caps_gib"] == {"p40-1x": 20.98} and found["probe"]["working_mib"] == 1330
    assert found["finished"] == "2026-12-07T17:07:28+00:00" and len(found["calls"]) == 2


@pytest.mark.parametrize(
    "calls, why",
    [
        ([call(["smoke"], 1317, 21.0), call(["full_batch"], 1317, 21.0, machine="H200")], "different machines"),
        ([call(["smoke"], 1317, 21.0), call(["smoke"], 1317, 21.0)], "more than one call"),
    ],
)
def test_calls_that_do_not_make_one_record_are_refused(calls, why):
    from tests.gpu import records

    with pytest.raises(SystemExit, match=why):
        records.merged(calls)

"""Write docs/gpu-runs/<case>.json from a GPU check's results (Makefile `gpu-records`).

A record says what ran on which GPU and with what: the date, the GPU, torch, CUDA, the verl version, the patch set,
the sha256 of each verl file the patches changed, the digest of the overrides the script passed to verl
(tests/launch_render.py), the memory cap, and per run
(`smoke`: the tiny batch, `full_batch`: the rendered batch sizes) the steps done, seconds per step, peak memory and
the last metrics line. A case whose rendering is refused today is recorded as refused, with the reason and, where
the GPU check ran its earlier rendering, that run as the evidence. test_gpu_records.py holds each record to
today's rendering: a change of the overrides or the patch set comes with a new GPU run.

usage: python -m tests.gpu.records --results RESULTS.json --manifest MANIFEST.json [--cases a,b]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from p40fleet_dev.paths import REPO_ROOT
from tests.gpu import device_memory
from tests.gpu.bundle import patched_sha256s
from tests.gpu.cases import CASES
from tests.launch_render import overrides_digest, render

RECORDS = REPO_ROOT / "docs" / "gpu-runs"
# The learning proof's record (tests/gpu/learning.py); its plot is docs/gpu-learning.png.
LEARNING = RECORDS / "learning"
# The step-time sweep's record (tests/gpu/sweep.py), one per case swept.
SWEEP = RECORDS / "sweep"


def run_entry(run: dict, card_total_mib: int) -> dict:
    result = run.get("result") or {}
    device = run.get("device") or {}
    # The whole device through the run, sampled from outside with the run alone on the GPU, and judged against the
    # emulated card's reported total (tests/gpu/device_memory.py): a run over the card did not pass, whatever its
    # steps did.
    judged = device_memory.budget(device, card_total_mib, device_memory.EXTRA_CONTEXT_MIB)
    return {
        "argv": run["argv"],
        "rc": run["rc"],
        "pass": bool(result.get("ok")) and run["rc"] == 0 and judged["fits"],
        "steps_wanted": result.get("steps_wanted"),
        "steps_done": result.get("steps_done"),
        "seconds_per_step": result.get("seconds_per_step"),
        "first_step_seconds": result.get("first_step_seconds"),
        "wall_seconds": run["wall_seconds"],
        # The cap this run ran under (absent in runs before 2026-12-07: the record's one cap).
        "memory_cap_gib": run.get("memory_cap_gib"),
        "torch_peak_reserved_gib": result.get("torch_peak_reserved_gib"),
        "torch_peak_allocated_gib": result.get("torch_peak_allocated_gib"),
        "device": device,
        "budget": judged,
        # What the smoke checks beside the steps: validation before step 1, a checkpoint, a resume from it.
        "validated": result.get("validated"),
        "val_score": result.get("val_score"),
        "saved": result.get("saved"),
        "resumed": result.get("resumed"),
        "summary": run["summary"],
        "why": result.get("why", ""),
        "last_metrics": result.get("last_metrics", {}),
    }


def merged(calls: list[dict]) -> dict:
    """One case's runs from several calls of run_check (a case whose smoke and full batch outlast one call's time
    limit runs them in two: --full-steps 0, then --smoke-steps 0), as one results dict. The calls must have run on
    one kind of machine and stack; each run keeps the cap it ran under, and the merged cap is the smallest, the probe
    the one that measured most (the strictest pair)."""
    if len(calls) == 1:
        return calls[0]
    machines = {json.dumps(call["machine"], sort_keys=True) for call in calls}
    if len(machines) != 1:
        raise SystemExit(f"gpu records: the calls ran on different machines or stacks: {sorted(machines)}")
    out = {**calls[-1], "cases": {}, "calls": []}
    for call in calls:
        out["calls"].append({k: call.get(k) for k in ("started", "finished", "probe", "caps_gib")})
        for name, runs in call["cases"].items():
            seen = out["cases"].setdefault(name, {})
            twice = set(seen) & set(runs)
            if twice:
                raise SystemExit(f"gpu records: {name}: the runs {sorted(twice)} are in more than one call")
            seen.update(runs)
    out["probe"] = max((call["probe"] for call in calls), key=lambda probe: probe["working_mib"])
    out["caps_gib"] = {name: min(call["caps_gib"][name] for call in calls) for name in calls[0]["caps_gib"]}
    out["finished"] = max(call["finished"] for call in calls)
    return out


def record(name: str, today, results: dict, manifest: dict) -> dict:
    ran = manifest["cases"][name]
    runs = results["cases"].get(name, {})
    machine = results["machine"]
    entry = {
        "case": name,
        "gpu_emulated": f"{ran['gpu_count']}x {ran['gpu_name']} ({ran['memory_mib']} MiB)",
        "profile": ran["profile"],
        "dtype": ran["dtype"],
        "variables": ran["variables"],
        "note": ran["why"],
        "overrides_digest": overrides_digest(today),
        "verl_version": manifest["verl_version"],
    }
    gpu_run = (
        {
            "date": results["finished"],
            "gpu": machine["gpu"],
            "driver": machine["nvidia_smi"],
            "torch": machine["torch"],
            "cuda": machine["cuda"],
            "python": machine["python"],
            "patch_set": ran.get("patch_set", ""),
            # The verl files the run imported, as verl_patches left them (test_gpu_records.py holds today's role to
            # them: the patch set's id alone does not change when the role's way of editing does).
            "patched_files": patched_sha256s(ran.get("patch_record") or {}),
            "overrides_digest": ran["overrides_digest"],
            "memory_cap_gib": (results.get("caps_gib") or {}).get(name, ran["cap_gib"]),
            # The calls it took, each with its probe (a case's runs can outlast one call: records.merged).
            "calls": results.get("calls"),
            "card_total_mib": ran["memory_mib"],
            # What a process held outside torch's allocator on this GPU, measured before the runs: the cap is the
            # card's total less the working figure and the margin for kernels the probe does not load.
            "probe": results.get("probe"),
            "kernel_margin_mib": results.get("kernel_margin_mib"),
            "tf32": ran["dtype"] != "float32",
            "model": results["model"],
            # The cases ran one after the other, each alone on the GPU (its device memory is its own).
            "alone_on_the_gpu": True,
            "runs": {
                label: run_entry(run, ran["memory_mib"])
                for label, run in runs.items()
                if isinstance(run, dict) and "rc" in run
            },
        }
        if runs and "refused" not in runs
        else None
    )
    if today.refused:
        entry.update({"status": "refused", "refused": today.refused, "patch_set": ""})
        if gpu_run:
            entry["gpu_evidence"] = gpu_run
        return entry
    if gpu_run is None:
        raise SystemExit(f"gpu records: {name} renders a script but the results hold no run of it")
    if gpu_run["overrides_digest"] != entry["overrides_digest"]:
        raise SystemExit(f"gpu records: {name} ran another rendering than today's: run the GPU check again")
    wanted = {"smoke": ran["smoke_steps"], "full_batch": ran["full_steps"]}
    passed = all(
        label in gpu_run["runs"] and gpu_run["runs"][label]["pass"] and gpu_run["runs"][label]["steps_done"] == steps
        for label, steps in wanted.items()
        if steps
    )
    entry.update({"status": "pass" if passed else "fail", "patch_set": gpu_run["patch_set"], **gpu_run})
    return entry


def learning_run(run: dict, manifest: dict) -> dict:
    """One run of the proof as the record keeps it: what it ran (case, verl tree, the files it imported, the
    overrides it passed) and its curves."""
    ran = manifest["cases"][run["case"]]
    # A run on an edited tree imported the case's patched files but the edited ones, whose sums the run recorded.
    files = {**patched_sha256s(ran.get("patch_record") or {}), **run["tree_files"]}
    return {
        "case": run["case"],
        "tree": run["tree"],
        "extra_overrides": run["extra_overrides"],
        "argv": run["argv"],
        "profile": run["profile"],
        "dtype": run["dtype"],
        "memory_cap_gib": run["cap_gib"],
        "tf32": run["dtype"] != "float32",
        "overrides_digest": run["overrides_digest"],
        "patch_set": run["patch_set"],
        "patched_files": files,
        "rc": run["rc"],
        "wall_seconds": run["wall_seconds"],
        "curves": run["curves"],
    }


def learning_record(results: dict, manifest: dict) -> dict:
    """docs/gpu-runs/learning/<case>.json from one call of the proof (run_check.py --learn --learn-seeds): the data
    and their measured overlap, the schedule as the runs passed it, and per warm start its selection, each run's
    curves (runs with extra overrides under `beside`) and the fine-tuning-only continuation; the acceptance as
    learning.accepted() computes it (test_gpu_records.py computes it again from the curves)."""
    import learning  # tests/gpu/learning.py, beside this file

    found = results["learning"]
    if not found.get("ok"):
        raise SystemExit(f"gpu records: the learning proof did not run through: {found.get('error', found)}")
    warm_starts, schedules = [], set()
    for seed in found["seeds"]:
        entry = found["warm_starts"][str(seed)]
        runs, beside = {}, {}
        for name, run in entry["runs"].items():
            (beside if run["extra_overrides"] else runs)[name] = learning_run(run, manifest)
            schedules.add(tuple(run["argv"][: len(run["argv"]) - len(run["extra_overrides"])]))
        warm_starts.append(
            {
                "seed": seed,
                "warm_start": entry["warm_start"],
                "fine_tuning_only": entry["fine_tuning_only"],
                "runs": runs,
                "beside": beside,
            }
        )
    if len(schedules) != 1:
        raise SystemExit(f"gpu records: the proof's runs passed different schedules: {sorted(schedules)}")
    passed = list(schedules.pop())
    keys = dict(o.split("=", 1) for o in passed)
    steps = int(keys["trainer.total_training_steps"])
    return {
        "proves": (
            "A model that scores gets better under the launch script as rendered, and the proof can fail: from "
            "warm starts chosen on a fine-tuning plateau, the P40 rendering (fp32, the patches, the hf rollout, the "
            "memory cap, TF32 off) trains a small Qwen2 with verl's PPO and greedy validation on problems whose "
            "numbers no training row holds rises, more than the same warm start fine-tuned on alone for as many "
            "samples; the same script with the patch set's positions fix taken back does not rise. It does not "
            "prove a P40's speed, nor learning of the 0.5B default model."
        ),
        "date": results["finished"],
        "gpu": results["machine"]["gpu"],
        "torch": results["machine"]["torch"],
        "cuda": results["machine"]["cuda"],
        "verl_version": manifest["verl_version"],
        "model": "a Qwen2ForCausalLM warm-started here (tests/gpu/learning.py); no hub model",
        # run_check.py's command line as run.
        "argv": found["argv"],
        "data": {
            "kind": (
                "GSM8K-style word problems (a + b * c, '#### N'), converted by training_data's converter; the "
                "fine-tuning rows a weak teacher's that drops carries, the PPO and validation rows scored on the truth"
            ),
            "sft_rows": learning.SFT_ROWS,
            "ppo_rows": learning.PPO_ROWS,
            "validation_rows": learning.VAL_ROWS,
            "selection_rows": learning.SELECT_ROWS,
            "scored_by": "verl's GSM8K rule (verl/utils/reward_score/gsm8k.py), strict",
            **found["data"],
        },
        # The overrides the runs passed after the rendering's own, taken from their argv.
        "passed_through": passed,
        "steps": steps,
        "validation_every": int(keys["trainer.test_freq"]),
        "warm_starts": warm_starts,
        "acceptance": learning.accepted(warm_starts, steps),
    }


def sweep_run(results: dict) -> dict:
    """One sweep run (one machine, one call): each configuration's effective overrides, time, phases and peak memory.
    Configurations are compared only within a run."""
    import sweep  # tests/gpu/sweep.py, beside this file

    found = results["sweep"]
    card = found["memory_mib"]
    configs = {}
    for config, figures in found["configs"].items():
        judged = device_memory.budget(figures.get("device") or {}, card, device_memory.EXTRA_CONTEXT_MIB)
        configs[config] = {
            **figures,
            "budget": judged,
            "fits": bool(figures["ran"] and judged["fits"]),
            "effective_overrides": {
                **sweep.effective(found["base_overrides"] + figures["passed_through"]),
                sweep.ATTENTION: "sdpa" if config in sweep.TREES else found["attention"],
            },
        }
    fitting = {c: f["seconds_per_step"] for c, f in configs.items() if f["fits"]}
    return {
        "date": results["finished"],
        "gpu": results["machine"]["gpu"],
        "driver": results["machine"]["nvidia_smi"],
        "torch": results["machine"]["torch"],
        "cuda": results["machine"]["cuda"],
        "model": results["model"],
        "probe": results.get("probe"),
        "memory_cap_gib": found["cap_gib"],
        "card_total_mib": card,
        "base_overrides": found["base_overrides"],
        "attention_parity": found.get("attention_parity"),
        "fastest_fitting": min(fitting, key=fitting.get) if fitting else None,
        "configs": configs,
        # A call ended before these ran (a machine's 10-minute limit): named, so a reader sees what was not measured.
        "not_run": [config for config in results.get("sweep_only") or sweep.CONFIGS if config not in configs],
    }


def sweep_record(results: dict, earlier: dict | None = None) -> dict:
    """docs/gpu-runs/sweep/<case>.json: the runs of the sweep, the earlier ones kept (--add) and this one last."""
    found = results["sweep"]
    name = found["case"]
    return {
        "proves": (
            "How long one PPO step of the case's rendering takes on the run's GPU under the card's memory cap with "
            "TF32 off, for each configuration, and which ones fit the card's reported total with everything a process "
            "holds on the device. A ranking holds within its run (one machine, one call); a P40's own seconds are the "
            "estimate's business, not this record's."
        ),
        "case": name,
        "card_total_mib": found["memory_mib"],
        "fits_when": (
            "it ran and the device's peak (every process, sampled from outside, less the GPU machine's extra context) "
            "is within the card's reported total"
        ),
        "tf32": False,
        "data": "GSM8K-style rows made by the GPU check (tests/gpu/run_check.py), prompts left-padded by verl",
        "schedule": "one step at the rendered batch sizes, alone on the GPU, a fresh process per configuration",
        "runs": [*(earlier or {}).get("runs", []), sweep_run(results)],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/gpu-runs records")
    parser.add_argument("--results", type=Path, required=True, nargs="+", help="one call's results.json, or several")
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--add", action="store_true", help="sweep: keep the record's earlier runs, add this one")
    args = parser.parse_args(argv)
    results = merged([json.loads(path.read_text()) for path in args.results])
    manifest = json.loads(args.manifest.read_text())
    if "sweep" in results:
        sys.path.insert(0, str(Path(__file__).parent))
        path = SWEEP / f"{results['sweep']['case']}.json"
        earlier = json.loads(path.read_text()) if args.add and path.exists() else None
        found = sweep_record(results, earlier)
        SWEEP.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"sweep: {path}, fastest fitting in this run: {found['runs'][-1]['fastest_fitting']}")
        return 0
    if "learning" in results:
        sys.path.insert(0, str(Path(__file__).parent))
        found = learning_record(results, manifest)
        LEARNING.mkdir(parents=True, exist_ok=True)
        (LEARNING / "p40-1x.json").write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"learning: {LEARNING / 'p40-1x.json'}, accepted: {found['acceptance']['ok']}")
    names = [c for c in args.cases.split(",") if c] or [n for n in results["cases"]]
    if not names:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        today, _ = render({n: CASES[n].host() for n in names}, Path(tmp))
    RECORDS.mkdir(parents=True, exist_ok=True)
    for name in names:
        entry = record(name, today[name], results, manifest)
        (RECORDS / f"{name}.json").write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {entry['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

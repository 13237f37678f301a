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
    return {
        "argv": run["argv"],
        "rc": run["rc"],
        "pass": bool(result.get("ok")) and run["rc"] == 0,
        "steps_wanted": result.get("steps_wanted"),
        "steps_done": result.get("steps_done"),
        "seconds_per_step": result.get("seconds_per_step"),
        "first_step_seconds": result.get("first_step_seconds"),
        "wall_seconds": run["wall_seconds"],
        "torch_peak_reserved_gib": result.get("torch_peak_reserved_gib"),
        "torch_peak_allocated_gib": result.get("torch_peak_allocated_gib"),
        # The whole device through the run, sampled from outside with the run alone on the GPU, and judged against
        # the emulated card's reported total (tests/gpu/device_memory.py).
        "device": device,
        "budget": device_memory.budget(device, card_total_mib, device_memory.EXTRA_CONTEXT_MIB),
        # What the smoke checks beside the steps: validation before step 1, a checkpoint, a resume from it.
        "validated": result.get("validated"),
        "val_score": result.get("val_score"),
        "saved": result.get("saved"),
        "resumed": result.get("resumed"),
        "summary": run["summary"],
        "why": result.get("why", ""),
        "last_metrics": result.get("last_metrics", {}),
    }


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
            "card_total_mib": ran["memory_mib"],
            # What a process held outside torch's allocator on this GPU, measured before the runs: the cap is the
            # card's total less the working figure.
            "probe": results.get("probe"),
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


def learning_runs(results: dict, manifest: dict) -> tuple[dict, dict]:
    """The proof's two runs, and the runs beside them on the same warm start (other renderings or variants)."""
    found = results["learning"]
    if not found.get("ok"):
        raise SystemExit(f"gpu records: the learning proof did not run through: {found.get('error', found)}")
    runs, beside = {}, {}
    for name, run in found["runs"].items():
        ran = manifest["cases"][run.get("case", name)]
        runs[name] = {
            **({"case": run["case"], "extra_overrides": run["extra_overrides"]} if "case" in run else {}),
            "profile": run["profile"],
            "dtype": run["dtype"],
            "memory_cap_gib": run["cap_gib"],
            "tf32": run["dtype"] != "float32",
            "overrides_digest": run["overrides_digest"],
            "patch_set": run["patch_set"],
            "patched_files": patched_sha256s(ran.get("patch_record") or {}),
            "wall_seconds": run["wall_seconds"],
            "curves": run["curves"],
        }
        if name not in ("p40-1x", "a100-1x"):
            beside[name] = runs.pop(name)
    return runs, beside


def learning_record(results: dict, manifest: dict, repeats: list[dict] = ()) -> dict:
    """docs/gpu-runs/learning/<case>.json: the warm start, the schedule, and each rendering's curves; repeats: the
    same proof from other warm starts (run_check.py --learn-seed), each with its own warm start and runs."""
    import learning  # tests/gpu/learning.py, beside this file

    found = results["learning"]
    runs, beside = learning_runs(results, manifest)
    again = []
    for other in repeats:
        other_runs, other_beside = learning_runs(other, manifest)
        again.append(
            {
                "date": other["finished"],
                "gpu": other["machine"]["gpu"],
                "warm_start": other["learning"]["warm_start"],
                "runs": other_runs,
                "beside": other_beside,
            }
        )
    return {
        "proves": (
            "A model that scores gets better under the launch script as rendered: the P40 rendering (fp32, the "
            "patches, the hf rollout, the memory cap, TF32 off) trains a warm-started small Qwen2 with verl's PPO, "
            "and greedy validation on held-out rows rises; the bf16 reference (the modern profile, verl's own bf16 "
            "autocast) run with the same model, data, schedule and seed follows the same course. It does not "
            "prove a P40's speed, nor learning of the 0.5B default model."
        ),
        "date": results["finished"],
        "gpu": results["machine"]["gpu"],
        "torch": results["machine"]["torch"],
        "cuda": results["machine"]["cuda"],
        "verl_version": manifest["verl_version"],
        "model": "a Qwen2ForCausalLM warm-started here (tests/gpu/learning.py); no hub model",
        "warm_start": found["warm_start"],
        "data": {
            "kind": "GSM8K-style word problems (a product, a sum, '#### N'), converted by training_data's converter",
            "sft_rows": learning.SFT_ROWS,
            "ppo_rows": learning.PPO_ROWS,
            "validation_rows": learning.VAL_ROWS,
            "scored_by": "verl's GSM8K rule (verl/utils/reward_score/gsm8k.py), strict",
        },
        "passed_through": learning.SCHEDULE,
        "validation_every": learning.VAL_EVERY,
        "steps": learning.STEPS,
        "reference": "a100-1x",
        "runs": runs,
        # Renderings or variants run beside the proof on the same warm start (their extra overrides named).
        "beside": beside,
        # The same proof from other warm starts: one warm start is no proof that the schedule lifts any model.
        "repeats": again,
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
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--add", action="store_true", help="sweep: keep the record's earlier runs, add this one")
    parser.add_argument(
        "--learning-repeat",
        type=Path,
        action="append",
        default=[],
        help="results.json of the proof from another warm start",
    )
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
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
    names = [c for c in args.cases.split(",") if c] or [n for n in results["cases"]]
    with tempfile.TemporaryDirectory() as tmp:
        today, _ = render({n: CASES[n].host() for n in names}, Path(tmp))
    RECORDS.mkdir(parents=True, exist_ok=True)
    for name in names:
        entry = record(name, today[name], results, manifest)
        (RECORDS / f"{name}.json").write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {entry['status']}")
    if "learning" in results:
        sys.path.insert(0, str(Path(__file__).parent))
        repeats = [json.loads(path.read_text()) for path in args.learning_repeat]
        found = learning_record(results, manifest, repeats)
        (LEARNING / "p40-1x.json").parent.mkdir(parents=True, exist_ok=True)
        (LEARNING / "p40-1x.json").write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"learning: {LEARNING / 'p40-1x.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

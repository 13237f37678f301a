"""In the CPU venv: the learning proof's CPU side as the GPU call runs it, at a dry run's sizes (learning.TINY).

usage: python learning_dry_run.py WORK BUNDLE RULE   (prints one JSON object)

BUNDLE holds tools/training_data_tool.py as the GPU bundle does; RULE is verl's gsm8k.py. Makes the three sets,
converts them with training_data's converter (run_check.convert), measures their overlap and the teacher's slips,
then runs learning.py's warm start and fine-tuning-only continuation in their own processes as run_check does
(run_check.learning_tool). It shows that the path runs and what the data hold, not that the model learns.
"""

from __future__ import annotations

import json
import pathlib
import sys

GPU = pathlib.Path(__file__).parents[1] / "gpu"
sys.path.insert(0, str(GPU))
import learning  # noqa: E402
import run_check  # noqa: E402


def main(work: pathlib.Path, bundle: pathlib.Path, rule: str) -> dict:
    run_check.LOG_DIR = work / "logs"
    raw = work / "raw"
    files = learning.make_sets(raw)
    run_check.convert(bundle, raw, {"train": files["train"], "test": files["test"]}, work / "data")
    run_check.convert(bundle, raw, {"train": files["sft"], "test": files["test"]}, work / "sft")
    (work / "data" / "sft.parquet").write_bytes((work / "sft" / "train.parquet").read_bytes())
    common = {"data": str(work / "data"), "rule": rule, "seed": 2, "state": str(work / "state.pt"), "tiny": True}
    warm = run_check.learning_tool(
        "warm", {**common, "out": str(work / "model"), "template": run_check.CHAT_TEMPLATE}, "warm-2"
    )
    tuned = run_check.learning_tool(
        "continue", {**common, "model": str(work / "model"), "steps": learning.VAL_EVERY}, "tuned-2"
    )
    return {
        "overlap": learning.overlap(work / "data"),
        "teacher": learning.teacher(work / "data"),
        "warm_start": warm,
        "fine_tuning_only": tuned,
        "logs": sorted(p.name for p in run_check.LOG_DIR.iterdir()),
    }


if __name__ == "__main__":
    print(json.dumps(main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3])))

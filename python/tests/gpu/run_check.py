"""The GPU check, on a CUDA machine: run each case's rendered launch script for real and report what it did.

Runs as root on the GPU machine from the bundle that tests/gpu/bundle.py built (stdlib, the machine's torch and the
bundle's wheels, installed to a directory on PYTHONPATH before this starts). For every case it:
- copies the rendered script with the paths the earlier stages publish replaced by this machine's (the env's
  python, the data, the model, the work directory), and nothing else;
- runs it as an unprivileged account (the script refuses root, as on a host) with `--smoke STEPS` (the tiny batch),
  then `--smoke STEPS --full-batch` (the rendered batch sizes), under a per-process memory cap that emulates the
  case's card: its reported total less what the device probe found a process holds outside torch's allocator on
  this GPU (sitecustomize.py on PYTHONPATH calls torch.cuda.set_per_process_memory_fraction on first CUDA use, in
  every process Ray starts), with TF32 off for fp32 profiles (Pascal has none);
- samples every process's device memory through each run (tests/gpu/device_memory.py), which the records judge
  against the card's reported total;
- the model is a random-weight Qwen2ForCausalLM of Qwen2.5-0.5B-Instruct's architecture (494M parameters, so memory
  is real; rewards stay 0) with a byte-level BPE tokenizer trained here on the data; the data are GSM8K-style rows
  (question, answer ending "#### N") converted by training_data's own converter (training_data_tool.py).
Cases run one after the other, each alone on the GPU; each writes the script's own "smoke:" summary. A smoke now
validates before its first step (on a test set of 203 rows, which no validation batch divides), saves at its last
step and resumes for one more.

With --learn it also runs the learning proof after them (tests/gpu/learning.py): for each seed of --learn-seeds, side
by side, a warm-started small model trained for real by each named run's script (the P40 rendering, its negative
control on an edited verl tree, optionally the bf16 reference) and fine-tuned on alone; learning-partial.json and
learning.png.

usage: run_check.py --bundle DIR --out DIR [--cases a,b] [--smoke-steps N] [--full-steps N]
                    [--learn RUN,RUN --learn-seeds a,b,c]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import importlib.util
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import threading
import time

# tests/gpu/learning.py, beside this file (run as a script: no package to import it from).
sys.path.insert(0, str(pathlib.Path(__file__).parent))
learning = importlib.import_module("learning")
sweep = importlib.import_module("sweep")
device_memory = importlib.import_module("device_memory")

OWNER = "p40fleet"
ROOT = pathlib.Path("/srv/gpu-check")
# The runs' consoles, in a directory root made (main moves it under --out): never the owner's home, where root
# would open a path the owner could have replaced.
LOG_DIR = ROOT / "logs"
# The fixed inputs the bundle rendered with (tests/launch_render.py INPUTS); replaced here, nothing else is.
RENDER_PYTHON = "/opt/miniconda3/envs/verl-env/bin/python"
RENDER_PREFIX = "/opt/miniconda3/envs/verl-env"
RENDER_TRAIN = "/srv/data/gsm8k/train.parquet"
RENDER_TEST = "/srv/data/gsm8k/test.parquet"
RENDER_MODEL = "/srv/models/Qwen2.5-0.5B-Instruct"
RENDER_WORK = "/srv/verl-runs"

# Qwen2.5-0.5B-Instruct's config.json (hub revision of the training_data role's pin), less its tokenizer ids.
QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SITECUSTOMIZE = '''"""GPU check: cap this process's CUDA memory like the emulated card's, TF32 off for fp32 profiles."""
import os

_cap = os.environ.get("P40FLEET_GPU_CAP_GIB")
if _cap:
    try:
        import torch
    except Exception:  # a process without torch has no GPU memory to cap
        torch = None
    if torch is not None:
        _original = torch.cuda._lazy_init
        _capped = []

        def _lazy_init():
            _original()
            # Once, after the outermost initialisation finished (calls made while it runs return early).
            if not _capped and torch.cuda.is_initialized():
                _capped.append(True)
                for index in range(torch.cuda.device_count()):
                    total = torch.cuda.get_device_properties(index).total_memory
                    torch.cuda.set_per_process_memory_fraction(min(1.0, float(_cap) * 2**30 / total), index)

        torch.cuda._lazy_init = _lazy_init
        if os.environ.get("P40FLEET_GPU_NO_TF32") == "1":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
'''


def sh(*argv, **kwargs):
    return subprocess.run(list(argv), check=True, text=True, **kwargs)


def machine() -> dict:
    import torch

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        question = f"A farmer has {a} hens and buys {b} more, then each hen lays {c} eggs. How many eggs are laid?"
        answer = (
            f"The farmer has {a} + {b} = {a + b} hens. They lay {a + b} * {c} = {(a + b) * c} eggs.\n#### {(a + b) * c}"
        )
        rows.append({"question": question, "answer": answer})
    return rows


def make_data(bundle: pathlib.Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = ROOT / "raw"
    files = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}
    for split, count, seed in (("train", 1024, 1), ("test", 203, 2)):
        path = raw / files[split]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(make_rows(count, seed)), path)
    return convert(bundle, raw, files, ROOT / "data")


def convert(bundle: pathlib.Path, raw: pathlib.Path, files: dict, data_dir: pathlib.Path) -> dict:
    """training_data's own converter over raw question/answer parquet files: verl's GSM8K layout in data_dir."""
    spec = {
        "raw_dir": str(raw),
        "data_dir": str(data_dir),
        "dataset_source": "path",
        "dataset_local_path": str(raw),
        "dataset_files": files,
        "dataset_identity": f"path:{raw}",
        "endpoint": "",
    }
    done = sh(
        sys.executable,
        str(bundle / "tools" / "training_data_tool.py"),
        "dataset",
        json.dumps(spec),
        capture_output=True,
    )
    return json.loads(done.stdout)


def make_model(rows: list[dict]) -> dict:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = ROOT / "model"
    out.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = [r["question"] + " " + r["answer"] for r in rows] + ["Let's think step by step and output the final answer"]
    fast = learning.tokenizer(texts, out, CHAT_TEMPLATE, vocab_size=2048, split_digits=False)
    ids = {t: fast.convert_tokens_to_ids(t) for t in special}
    config = Qwen2Config(**QWEN25_05B, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    ).save_pretrained(out)
    return {"parameters": params, "tokenizer_vocab": fast.vocab_size}


def ensure_owner() -> pathlib.Path:
    if subprocess.run(["id", OWNER], capture_output=True).returncode != 0:
        sh("useradd", "-m", "-s", "/bin/bash", OWNER)
    return pathlib.Path(f"/home/{OWNER}")


def install_case(
    bundle: pathlib.Path,
    name: str,
    case: dict,
    home: pathlib.Path,
    render_root: str,
    data: pathlib.Path = ROOT / "data",
    model: pathlib.Path = ROOT / "model",
    label: str = "",
    ray: int = 0,
) -> pathlib.Path:
    """The case's rendered files in the owner's home, with only the published paths replaced, and the run's own Ray
    (the script starts a head on 127.0.0.1 at fixed ports, in a directory of the owner's) moved to ports `ray` x 1000
    up and a directory of its own, so that runs side by side (the learning proof's) each have their own."""
    dest = home / (label or name)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    replacements = [
        (f"{render_root}/{name}", str(dest)),
        (RENDER_PYTHON, sys.executable),
        (RENDER_PREFIX, sys.prefix),
        (RENDER_TRAIN, str(data / "train.parquet")),
        (RENDER_TEST, str(data / "test.parquet")),
        (RENDER_MODEL, str(model)),
        (RENDER_WORK, str(dest / "runs")),
    ]
    for src in (bundle / "scripts" / name).iterdir():
        text = src.read_text()
        for old, new in replacements:
            text = text.replace(old, new)
        text = own_ray(text, dest / ".ray", ray)
        (dest / src.name).write_text(text)
        (dest / src.name).chmod(0o755 if src.suffix == ".sh" else 0o644)
    sh("chown", "-R", f"{OWNER}:{OWNER}", str(dest))
    return dest / "train_gsm8k_ppo.sh"


RAY_PORT = re.compile(r"((?:--[a-z-]+-port|RAY_GCS_PORT|_METRIC_PORT)=)(\d+)")


def own_ray(text: str, directory: pathlib.Path, ray: int) -> str:
    """A rendered script's Ray head in `directory`, its ports `ray` x 1000 up (tests/test_gpu_run_check.py)."""
    text = re.sub(r"^readonly RAY_DIR=.*$", f"readonly RAY_DIR={directory}", text, flags=re.MULTILINE)
    return RAY_PORT.sub(lambda m: f"{m[1]}{int(m[2]) + 1000 * ray}", text)


def case_env(case: dict, script: pathlib.Path, index: int, site: str) -> dict:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(script.parent.parent),
        "USER": OWNER,
        "LANG": "C.UTF-8",
        "PYTHONPATH": ":".join([str(ROOT / "site"), str(ROOT / case["verl_tree"]), str(ROOT / "shim"), site]),
        "P40FLEET_GPU_CAP_GIB": str(case["cap_gib"]),
        "P40FLEET_GPU_NO_TF32": "1" if case["dtype"] == "float32" else "0",
        # One local Ray cluster per case, side by side: a short temp dir each (Ray's socket paths are length-capped).
        "RAY_TMPDIR": f"/tmp/r{index}",
        "HYDRA_FULL_ERROR": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def run_case(name: str, case: dict, script: pathlib.Path, index: int, smoke: int, full: int, site: str) -> dict:
    plan = ([("smoke", ["--smoke", str(smoke)])] if smoke else []) + (
        [("full_batch", ["--smoke", str(full), "--full-batch"])] if full else []
    )
    return run_plan(name, case, script, index, site, plan)


def run_plan(name: str, case: dict, script: pathlib.Path, index: int, site: str, plan: list, sample=True) -> dict:
    env = case_env(case, script, index, site)
    pathlib.Path(env["RAY_TMPDIR"]).mkdir(exist_ok=True)
    shutil.chown(env["RAY_TMPDIR"], OWNER, OWNER)
    runs = {}
    for label, args in plan:
        argv = [
            "runuser",
            "-u",
            OWNER,
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in env.items()),
            "bash",
            str(script),
            *args,
        ]
        start = time.monotonic()
        # The console goes to a file under --out as it comes: a call cut off at its time limit still brings it back.
        log_path = LOG_DIR / f"{name}-{label}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Every process's device memory through the run (tests/gpu/device_memory.py): the run is alone on the GPU
        # when its memory is recorded (main runs the cases one after the other, the sweep too). The learning proof's
        # runs go side by side and record no memory (sample=False).
        with (
            open(log_path, "w") as log_file,
            device_memory.Sampler(enabled=sample, path=log_path.with_suffix(".device.json")) as sampler,
        ):
            done = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(script.parent))
        output = log_path.read_text(errors="replace")
        summary = [ln for ln in output.splitlines() if ln.startswith("smoke: ")]
        result = [json.loads(ln[len("smoke-json: ") :]) for ln in output.splitlines() if ln.startswith("smoke-json: ")]
        runs[label] = {
            "argv": args,
            "rc": done.returncode,
            "wall_seconds": round(time.monotonic() - start, 1),
            "summary": summary[-1] if summary else "",
            "result": result[-1] if result else None,
            "log_tail": output.splitlines()[-120:],
            "device": sampler.result(),
        }
        if label.startswith(("learn", "sweep")):
            runs[label]["log"] = output.splitlines()
        print(f"[{name}] {label}: rc {done.returncode} {runs[label]['summary']}", flush=True)
        if done.returncode != 0:
            break
    return runs


def smoke_helper():
    path = pathlib.Path(__file__).parents[3] / "roles" / "launch_script" / "files" / "launch_script_smoke.py"
    spec = importlib.util.spec_from_file_location("launch_script_smoke", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper


def run_sweep(args, manifest: dict, home: pathlib.Path, name: str) -> dict:
    """The step-time sweep (tests/gpu/sweep.py): each configuration alone on the GPU, one after the other."""
    helper = smoke_helper()
    case = manifest["cases"][name]
    script = install_case(args.bundle, name, case, home, manifest["render_root"], label=f"sweep-{name}")
    checkpoints = str(script.parent / "runs" / "checkpoints")
    rendered = sweep.script_overrides(script.read_text())
    model_py = (ROOT / case["verl_tree"] / "verl" / "utils" / "model.py").read_text()
    attention = "eager" if 'attn_implementation="eager"' in model_py else "sdpa"
    out = {
        "case": name,
        "cap_gib": case["cap_gib"],
        "memory_mib": case["memory_mib"],
        "base_overrides": rendered,
        "attention": attention,
        "configs": {},
    }
    # The parity of eager and SDPA attention, where a configuration runs the SDPA tree.
    if sweep.TREES:
        try:
            out["attention_parity"] = sweep.attention_parity(str(ROOT / "model"))
        except Exception as error:  # recorded: the SDPA configuration then runs without a parity on record
            out["attention_parity"] = {"error": repr(error)[-800:]}
        print(f"[sweep] attention parity: {json.dumps(out['attention_parity'])}", flush=True)
    for config, extra in sweep.CONFIGS.items():
        if args.sweep_only and config not in args.sweep_only.split(","):
            continue
        ran_case = case
        if config in sweep.TREES:
            suffix, edits = sweep.TREES[config]
            tree = f"{case['verl_tree']}-{suffix}"
            shutil.copytree(ROOT / case["verl_tree"], ROOT / tree, dirs_exist_ok=True)
            for rel, (old, new) in edits.items():
                path = ROOT / tree / rel
                text = path.read_text()
                if old not in text:
                    raise SystemExit(f"gpu sweep: {config}: {rel} has no {old!r} to edit")
                path.write_text(text.replace(old, new))
            sh("chmod", "-R", "a+rX", str(ROOT / tree))
            ran_case = {**case, "verl_tree": tree}
        plan = [(f"sweep-{config}", extra + sweep.schedule(config, checkpoints))]
        run = run_plan(f"sweep-{name}", ran_case, script, 0, args.site, plan)[plan[0][0]]
        figures = sweep.measure(helper.parse_steps(run["log"]), run["rc"], run["log_tail"])
        figures.update({"passed_through": extra, "wall_seconds": run["wall_seconds"], "device": run["device"]})
        out["configs"][config] = figures
        shown = {k: figures[k] for k in ("rc", "seconds_per_step", "torch_peak_reserved_gib")}
        shown["device_used_peak_mib"] = run["device"]["device_used_peak_mib"]
        print(f"[sweep] {config}: {json.dumps(shown)}", flush=True)
        (args.out / "sweep-partial.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def learn_entry(entry: str) -> tuple[str, str, str, list[str]]:
    """`[LABEL=]CASE[@TREE][;OVERRIDE...]`: a run of the learning proof, the verl tree it runs on (a name in
    learning.TREES: a copy of the case's patched tree with those edits; none: the case's own), and overrides passed
    after the proof's schedule (records.py keeps a run with overrides under the record's `beside`)."""
    head, *extra = entry.split(";")
    label, _, target = head.rpartition("=")
    case, _, tree = target.partition("@")
    if tree and tree not in learning.TREES:
        known = sorted(learning.TREES)
        raise SystemExit(f"gpu check: --learn {entry}: no verl tree {tree!r} (learning.TREES: {known})")
    return label or case, case, tree, extra


def edited_tree(case: dict, tree: str) -> tuple[str, dict]:
    """A copy of the case's patched verl tree with learning.TREES[tree]'s edits, each found once: its name, and the
    sha256 of each file edited (the record's, beside the case's patched files)."""
    name = f"{case['verl_tree']}-{tree}"
    shutil.copytree(ROOT / case["verl_tree"], ROOT / name, dirs_exist_ok=True)
    sums = {}
    for rel, (old, new) in learning.TREES[tree].items():
        path = ROOT / name / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"gpu check: verl tree {tree}: {rel} holds {text.count(old)} of {old!r}, not one")
        path.write_text(text.replace(old, new))
        sums[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    sh("chmod", "-R", "a+rX", str(ROOT / name))
    return name, sums


def learning_tool(command: str, spec: dict, tag: str) -> dict:
    """tests/gpu/learning.py COMMAND SPEC in its own process (the warm starts and continuations run side by side),
    its console to LOG_DIR and here line by line; its one JSON object."""
    log_path = LOG_DIR / f"learn-{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(pathlib.Path(learning.__file__)), command, json.dumps(spec)]
    found = None
    with (
        open(log_path, "w") as log_file,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            log_file.write(line)
            if line.startswith("learning-json: "):
                found = json.loads(line[len("learning-json: ") :])
            elif line.startswith(("warm start", "fine-tuning only")):
                print(f"[learning] {line.rstrip()}", flush=True)
    if proc.returncode != 0 or found is None:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"learning.py {command} ({tag}) exited {proc.returncode}: " + "\n".join(tail))
    return found


def learn_progress(done, every: float = 30.0) -> None:
    """Each PPO run's last step, every `every` seconds until `done` is set: a call cut off shows how far they got."""
    while not done.wait(every):
        steps = {}
        for path in sorted(LOG_DIR.glob("learn-*-learn.log")):
            found = re.findall(r"step:(\d+) ", path.read_text(errors="replace"))
            steps[path.name[len("learn-") : -len("-learn.log")]] = int(found[-1]) if found else 0
        print(f"[learning] steps: {json.dumps(steps)}", flush=True)


def run_learning(args, manifest: dict, home: pathlib.Path, entries: list[tuple], index: int) -> dict:
    """The learning proof (tests/gpu/learning.py): the data once, then for each seed, side by side, its warm start,
    each rendering training it and the fine-tuning-only continuation. Each warm start's results go to
    learning-partial.json under --out as they finish (a call cut off at its limit keeps them)."""
    helper = smoke_helper()
    seeds = [int(s) for s in args.learn_seeds.split(",")]

    def log(line):
        print(f"[learning] {line}", flush=True)

    out = {"ok": False, "argv": list(args.argv), "seeds": seeds, "warm_starts": {}}
    lock = threading.Lock()

    def partial():
        with lock:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "learning-partial.json").write_text(json.dumps(out, indent=1) + "\n")

    base = ROOT / "learning"
    low, high = (float(v) for v in args.learn_warm.split(",")) if args.learn_warm else (None, None)
    rule = ROOT / manifest["cases"][entries[0][1]]["verl_tree"] / "verl" / "utils" / "reward_score" / "gsm8k.py"

    def one_seed(position: int, seed: int) -> None:
        entry = out["warm_starts"].setdefault(str(seed), {})
        model, state = base / f"model-{seed}", base / f"sft-state-{seed}.pt"
        model.mkdir(parents=True, exist_ok=True)
        common = {"data": str(base / "data"), "rule": str(rule), "seed": seed, "state": str(state)}
        spec = {**common, "out": str(model), "low": low, "high": high, "template": CHAT_TEMPLATE}
        entry["warm_start"] = learning_tool("warm", spec, f"warm-{seed}")
        partial()
        sh("chmod", "-R", "a+rX", str(model))
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(entries)) as pool:
            jobs = {}
            for offset, (name, case_name, tree, extra) in enumerate(entries):
                case = manifest["cases"][case_name]
                ran = {**case, "verl_tree": trees[tree][0]} if tree else case
                label = f"{name}-s{seed}"
                ray = index + 1 + position * len(entries) + offset
                script = install_case(
                    args.bundle,
                    case_name,
                    case,
                    home,
                    manifest["render_root"],
                    base / "data",
                    model,
                    f"learn-{label}",
                    ray,
                )
                plan = [("learn", learning.SCHEDULE + extra)]
                jobs[name] = pool.submit(run_plan, f"learn-{label}", ran, script, ray, args.site, plan, False)
            entry["fine_tuning_only"] = learning_tool("continue", {**common, "model": str(model)}, f"tuned-{seed}")
            partial()
            runs = {name: job.result()["learn"] for name, job in jobs.items()}
        entry["runs"] = {}
        for name, case_name, tree, extra in entries:
            run, case = runs[name], manifest["cases"][case_name]
            entry["runs"][name] = {
                "case": case_name,
                "tree": tree,
                "tree_files": trees[tree][1] if tree else {},
                "extra_overrides": extra,
                # The overrides this run passed to the script, as it passed them: the record's passed_through.
                "argv": run["argv"],
                "rc": run["rc"],
                "wall_seconds": run["wall_seconds"],
                "profile": case["profile"],
                "dtype": case["dtype"],
                "cap_gib": case["cap_gib"],
                "overrides_digest": case["overrides_digest"],
                "patch_set": case.get("patch_set", ""),
                "curves": learning.curves(run["log"], helper.parse_steps),
                "log_tail": run["log_tail"][-40:],
            }
        verdict = learning.verdict(entry)
        log(f"seed {seed}: {json.dumps({k: verdict[k] for k in ('p40', 'control', 'fine_tuning_only', 'counts')})}")
        partial()

    done = threading.Event()
    try:
        raw = base / "raw"
        files = learning.make_sets(raw)
        convert(args.bundle, raw, {"train": files["train"], "test": files["test"]}, base / "data")
        convert(args.bundle, raw, {"train": files["sft"], "test": files["test"]}, base / "sft")
        (base / "data" / "sft.parquet").write_bytes((base / "sft" / "train.parquet").read_bytes())
        out["data"] = {"overlap": learning.overlap(base / "data"), "teacher": learning.teacher(base / "data")}
        log(f"data: {json.dumps(out['data'])}")
        trees = {tree: edited_tree(manifest["cases"][case], tree) for _, case, tree, _ in entries if tree}
        sh("chmod", "-R", "a+rX", str(base))
        threading.Thread(target=learn_progress, args=(done,), daemon=True).start()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(seeds)) as pool:
            jobs = {seed: pool.submit(one_seed, position, seed) for position, seed in enumerate(seeds)}
            for seed, job in jobs.items():
                try:
                    job.result()
                except Exception as error:  # recorded: the other warm starts still report
                    out["warm_starts"][str(seed)]["error"] = repr(error)[-2000:]
                    log(f"seed {seed} failed: {error!r}")
        found = out["warm_starts"].values()
        out["ok"] = all("error" not in e and all(r["rc"] == 0 for r in e["runs"].values()) for e in found)
        title = f"PPO from plateaued warm starts, validation on {learning.VAL_ROWS} content-disjoint rows"
        learning.plot({"title": title, "warm_starts": [e for e in found if "runs" in e]}, args.out / "learning.png")
    except BaseException as error:  # recorded, not raised: the smoke cases beside it still report
        out["error"] = repr(error)[-2000:]
        log(f"failed: {error!r}")
    finally:
        done.set()
        partial()
    return out


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--smoke-steps", type=int)
    parser.add_argument("--full-steps", type=int)
    parser.add_argument("--site", default=os.environ.get("P40FLEET_GPU_SITE", "/tmp/site"))
    parser.add_argument(
        "--learn",
        default="",
        help="[LABEL=]CASE[@TREE][;OVERRIDE...],...: the proof's runs (p40-1x,control=p40-1x@positions-unfixed)",
    )
    parser.add_argument("--learn-warm", default="", help="LOW,HIGH: another band for the warm start (a variant)")
    parser.add_argument("--learn-seeds", default="0", help="a,b,c: the warm starts' seeds, run side by side")
    parser.add_argument("--sweep", default="", help="CASE: the step-time sweep, alone on the GPU (no other case)")
    parser.add_argument("--sweep-only", default="", help="a,b: only these sweep configurations")
    return parser


def main(argv=None) -> int:
    args = arguments().parse_args(argv)
    # The command line as run: the learning record keeps it.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    global LOG_DIR
    LOG_DIR = args.out / "logs"
    learn = [learn_entry(c) for c in args.learn.split(",") if c]
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    # --cases none: no smoke case (the learning proof alone makes its own data and model).
    wanted = [c for c in args.cases.split(",") if c] or [n for n, c in manifest["cases"].items() if not c["refused"]]
    wanted = [] if wanted == ["none"] else wanted
    if args.sweep:
        wanted, learn = [], []
    report = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "cases": {},
    }
    print(json.dumps(report["machine"]), flush=True)
    # Before anything else holds the GPU: what a process holds outside torch's allocator here, and from it each
    # case's cap (its card's reported total less that; tests/gpu/device_memory.py).
    report["probe"] = device_memory.probe(sys.executable)
    print(f"device probe: {json.dumps(report['probe'])}", flush=True)
    outside = report["probe"]["working_mib"]
    if outside is None:
        raise SystemExit(f"gpu check: the device probe measured nothing: {report['probe']}")
    for case in manifest["cases"].values():
        if case["cap_gib"] is None:
            case["cap_gib"] = device_memory.cap_gib(case["memory_mib"], outside)
    report["caps_gib"] = {name: case["cap_gib"] for name, case in manifest["cases"].items()}
    report["kernel_margin_mib"] = device_memory.KERNEL_MARGIN_MIB
    ROOT.mkdir(parents=True, exist_ok=True)
    for part in ("shim", "verl"):
        shutil.copytree(args.bundle / part, ROOT / part, dirs_exist_ok=True)
    # Before the data, the model or any case is made: the trainer runs `python -m verl.trainer.main_ppo` with the
    # case's verl_tree first on PYTHONPATH, so the package must be right under it.
    for name in wanted + [case for _, case, _, _ in learn] + ([args.sweep] if args.sweep else []):
        case = manifest["cases"][name]
        if not case["refused"] and not (ROOT / case["verl_tree"] / "verl" / "__init__.py").is_file():
            raise SystemExit(f"gpu check: {name}: the bundle has no verl/ package under {case['verl_tree']}")
    (ROOT / "site").mkdir(exist_ok=True)
    (ROOT / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if wanted or args.sweep:
        report["data"] = make_data(args.bundle)
        report["model"] = make_model(make_rows(1024, 1))
    sh("chmod", "-R", "a+rX", str(ROOT), args.site)
    home = ensure_owner()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        report["sweep_only"] = [c for c in args.sweep_only.split(",") if c]
        report["sweep"] = run_sweep(args, manifest, home, args.sweep)
        report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        ran = [c["ran"] for c in report["sweep"]["configs"].values()]
        print("gpu check: sweep", "PASS" if ran and ran[0] else "FAIL", flush=True)
        return 0 if ran and ran[0] else 1
    # The cases one after the other, each alone on the GPU (their device memory is what the records hold), then the
    # learning proof (its memory is not recorded; its runs go side by side).
    for index, name in enumerate(wanted):
        case = manifest["cases"][name]
        if case["refused"]:
            report["cases"][name] = {"refused": case["refused"]}
            continue
        script = install_case(args.bundle, name, case, home, manifest["render_root"])
        # 0 leaves a run out: a case whose two runs outlast one call runs them in two (records.py merges them).
        smoke = args.smoke_steps if args.smoke_steps is not None else case["smoke_steps"]
        full = args.full_steps if args.full_steps is not None else case["full_steps"]
        report["cases"][name] = run_case(name, case, script, index, smoke, full, args.site)
        for run in report["cases"][name].values():
            run["memory_cap_gib"] = case["cap_gib"]
        # Each result as it comes, so a call cut off at its time limit still brings back what finished.
        (args.out / "results-partial.json").write_text(json.dumps(report, indent=1) + "\n")
    if learn:
        report["learning"] = run_learning(args, manifest, home, learn, len(wanted))
    report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    ok = all(r.get("rc") == 0 for runs in report["cases"].values() if "refused" not in runs for r in runs.values())
    ok = ok and (not learn or report["learning"].get("ok", False))
    print("gpu check:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

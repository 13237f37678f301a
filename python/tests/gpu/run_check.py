"""The GPU check, on a CUDA machine: run each case's rendered launch script for real and report what it did.

Runs as root on the GPU machine from the bundle that tests/gpu/bundle.py built (stdlib, the machine's torch and the
bundle's wheels, installed to a directory on PYTHONPATH before this starts). For every case it:
- copies the rendered script with the paths the earlier stages publish replaced by this machine's (the env's
  python, the data, the model, the work directory), and nothing else;
- runs it as an unprivileged account (the script refuses root, as on a host) with `--smoke STEPS` (the tiny batch),
  then `--smoke STEPS --full-batch` (the rendered batch sizes), under a per-process memory cap that emulates the
  case's card less its CUDA context (sitecustomize.py on PYTHONPATH calls torch.cuda.set_per_process_memory_fraction
  on first CUDA use, in every process Ray starts), with TF32 off for fp32 profiles (Pascal has none);
- the model is a random-weight Qwen2ForCausalLM of Qwen2.5-0.5B-Instruct's architecture (494M parameters, so memory
  is real; rewards stay 0) with a byte-level BPE tokenizer trained here on the data; the data are GSM8K-style rows
  (question, answer ending "#### N") converted by training_data's own converter (training_data_tool.py).
Cases run side by side (one local Ray cluster each); each writes the script's own "smoke:" summary.

usage: run_check.py --bundle DIR --out DIR [--cases a,b] [--smoke-steps N] [--full-steps N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time

OWNER = "p40fleet"
ROOT = pathlib.Path("/srv/gpu-check")
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
    for split, count, seed in (("train", 1024, 1), ("test", 128, 2)):
        path = raw / files[split]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(make_rows(count, seed)), path)
    spec = {
        "raw_dir": str(raw),
        "data_dir": str(ROOT / "data"),
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = ROOT / "model"
    out.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [r["question"] + " " + r["answer"] for r in rows] + ["Let's think step by step and output the final answer"]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=2048, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
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


def install_case(bundle: pathlib.Path, name: str, case: dict, home: pathlib.Path, render_root: str) -> pathlib.Path:
    """The case's rendered files in the owner's home, with only the published paths replaced."""
    dest = home / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    replacements = [
        (f"{render_root}/{name}", str(dest)),
        (RENDER_PYTHON, sys.executable),
        (RENDER_PREFIX, sys.prefix),
        (RENDER_TRAIN, str(ROOT / "data" / "train.parquet")),
        (RENDER_TEST, str(ROOT / "data" / "test.parquet")),
        (RENDER_MODEL, str(ROOT / "model")),
        (RENDER_WORK, str(dest / "runs")),
    ]
    for src in (bundle / "scripts" / name).iterdir():
        text = src.read_text()
        for old, new in replacements:
            text = text.replace(old, new)
        (dest / src.name).write_text(text)
        (dest / src.name).chmod(0o755 if src.suffix == ".sh" else 0o644)
    sh("chown", "-R", f"{OWNER}:{OWNER}", str(dest))
    return dest / "train_gsm8k_ppo.sh"


def run_case(name: str, case: dict, script: pathlib.Path, index: int, smoke: int, full: int, site: str) -> dict:
    env = {
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
    pathlib.Path(env["RAY_TMPDIR"]).mkdir(exist_ok=True)
    shutil.chown(env["RAY_TMPDIR"], OWNER, OWNER)
    runs = {}
    plan = [("smoke", ["--smoke", str(smoke)])] + (
        [("full_batch", ["--smoke", str(full), "--full-batch"])] if full else []
    )
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
        done = subprocess.run(argv, capture_output=True, text=True, cwd=str(script.parent))
        output = done.stdout + done.stderr
        summary = [ln for ln in output.splitlines() if ln.startswith("smoke: ")]
        result = [json.loads(ln[len("smoke-json: ") :]) for ln in output.splitlines() if ln.startswith("smoke-json: ")]
        runs[label] = {
            "argv": args,
            "rc": done.returncode,
            "wall_seconds": round(time.monotonic() - start, 1),
            "summary": summary[-1] if summary else "",
            "result": result[-1] if result else None,
            "log_tail": output.splitlines()[-120:],
        }
        print(f"[{name}] {label}: rc {done.returncode} {runs[label]['summary']}", flush=True)
        if done.returncode != 0:
            break
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--smoke-steps", type=int)
    parser.add_argument("--full-steps", type=int)
    parser.add_argument("--site", default=os.environ.get("P40FLEET_GPU_SITE", "/tmp/site"))
    args = parser.parse_args(argv)
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    wanted = [c for c in args.cases.split(",") if c] or [n for n, c in manifest["cases"].items() if not c["refused"]]
    report = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "cases": {},
    }
    print(json.dumps(report["machine"]), flush=True)
    ROOT.mkdir(parents=True, exist_ok=True)
    for part in ("shim", "verl"):
        shutil.copytree(args.bundle / part, ROOT / part, dirs_exist_ok=True)
    # Before the data, the model or any case is made: the trainer runs `python -m verl.trainer.main_ppo` with the
    # case's verl_tree first on PYTHONPATH, so the package must be right under it.
    for name in wanted:
        case = manifest["cases"][name]
        if not case["refused"] and not (ROOT / case["verl_tree"] / "verl" / "__init__.py").is_file():
            raise SystemExit(f"gpu check: {name}: the bundle has no verl/ package under {case['verl_tree']}")
    (ROOT / "site").mkdir(exist_ok=True)
    (ROOT / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    report["data"] = make_data(args.bundle)
    report["model"] = make_model(make_rows(1024, 1))
    sh("chmod", "-R", "a+rX", str(ROOT), args.site)
    home = ensure_owner()
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        for index, name in enumerate(wanted):
            case = manifest["cases"][name]
            if case["refused"]:
                report["cases"][name] = {"refused": case["refused"]}
                continue
            script = install_case(args.bundle, name, case, home, manifest["render_root"])
            smoke = args.smoke_steps or case["smoke_steps"]
            full = args.full_steps if args.full_steps is not None else case["full_steps"]
            jobs[name] = pool.submit(run_case, name, case, script, index, smoke, full, args.site)
        for name, job in jobs.items():
            report["cases"][name] = job.result()
    report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    ok = all(r.get("rc") == 0 for runs in report["cases"].values() if "refused" not in runs for r in runs.values())
    print("gpu check:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""How long GSM8K's prompts are under Qwen2.5-Instruct's chat template: which rows data.filter_overlong_prompts drops.

verl's RLHFDataset keeps a row when len(apply_chat_template(prompt, add_generation_prompt=True)) <= max_prompt_length
(verl/utils/dataset/rl_dataset.py, 0.4.1). This counts that length for every row of GSM8K's train and test splits as
training_data converts them (the question, a space, verl's instruction), with the default system prompt Qwen2.5's
template adds, and writes docs/gpu-runs/sweep/gsm8k-prompt-lengths.json.

No hub here, so two stand-ins, named in the record: GSM8K's rows from OpenAI's repository (the same questions the hub's
openai/gsm8k carries) and Qwen's byte-level BPE ranks from the dashscope wheel (qwen.tiktoken, 151,643 tokens) with
Qwen2's pre-tokenizer pattern, run by tiktoken. Each file is checked against the sha256 below before it is read.

    python python/tests/gpu/prompt_lengths.py --train train.jsonl --test test.jsonl --ranks qwen.tiktoken
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve()
RECORD = HERE.parents[3] / "docs" / "gpu-runs" / "sweep" / "gsm8k-prompt-lengths.json"
# openai/grade-school-math at 3101c7d, grade_school_math/data/{train,test}.jsonl; dashscope 2.0.2's
# dashscope/resources/qwen.tiktoken (wheel sha256 0602d1800f7433bdb7953560986eaf5146454ed3988636c0a91963ba24e74258).
SHA256 = {
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "ranks": "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
}
SOURCES = {
    "rows": "openai/grade-school-math 3101c7d, grade_school_math/data/{train,test}.jsonl",
    "tokenizer": "Qwen's BPE ranks, dashscope 2.0.2 dashscope/resources/qwen.tiktoken, Qwen2's pre-tokenizer pattern",
}
# Qwen2's tokenizer.json pre-tokenizer (a Split on this pattern) after NFC normalisation.
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# What the record counts rows above (the sweep's and the default's prompt lengths, and shorter ones).
LIMITS = (160, 192, 224, 256, 512)


def verified(path: Path, name: str) -> bytes:
    data = path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != SHA256[name]:
        raise SystemExit(f"prompt lengths: {path} has sha256 {found}, expected {SHA256[name]} ({name})")
    return data


def encoder(ranks: bytes):
    import tiktoken

    table = {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in ranks.decode().splitlines() if ln)}
    special = {"<|im_start|>": len(table) + 1, "<|im_end|>": len(table) + 2}
    return tiktoken.Encoding("qwen", pat_str=PATTERN, mergeable_ranks=table, special_tokens=special)


def prompt_tokens(enc, question: str) -> int:
    text = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question} {INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return len(enc.encode(unicodedata.normalize("NFC", text), allowed_special="all"))


def summary(lengths: list[int]) -> dict:
    lengths = sorted(lengths)
    return {
        "rows": len(lengths),
        "min": lengths[0],
        "median": lengths[len(lengths) // 2],
        "p99": lengths[int(len(lengths) * 0.99)],
        "max": lengths[-1],
        "rows_over": {str(limit): sum(n > limit for n in lengths) for limit in LIMITS},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("train", "test", "ranks"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    args = parser.parse_args(argv)
    enc = encoder(verified(args.ranks, "ranks"))
    splits = {}
    for name in ("train", "test"):
        rows = [json.loads(line) for line in verified(getattr(args, name), name).decode().splitlines() if line]
        splits[name] = summary([prompt_tokens(enc, row["question"]) for row in rows])
    record = {
        "proves": (
            "How many of GSM8K's rows a max_prompt_length drops with data.filter_overlong_prompts, counted with "
            "stand-ins for the hub's data and tokenizer (sources); a row at the limit is kept, as verl keeps it."
        ),
        "sources": SOURCES,
        "sha256": SHA256,
        "splits": splits,
    }
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())

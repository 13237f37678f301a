"""The learning proof, on the GPU machine (run_check.py --learn): a model that scores gets better under the P40 script.

No hub is reachable there, so the model is made on the spot:
- data: GSM8K-style word problems (one product, one sum, the answer after "#### "), converted by training_data's own
  converter into verl's layout; disjoint sets for the warm start, PPO's prompts and the held-out validation;
- a small model of Qwen2's architecture with a byte-level BPE tokenizer that splits digits, warm-started by supervised
  fine-tuning in plain torch on the converted prompts and answers (chat template, loss on the answer only) until its
  greedy accuracy, scored by verl's own GSM8K rule, averaged over the last WARM_EVALS evaluations on SELECT_ROWS rows
  of the PPO prompts, lies in [WARM_LOW, WARM_HIGH]. The held-out rows do not choose the model, so validation before
  step 1 is no lucky evaluation of them. The band starts at 25%: from 15% the schedule lifted one warm start of three
  (docs/gpu-sweep.md); a model that scores more often gives PPO more rewarded samples a batch;
- then the cases' launch scripts as rendered (run_check.install_case), with the model, the data and a short schedule
  passed through (SCHEDULE), run side by side: the 1x P40 rendering (fp32, the patches, the hf rollout, the 23 GiB cap,
  TF32 off) and the bf16 reference (the modern profile: verl's own bf16 autocast). Greedy validation before step 1 and
  every VAL_EVERY steps on VAL_ROWS held-out rows. The record holds a second warm start (another seed) as well.
Each run's console log is read with the smoke helper's parser (roles/launch_script/files/launch_script_smoke.py).
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
import time

WARM_LOW, WARM_HIGH = 0.25, 0.45
WARM_EVALS = 3
SELECT_ROWS = 512
VAL_ROWS = 512
PPO_ROWS = 16384
SFT_ROWS = 24000
STEPS = 100
VAL_EVERY = 10
SCHEDULE = [
    "data.train_batch_size=128",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "data.max_prompt_length=160",
    "data.max_response_length=48",
    # A 4M-parameter model moves at rates a 0.5B one would not take. 2e-4 collapsed both renderings on an H100
    # (validation 17% to 1-2% by step 80); 5e-5 and 7e-5 rose as well from a 42% warm start (docs/gpu-sweep.md).
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "critic.optim.lr=5e-4",
    f"trainer.total_training_steps={STEPS}",
    f"trainer.test_freq={VAL_EVERY}",
    "trainer.save_freq=50",
    "trainer.total_epochs=10",
]
CURVES = ["critic/score/mean", "actor/ppo_kl", "critic/vf_explained_var", "response_length/clip_ratio"]
VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana"]
THINGS = ["marbles", "apples", "stamps", "cards", "shells", "coins"]


def problem(rng: random.Random) -> dict:
    a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 9)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    question = f"{name} has {a} {thing} and gets {b} bags with {c} {thing} in each. How many {thing} does {name} have?"
    answer = f"{b} * {c} = {b * c}. {a} + {b * c} = {a + b * c}.\n#### {a + b * c}"
    return {"question": question, "answer": answer}


def make_sets(raw: pathlib.Path) -> dict:
    """Disjoint question sets: sft (warm start), train (PPO prompts), test (held-out validation)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    seen, rows = set(), []
    while len(rows) < SFT_ROWS + PPO_ROWS + VAL_ROWS:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    sets = {"test": rows[:VAL_ROWS], "train": rows[VAL_ROWS : VAL_ROWS + PPO_ROWS], "sft": rows[VAL_ROWS + PPO_ROWS :]}
    files = {}
    for split, chunk in sets.items():
        path = raw / "main" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(chunk), path)
        files[split] = str(path.relative_to(raw))
    return files


def tokenizer(texts: list[str], out: pathlib.Path, template: str, vocab_size: int = 1024, split_digits: bool = True):
    """A byte-level BPE trained on `texts` with Qwen's special tokens and `template`, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # Digits one by one: arithmetic a small model can learn.
    digits = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def greedy_accuracy(model, tok, prompts: list[list[dict]], truths: list[str], score, batch: int = 128) -> float:
    import torch

    tok.padding_side = "left"
    right = 0
    model.eval()
    for start in range(0, len(prompts), batch):
        texts = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts[start : start + batch]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False, return_token_type_ids=False).to(
            model.device
        )
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
            )
        for row, truth in zip(out[:, enc["input_ids"].shape[1] :], truths[start : start + batch], strict=True):
            right += score(tok.decode(row, skip_special_tokens=True), truth) == 1.0
    model.train()
    return right / len(prompts)


def warm_start(
    data_dir: pathlib.Path,
    out: pathlib.Path,
    template: str,
    compute_score,
    log,
    low: float | None = None,
    high: float | None = None,
    seed: int = 0,
) -> dict:
    """SFT of a small Qwen2 on the converted sft split until its mean greedy accuracy on rows of the PPO prompts (not
    the held-out rows) is in band; then its accuracy on the held-out rows, which validation before step 1 repeats.
    low, high and seed replace WARM_LOW, WARM_HIGH and seed 0 for a variant tried beside the proof."""
    low = WARM_LOW if low is None else low
    high = WARM_HIGH if high is None else high
    import pyarrow.parquet as pq
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    sft = pq.read_table(data_dir / "sft.parquet").to_pylist()
    test = pq.read_table(data_dir / "test.parquet").to_pylist()
    select = pq.read_table(data_dir / "train.parquet").to_pylist()[:SELECT_ROWS]
    texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in sft[:4000]]
    tok = tokenizer(texts, out, template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    model = Qwen2ForCausalLM(config).cuda()
    # The warm start is not under test: bf16 matmuls are fine here.
    examples = []
    for r in sft:
        prompt = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(r["extra_info"]["answer"], add_special_tokens=False)["input_ids"] + [ids["<|im_end|>"]]
        examples.append((p, a))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    prompts = [r["prompt"] for r in select]
    truths = [r["reward_model"]["ground_truth"] for r in select]
    history, step, accuracy, batch = [], 0, 0.0, 64
    rng = random.Random(seed)
    started = time.monotonic()
    while step < 4000:
        chunk = rng.sample(examples, batch)
        width = max(len(p) + len(a) for p, a in chunk)
        x = torch.full((batch, width), ids["<|endoftext|>"], dtype=torch.long)
        y = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (p, a) in enumerate(chunk):
            seq = p + a
            x[i, : len(seq)] = torch.tensor(seq)
            y[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x.cuda(), attention_mask=mask.cuda(), labels=y.cuda()).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        # Every 50 steps, every 20 once it starts to score: the warm start must stop inside the band.
        if step % (20 if history and history[-1]["greedy_accuracy"] >= 0.05 else 50) == 0:
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "greedy_accuracy": greedy_accuracy(model, tok, prompts, truths, compute_score),
                }
            )
            recent = [h["greedy_accuracy"] for h in history[-WARM_EVALS:]]
            accuracy = sum(recent) / len(recent) if len(recent) == WARM_EVALS else 0.0
            log(f"warm start: step {step} loss {loss.item():.3f} selection {recent[-1]:.3f}, mean {accuracy:.3f}")
            if len(recent) == WARM_EVALS and low <= accuracy <= high:
                break
            if accuracy > high:
                raise SystemExit(f"learning: the warm start jumped past {high} ({history}); lower its rate")
    if not low <= accuracy <= high:
        raise SystemExit(f"learning: the warm start did not reach {low} in {step} steps: {history}")
    held_out = greedy_accuracy(
        model, tok, [r["prompt"] for r in test], [r["reward_model"]["ground_truth"] for r in test], compute_score
    )
    log(f"warm start: held-out greedy accuracy {held_out:.3f}")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"]], pad_token_id=ids["<|endoftext|>"]
    ).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "config": {
            k: getattr(config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },
        "sft_rows": len(sft),
        "sft_steps": step,
        "sft_seconds": round(time.monotonic() - started, 1),
        # On the held-out rows (validation before step 1 scores the same); the selection's mean chose the model.
        "greedy_accuracy": held_out,
        "selection": {"rows": len(select), "evaluations": WARM_EVALS, "mean_accuracy": accuracy, "band": [low, high]},
        "seed": seed,
        "history": history,
    }


def curves(log_lines: list[str], parse_steps) -> dict:
    """The validation score per evaluation and the training curves, by step, from a run's console log."""
    steps = parse_steps(log_lines)
    return {
        "validation": {str(s): m[VAL_KEY] for s, m in sorted(steps.items()) if VAL_KEY in m},
        "train": {key: {str(s): m[key] for s, m in sorted(steps.items()) if key in m} for key in CURVES},
        "steps_done": max((s for s in steps if s >= 1), default=0),
        "seconds_per_step": {str(s): m["timing_s/step"] for s, m in sorted(steps.items()) if "timing_s/step" in m},
    }


def plot(record: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in record["runs"].items():
        val = run["curves"]["validation"]
        left.plot([int(s) for s in val], [v * 100 for v in val.values()], marker="o", label=f"{name} ({run['label']})")
        score = run["curves"]["train"]["critic/score/mean"]
        right.plot([int(s) for s in score], [v * 100 for v in score.values()], label=name)
    left.set(xlabel="PPO step", ylabel="greedy validation accuracy, %", title=f"{VAL_ROWS} held-out rows")
    right.set(xlabel="PPO step", ylabel="train score (sampled), %", title="critic/score/mean")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(record["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    print(json.dumps({"schedule": SCHEDULE}), file=sys.stdout)

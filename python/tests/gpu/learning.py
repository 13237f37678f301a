"""The learning proof, on the GPU machine (run_check.py --learn): a model that scores gets better under the P40 script.

No hub is reachable there, so the model is made on the spot:
- data: GSM8K-style word problems (a + b * c with names and objects, the answer after "#### "), converted by
  training_data's own converter into verl's layout. A problem's content is its numbers (a, b, c): the validation
  problems' triples occur in no fine-tuning row and no PPO row, nor do the warm start's selection rows' in any
  fine-tuning row (make_sets; the overlap is measured from the converted files and recorded, 0 expected);
- the fine-tuning rows are a weak teacher's: in a sum that carries it drops the carry in TEACHER_SLIP of its answers
  (37 + 45 = 72), a classic slip. Fine-tuning then levels off near the share of sums without a carry (about 39%),
  in the proof's band, whatever the seed: a plateau that more fine-tuning does not lift, while the PPO and
  validation rows are scored against the true answer by verl's GSM8K rule. That is what the proof asks of PPO:
  to learn from the reward what the fine-tuning rows do not teach;
- a small model of Qwen2's architecture with a byte-level BPE tokenizer that splits digits, warm-started by supervised
  fine-tuning in plain torch (chat template, loss on the answer only, constant rate), its greedy accuracy scored by
  verl's GSM8K rule every SFT_EVERY steps on SELECT_ROWS rows of the PPO prompts (not the validation rows, which
  then do not choose the model). It is chosen on a plateau: over the last PLATEAU_STEPS steps (as many samples as
  PPO will see) a least-squares line rises by at most PLATEAU_RISE and the mean lies in [WARM_LOW, WARM_HIGH]
  (plateau()). A warm start that passes the band or finds no plateau is recorded as such, never silently used;
- then the cases' launch scripts as rendered (run_check.install_case), with the model, the data and a short schedule
  passed through (SCHEDULE), run side by side from the same warm start: the 1x P40 rendering (fp32, the patches,
  the hf rollout, the 23 GiB cap, TF32 off), the negative control (the same script on a copy of the patched verl
  tree with the positions fix taken back, TREES), and optionally the bf16 reference (the modern profile). Greedy
  validation before step 1 and every VAL_EVERY steps on VAL_ROWS content-disjoint rows;
- beside them, the fine-tuning-only continuation (continue_fine_tuning): the same warm start fine-tuned on, as
  before, for as many samples as PPO sees, scored on the same validation rows at the same points. The rise must
  be PPO's, not fine-tuning's left over;
- from several warm starts (seeds) in one call. verdict() and accepted() say what the record must show.
Each run's console log is read with the smoke helper's parser (roles/launch_script/files/launch_script_smoke.py).

usage (run_check.py runs these, one process a warm start or continuation):
  learning.py warm SPEC_JSON       SPEC: data, out, state, rule, seed[, low, high, tiny]; prints one JSON object
  learning.py continue SPEC_JSON   SPEC: data, model, state, rule, seed[, tiny]; prints one JSON object
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random
import re
import sys
import time

WARM_LOW, WARM_HIGH = 0.25, 0.45
SELECT_ROWS = 512
VAL_ROWS = 512
PPO_ROWS = 16384
SFT_ROWS = 24000
# Six PPO runs side by side (three warm starts, the P40 rendering and its control each) and three fine-tuning runs
# fit one 10-minute call on an H100 at 60 steps, not 100 (4 runs of 100 steps took 6.5 minutes there).
STEPS = 60
VAL_EVERY = 10
TRAIN_BATCH = 128
SFT_BATCH = 64
SFT_RATE = 1e-3
SFT_MAX_STEPS = 2000
# One evaluation per 10 PPO steps' worth of samples: the continuation is scored where PPO validates.
SFT_EVERY = VAL_EVERY * TRAIN_BATCH // SFT_BATCH
# The plateau's window: as many samples as PPO sees. A rise of 3 points across it is about 1.4 standard deviations
# of one evaluation on 512 rows at 35%; the fitted line averages the window's evaluations.
PLATEAU_STEPS = STEPS * TRAIN_BATCH // SFT_BATCH
PLATEAU_RISE = 0.03
# The weak teacher's share of carrying sums whose carry it drops; the rest of its answers are right.
TEACHER_SLIP = 0.75
# The proof's warm starts: seeds 0 and 1 were the record's before; 2 is one it had not used.
SEEDS = (0, 1, 2)
SCHEDULE = [
    f"data.train_batch_size={TRAIN_BATCH}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "data.max_prompt_length=160",
    "data.max_response_length=48",
    # A 4M-parameter model moves at rates a 0.5B one would not take. 2e-4 collapsed both renderings on an H100
    # (validation 17% to 1-2% by step 80); 5e-5 and 7e-5 rose as well from a 42% warm start (docs/gpu-sweep.md).
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "critic.optim.lr=5e-4",
    f"trainer.total_training_steps={STEPS}",
    f"trainer.test_freq={VAL_EVERY}",
    # No checkpoint: the proof needs none, and six runs writing them cost the call's minutes.
    "trainer.save_freq=-1",
    "trainer.total_epochs=10",
]
CURVES = ["critic/score/mean", "actor/ppo_kl", "critic/vf_explained_var", "response_length/clip_ratio"]
VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana"]
THINGS = ["marbles", "apples", "stamps", "cards", "shells", "coins"]
# Runs on another verl tree: {name: {file: (old, new)}}, applied to a copy of the case's patched tree. The negative
# control takes back verl_patches' hf-rollout-positions entry (roles/verl_patches/vars/main/patchsets/
# verl-0.4.1.yml): generate() gets the prompt's position_ids again, as in the release, so every token is sampled at
# the prompt's last position (python/tests/cpu/rollout_positions.py shows it on a CPU).
POSITIONS_FIXED = "                attention_mask=attention_mask,\n                do_sample=do_sample,\n"
POSITIONS_UNFIXED = (
    "                attention_mask=attention_mask,\n"
    "                position_ids=position_ids,\n"
    "                do_sample=do_sample,\n"
)
TREES = {"positions-unfixed": {"verl/workers/rollout/hf_rollout.py": (POSITIONS_FIXED, POSITIONS_UNFIXED)}}
# The proof's runs, by name: the P40 rendering, its negative control and (optional) the bf16 reference.
PROOF, CONTROL, REFERENCE = "p40-1x", "control", "a100-1x"


def numbers(question: str) -> tuple[int, ...]:
    """A problem's content: the numbers in its question, in order (names and objects are not content)."""
    return tuple(int(n) for n in re.findall(r"\d+", question))


def carries(a: int, b: int) -> bool:
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def dropped_carry(a: int, b: int) -> int:
    """a + b added column by column with every carry dropped: the weak teacher's slip."""
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def problem(rng: random.Random, triple: tuple[int, int, int], slip: bool = False) -> dict:
    a, b, c = triple
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    question = f"{name} has {a} {thing} and gets {b} bags with {c} {thing} in each. How many {thing} does {name} have?"
    total = dropped_carry(a, b * c) if slip else a + b * c
    answer = f"{b} * {c} = {b * c}. {a} + {b * c} = {total}.\n#### {total}"
    return {"question": question, "answer": answer}


def rows(rng: random.Random, triples: list, count: int, slip: float = 0.0) -> list[dict]:
    """count rows of distinct questions over triples, in turn; a carrying sum's answer slips with probability slip."""
    seen, out = set(), []
    while len(out) < count:
        triple = triples[len(out) % len(triples)] if len(out) < len(triples) else rng.choice(triples)
        row = problem(rng, triple, carries(triple[0], triple[1] * triple[2]) and rng.random() < slip)
        if row["question"] not in seen:
            seen.add(row["question"])
            out.append(row)
    return out


def make_sets(raw: pathlib.Path) -> dict:
    """sft (warm start), train (PPO prompts, the first SELECT_ROWS of which select the warm start) and test
    (validation), disjoint in content: the test triples occur in neither sft nor train, the selection's not in sft."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    space = [(a, b, c) for a in range(10, 100) for b in range(2, 10) for c in range(2, 10)]
    rng.shuffle(space)
    val, select, rest = space[:VAL_ROWS], space[VAL_ROWS : VAL_ROWS + SELECT_ROWS], space[VAL_ROWS + SELECT_ROWS :]
    sets = {
        "test": rows(rng, val, VAL_ROWS),
        "train": rows(rng, select, SELECT_ROWS) + rows(rng, rest, PPO_ROWS - SELECT_ROWS),
        "sft": rows(rng, rest, SFT_ROWS, TEACHER_SLIP),
    }
    files = {}
    for split, chunk in sets.items():
        path = raw / "main" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(chunk), path)
        files[split] = str(path.relative_to(raw))
    return files


def overlap(data_dir: pathlib.Path) -> dict:
    """Measured from the converted files (what the runs read): the validation problems whose numbers occur in the
    fine-tuning or PPO rows, the selection rows' in the fine-tuning rows, and shared question texts."""
    import pyarrow.parquet as pq

    def load(name):
        return [r["prompt"][0]["content"] for r in pq.read_table(data_dir / f"{name}.parquet").to_pylist()]

    test, train, sft = load("test"), load("train"), load("sft")
    content = {name: {numbers(q) for q in texts} for name, texts in (("train", train), ("sft", sft))}
    test_content = {numbers(q) for q in test}
    select_content = {numbers(q) for q in train[:SELECT_ROWS]}
    return {
        "content": "the numbers (a, b, c) of a question",
        "validation_problems": len(test_content),
        "validation_in_sft": len(test_content & content["sft"]),
        "validation_in_ppo": len(test_content & content["train"]),
        "selection_in_sft": len(select_content & content["sft"]),
        "validation_questions_in_training": len(set(test) & (set(train) | set(sft))),
    }


def teacher(data_dir: pathlib.Path) -> dict:
    """The fine-tuning rows as written: how many carry, how many of those the teacher got wrong, and how many of the
    rows without a carry it got wrong (0: it slips only on carries)."""
    import pyarrow.parquet as pq

    counts = {"rows": 0, "carrying": 0, "carrying_wrong": 0, "not_carrying_wrong": 0}
    for row in pq.read_table(data_dir / "sft.parquet").to_pylist():
        a, b, c = numbers(row["prompt"][0]["content"])
        wrong = row["reward_model"]["ground_truth"] != str(a + b * c)
        carry = carries(a, b * c)
        counts["rows"] += 1
        counts["carrying"] += carry
        counts["carrying_wrong" if carry else "not_carrying_wrong"] += wrong
    return {"slip": TEACHER_SLIP, **counts}


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


def greedy_accuracy(model, tok, prompts: list[list[dict]], truths: list[str], score, batch: int = 512) -> float:
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


def plateau(history: list[dict], low: float, high: float, window: int = PLATEAU_STEPS, every: int = SFT_EVERY) -> dict:
    """The last `window` SFT steps of an evaluation history ({step, greedy_accuracy}, every `every` steps): their
    mean, and the rise of a least-squares line across them. A plateau when the window is full, the fitted rise is at
    most PLATEAU_RISE and the mean lies in [low, high]; past the band when the mean is above it."""
    last = history[-1]["step"] if history else 0
    points = [(h["step"], h["greedy_accuracy"]) for h in history if h["step"] >= last - window]
    full = len(points) >= window // every + 1 and points[0][0] <= last - window
    mean = sum(y for _, y in points) / len(points) if points else 0.0
    rise = 0.0
    if len(points) >= 2:
        xs = [x for x, _ in points]
        mx = sum(xs) / len(xs)
        spread = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - mean) for x, y in points) / spread if spread else 0.0
        rise = slope * (xs[-1] - xs[0])
    return {
        "from_step": points[0][0] if points else 0,
        "to_step": last,
        "evaluations": len(points),
        "mean_accuracy": round(mean, 4),
        "fitted_rise": round(rise, 4),
        "plateau": full and rise <= PLATEAU_RISE,
        "in_band": low <= mean <= high,
        "past_band": full and mean > high,
    }


# A dry run's sizes (tiny=True: a CPU test runs the whole path in seconds; it proves the code runs, not learning).
TINY = {
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "max_steps": 6,
    "every": 2,
    "window": 4,
    "rows": 16,
    "vocab": 300,
    "sft_rows": 256,
}
FULL = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "max_steps": SFT_MAX_STEPS,
    "every": SFT_EVERY,
    "window": PLATEAU_STEPS,
    "rows": SELECT_ROWS,
    "vocab": 1024,
}


class Trainer:
    """Supervised fine-tuning of the small Qwen2 on the converted sft rows (loss on the answer only), at a constant
    rate; its state (model, optimizer, sampler) saves and loads, so a continuation is more of the same training."""

    def __init__(self, data_dir: pathlib.Path, model_dir: pathlib.Path, seed: int, sizes: dict, template: str = ""):
        import pyarrow.parquet as pq
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sizes = sizes
        sft = pq.read_table(data_dir / "sft.parquet").to_pylist()[: sizes.get("sft_rows")]
        if template:
            texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in sft[:4000]]
            self.tok = tokenizer(texts, model_dir, template, sizes["vocab"])
        else:
            self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.ids = {t: self.tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
        torch.manual_seed(seed)
        if template:
            self.config = Qwen2Config(
                vocab_size=len(self.tok),
                hidden_size=sizes["hidden"],
                intermediate_size=4 * sizes["hidden"],
                num_hidden_layers=sizes["layers"],
                num_attention_heads=sizes["heads"],
                num_key_value_heads=2,
                max_position_embeddings=512,
                rope_theta=10000.0,
                tie_word_embeddings=True,
                bos_token_id=self.ids["<|endoftext|>"],
                eos_token_id=self.ids["<|im_end|>"],
                pad_token_id=self.ids["<|endoftext|>"],
            )
            self.model = Qwen2ForCausalLM(self.config).to(self.device)
        else:
            self.model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(self.device)
            self.config = self.model.config
        self.examples = []
        for r in sft:
            prompt = self.tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            p = self.tok(prompt, add_special_tokens=False)["input_ids"]
            a = self.tok(r["extra_info"]["answer"], add_special_tokens=False)["input_ids"] + [self.ids["<|im_end|>"]]
            self.examples.append((p, a))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=SFT_RATE, weight_decay=0.0)
        self.rng = random.Random(seed)
        self.step = 0

    def train_step(self) -> float:
        import torch

        chunk = self.rng.sample(self.examples, SFT_BATCH)
        width = max(len(p) + len(a) for p, a in chunk)
        pad = self.ids["<|endoftext|>"]
        x = torch.full((SFT_BATCH, width), pad, dtype=torch.long)
        y = torch.full((SFT_BATCH, width), -100, dtype=torch.long)
        mask = torch.zeros((SFT_BATCH, width), dtype=torch.long)
        for i, (p, a) in enumerate(chunk):
            seq = p + a
            x[i, : len(seq)] = torch.tensor(seq)
            y[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        # The warm start is not under test: bf16 matmuls are fine here (a CPU dry run stays in fp32).
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.model(
                input_ids=x.to(self.device), attention_mask=mask.to(self.device), labels=y.to(self.device)
            ).loss
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.step += 1
        return loss.item()

    def save_state(self, path: pathlib.Path) -> None:
        import torch

        torch.save({"optim": self.optim.state_dict(), "rng": self.rng.getstate(), "step": self.step}, path)

    def load_state(self, path: pathlib.Path) -> None:
        import torch

        state = torch.load(path, weights_only=False)
        self.optim.load_state_dict(state["optim"])
        self.rng.setstate(state["rng"])
        self.step = state["step"]


def load_rule(path: str):
    """verl's own GSM8K rule, from the case's tree (a file of plain Python: no verl import)."""
    spec = importlib.util.spec_from_file_location("gsm8k_rule", path)
    rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rule)
    return rule.compute_score


def scored(data_dir: pathlib.Path, name: str, count: int) -> tuple[list, list]:
    import pyarrow.parquet as pq

    found = pq.read_table(data_dir / f"{name}.parquet").to_pylist()[:count]
    return [r["prompt"] for r in found], [r["reward_model"]["ground_truth"] for r in found]


def warm_start(spec: dict, template: str, log=print) -> dict:
    """SFT of a small Qwen2 until it sits on a plateau in the band (plateau()), scored on rows of the PPO prompts;
    then its accuracy on the validation rows, which validation before step 1 repeats. The model goes to spec["out"],
    the optimizer and sampler to spec["state"] (the continuation's start). Stops past the band or at the step
    limit without a plateau, and says so: the record then shows a warm start that does not count."""
    import torch
    from transformers import GenerationConfig

    sizes = TINY if spec.get("tiny") else FULL
    low = WARM_LOW if spec.get("low") is None else spec["low"]
    high = WARM_HIGH if spec.get("high") is None else spec["high"]
    data_dir, out, seed = pathlib.Path(spec["data"]), pathlib.Path(spec["out"]), spec["seed"]
    score = load_rule(spec["rule"])
    started = time.monotonic()
    trainer = Trainer(data_dir, out, seed, sizes, template)
    prompts, truths = scored(data_dir, "train", sizes["rows"])
    history, stopped, window, loss = [], "step limit", plateau([], low, high), 0.0
    while trainer.step < sizes["max_steps"]:
        loss = trainer.train_step()
        # Sparser while it scores nothing yet: the window needs evaluations every `every` steps only once it scores.
        scoring = history and history[-1]["greedy_accuracy"] >= 0.05
        if trainer.step % (sizes["every"] if scoring else sizes["every"] * 5 // 2):
            continue
        accuracy = greedy_accuracy(trainer.model, trainer.tok, prompts, truths, score)
        history.append({"step": trainer.step, "loss": round(loss, 4), "greedy_accuracy": accuracy})
        window = plateau(history, low, high, sizes["window"], sizes["every"])
        log(
            f"warm start {seed}: step {trainer.step} loss {loss:.3f} selection {accuracy:.3f}, window mean "
            f"{window['mean_accuracy']:.3f} rise {window['fitted_rise']:+.3f}"
        )
        if window["plateau"] and window["in_band"]:
            stopped = "plateau in the band"
            break
        if window["past_band"]:
            stopped = "past the band"
            break
    test_prompts, test_truths = scored(data_dir, "test", VAL_ROWS if not spec.get("tiny") else sizes["rows"])
    held_out = greedy_accuracy(trainer.model, trainer.tok, test_prompts, test_truths, score)
    log(f"warm start {seed}: {stopped} at step {trainer.step}; validation greedy accuracy {held_out:.3f}")
    trainer.model.save_pretrained(out, safe_serialization=True)
    trainer.save_state(pathlib.Path(spec["state"]))
    GenerationConfig(
        bos_token_id=trainer.ids["<|endoftext|>"],
        eos_token_id=[trainer.ids["<|im_end|>"]],
        pad_token_id=trainer.ids["<|endoftext|>"],
    ).save_pretrained(out)
    config = trainer.config
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "config": {k: getattr(config, k) for k in (*keys, "vocab_size")},
        "sft_rows": len(trainer.examples),
        "sft_steps": trainer.step,
        "sft_batch": SFT_BATCH,
        "sft_rate": SFT_RATE,
        "sft_seconds": round(time.monotonic() - started, 1),
        "device": trainer.device,
        # On the validation rows (validation before step 1 scores the same); the selection's window chose the model.
        "greedy_accuracy": held_out,
        "selection": {
            "rows": len(prompts),
            "band": [low, high],
            "plateau_rise_at_most": PLATEAU_RISE,
            "window_steps": sizes["window"],
            "stopped": stopped,
            **window,
        },
        "seed": seed,
        "history": history,
        "torch": torch.__version__,
    }


def continue_fine_tuning(spec: dict, log=print) -> dict:
    """The fine-tuning-only continuation: the warm start (model, optimizer, sampler) fine-tuned on the same rows at
    the same rate for as many samples as PPO sees (STEPS x TRAIN_BATCH), scored greedily on the validation rows
    every VAL_EVERY PPO steps' worth of samples, as PPO's validation is; keyed by that PPO step."""
    sizes = TINY if spec.get("tiny") else FULL
    data_dir, seed = pathlib.Path(spec["data"]), spec["seed"]
    score = load_rule(spec["rule"])
    started = time.monotonic()
    trainer = Trainer(data_dir, pathlib.Path(spec["model"]), seed, sizes)
    trainer.load_state(pathlib.Path(spec["state"]))
    prompts, truths = scored(data_dir, "test", VAL_ROWS if not spec.get("tiny") else sizes["rows"])
    steps = spec.get("steps", STEPS)
    per_eval = VAL_EVERY * TRAIN_BATCH // SFT_BATCH
    validation = {"0": greedy_accuracy(trainer.model, trainer.tok, prompts, truths, score)}
    for done in range(1, steps * TRAIN_BATCH // SFT_BATCH + 1):
        loss = trainer.train_step()
        if done % per_eval == 0:
            ppo_step = done * SFT_BATCH // TRAIN_BATCH
            validation[str(ppo_step)] = greedy_accuracy(trainer.model, trainer.tok, prompts, truths, score)
            found = validation[str(ppo_step)]
            log(f"fine-tuning only {seed}: {done} steps (PPO step {ppo_step}) loss {loss:.3f} validation {found:.3f}")
    return {
        "validation": validation,
        "sft_steps": steps * TRAIN_BATCH // SFT_BATCH,
        "sft_batch": SFT_BATCH,
        "sft_rate": SFT_RATE,
        "samples": steps * TRAIN_BATCH,
        "from_sft_step": trainer.step - steps * TRAIN_BATCH // SFT_BATCH,
        "seconds": round(time.monotonic() - started, 1),
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


def rise(validation: dict) -> dict:
    """A validation curve ({step: accuracy}) against its step 0: the best rise, and the last three evaluations' mean
    rise."""
    val = {int(step): score for step, score in validation.items()}
    if 0 not in val or len(val) < 4:
        return {"start": val.get(0), "best": None, "last3": None, "evaluations": len(val)}
    last = [val[s] for s in sorted(val)[-3:]]
    return {
        "start": val[0],
        "best": round(max(val.values()) - val[0], 4),
        "last3": round(sum(last) / 3 - val[0], 4),
        "evaluations": len(val),
    }


# What a warm start must show to count (one standard deviation of one evaluation on 512 rows is about 2.2 points).
RISE_BEST, RISE_LAST3 = 0.10, 0.05


def verdict(entry: dict, steps: int = STEPS) -> dict:
    """One warm start of the proof: it counts when it was chosen on a plateau in the band, the P40 rendering ran
    every step and its validation rose by RISE_BEST at best and RISE_LAST3 over its last three evaluations, both
    more than the fine-tuning-only continuation's, and the negative control rose by neither."""
    selection = entry["warm_start"]["selection"]
    runs = entry["runs"]
    p40 = rise(runs[PROOF]["curves"]["validation"]) if PROOF in runs else rise({})
    control = rise(runs[CONTROL]["curves"]["validation"]) if CONTROL in runs else rise({})
    tuned = rise(entry.get("fine_tuning_only", {}).get("validation", {}))
    ran = PROOF in runs and runs[PROOF]["curves"]["steps_done"] == steps
    control_ran = CONTROL in runs and runs[CONTROL]["curves"]["steps_done"] == steps
    rose = ran and p40["best"] is not None and p40["best"] >= RISE_BEST and p40["last3"] >= RISE_LAST3
    beat = rose and tuned["best"] is not None and p40["best"] > tuned["best"] and p40["last3"] > tuned["last3"]
    flat = control_ran and control["best"] is not None and control["best"] < RISE_BEST and control["last3"] < RISE_LAST3
    plateaued = bool(selection.get("plateau") and selection.get("in_band"))
    return {
        "seed": entry["warm_start"]["seed"],
        "plateaued_in_band": plateaued,
        "p40": p40,
        "control": control,
        "fine_tuning_only": tuned,
        "p40_rose": rose,
        "p40_beat_fine_tuning": beat,
        "control_stayed_flat": flat,
        "counts": plateaued and beat and flat,
    }


def accepted(warm_starts: list[dict], steps: int = STEPS) -> dict:
    """The proof's acceptance (issue 60): three warm starts recorded, each with its control flat, and at least two
    of them counting (verdict())."""
    verdicts = [verdict(entry, steps) for entry in warm_starts]
    seeds = [v["seed"] for v in verdicts]
    return {
        "warm_starts": len(verdicts),
        "distinct_seeds": len(set(seeds)) == len(seeds),
        "counting": sum(v["counts"] for v in verdicts),
        "controls_flat": all(v["control_stayed_flat"] for v in verdicts),
        "ok": len(verdicts) == 3
        and len(set(seeds)) == 3
        and all(v["control_stayed_flat"] for v in verdicts)
        and sum(v["counts"] for v in verdicts) >= 2,
        "verdicts": verdicts,
    }


def plot(record: dict, path: pathlib.Path) -> None:
    """One panel a warm start: each run's greedy validation and the fine-tuning-only continuation, by PPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = record["warm_starts"]
    fig, axes = plt.subplots(1, max(1, len(entries)), figsize=(5 * max(1, len(entries)), 4), squeeze=False)
    for ax, entry in zip(axes[0], entries, strict=False):
        for name, run in entry["runs"].items():
            val = run["curves"]["validation"]
            ax.plot([int(s) for s in val], [v * 100 for v in val.values()], marker="o", label=name)
        tuned = entry.get("fine_tuning_only", {}).get("validation", {})
        if tuned:
            ax.plot([int(s) for s in tuned], [v * 100 for v in tuned.values()], ls="--", label="fine-tuning only")
        warm = entry["warm_start"]
        ax.set(
            xlabel="PPO step (fine-tuning only: its samples' worth)",
            ylabel="greedy validation accuracy, %",
            title=f"seed {warm['seed']}: warm start {warm['greedy_accuracy']:.0%} ({warm['selection']['stopped']})",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(record["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    # The chat template is run_check's (one home): passed in the spec by whoever starts this.
    command, spec = argv[0], json.loads(argv[1])
    if command == "warm":
        found = warm_start(spec, spec["template"])
    elif command == "continue":
        found = continue_fine_tuning(spec)
    else:
        raise SystemExit(f"learning.py: unknown command {command!r} (warm, continue)")
    print("learning-json: " + json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

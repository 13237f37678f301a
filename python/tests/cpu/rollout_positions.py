"""In the CPU venv: verl's real HFRollout generates greedily; teacher forcing must reproduce every token it sampled.

usage: python rollout_positions.py   (with a verl source tree first on PYTHONPATH; prints one JSON object)

A small Qwen2 whose rotary base and weight scale make positions matter generates greedily through
verl.workers.rollout.hf_rollout.HFRollout from left-padded prompts. The positions the model receives on each forward
pass are recorded. Then one forward pass over the `input_ids`, `attention_mask` and `position_ids` the rollout
returned (what verl trains on) predicts each response token from the tokens before it: with correct sampling every
greedy token is that argmax. Reported: the decode steps whose positions did not advance by one, and the response
tokens teacher forcing does not reproduce. The test (python/tests/test_cpu_verl.py) asserts on them.
"""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.workers.rollout.hf_rollout import HFRollout

# HFRollout empties the device's cache after each batch; torch 2.6 has no such call for the CPU, which has no cache.
if not hasattr(torch.cpu, "empty_cache"):
    torch.cpu.empty_cache = lambda: None

PAD, EOS = 0, 1
RESPONSE = 10
PROMPT_LENGTHS = [3, 5, 8, 6]


def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # A short rotary wavelength and large weights: a token's logits change with its position.
        rope_theta=10.0,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).float().eval()


def prompts() -> DataProto:
    generator = torch.Generator().manual_seed(1)
    width = max(PROMPT_LENGTHS)
    ids = torch.full((len(PROMPT_LENGTHS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length :] = torch.randint(2, 64, (length,), generator=generator)
        mask[row, width - length :] = 1
    data = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)}
    )
    data.meta_info = {"eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False}
    return data


def main() -> None:
    policy = model()
    seen: list[torch.Tensor] = []

    def record(_module, _args, kwargs):
        seen.append(kwargs["position_ids"].clone())

    hook = policy.model.register_forward_pre_hook(record, with_kwargs=True)
    config = OmegaConf.create(
        {"micro_batch_size": len(PROMPT_LENGTHS), "do_sample": False, "temperature": 1.0, "response_length": RESPONSE}
    )
    data = prompts()
    out = HFRollout(policy, config).generate_sequences(data)
    hook.remove()

    mask = data.batch["attention_mask"]
    last = data.batch["position_ids"][:, -1]
    stuck = []
    # seen[0] is the prefill; seen[k] holds the one position of decode step k, which must be the last prompt
    # position + k for every row.
    for step, positions in enumerate(seen[1:], start=1):
        wanted = last + step
        if not torch.equal(positions[:, -1], wanted):
            stuck.append({"step": step, "got": positions[:, -1].tolist(), "wanted": wanted.tolist()})

    batch = out.batch
    with torch.no_grad():
        logits = policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    width = mask.shape[1]
    predicted = logits[:, width - 1 : -1].argmax(-1)
    responses = batch["responses"]
    response_mask = batch["attention_mask"][:, width:]
    differ = []
    for row in range(responses.shape[0]):
        for t in range(responses.shape[1]):
            if response_mask[row, t] and predicted[row, t] != responses[row, t]:
                differ.append(
                    {"row": row, "token": t, "sampled": int(responses[row, t]), "forced": int(predicted[row, t])}
                )
    print(
        json.dumps(
            {
                "forward_passes": len(seen),
                "prefill_positions": seen[0].tolist(),
                "decode_positions": [p[:, -1].tolist() for p in seen[1:]],
                "stuck_steps": stuck,
                "tokens_checked": int(response_mask.sum()),
                "tokens_differ": differ,
            }
        )
    )


if __name__ == "__main__":
    main()

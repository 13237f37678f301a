"""In the CPU venv: eager against SDPA attention in transformers' Qwen2, fp32, on left-padded prompts as verl pads.

usage: python attention_parity.py   (prints one JSON object)

The Pascal profile patches verl to eager attention; SDPA would keep only each layer's output instead of its fp32
score matrices. Before SDPA can replace it, the two must agree where verl reads the model: the same fp32 weights,
a left-padded batch with verl's position ids (cumulative sum of the mask), logits at the real tokens. On this CPU
torch picks its own SDPA kernel; the GPU sweep (tests/gpu/sweep.py) checks the GPU's. The test
(python/tests/test_cpu_attention.py) asserts within 1e-5.
"""

from __future__ import annotations

import json

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
config = Qwen2Config(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ids = torch.randint(3, 512, (6, 40))
mask = torch.ones_like(ids)
for row in range(ids.shape[0]):
    mask[row, : row * 6] = 0
positions = (mask.cumsum(-1) - 1).clamp(min=0)
logits = {}
for kind in ("eager", "sdpa"):
    torch.manual_seed(1)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=kind, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits[kind] = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
real = mask.bool()
diff = (logits["eager"] - logits["sdpa"]).abs()[real]
print(
    json.dumps(
        {
            "max_abs_diff": diff.max().item(),
            "max_abs_logit": logits["eager"].abs()[real].max().item(),
            "attn": [model.config._attn_implementation],
            "real_tokens": int(real.sum()),
        }
    )
)

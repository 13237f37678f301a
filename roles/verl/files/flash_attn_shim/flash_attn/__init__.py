"""p40fleet's flash_attn shim: only `flash_attn.bert_padding`, no kernels.

Why: verl 0.4.1's dp_actor and dp_critic import `flash_attn.bert_padding` at module load, so verl fails to
start without flash_attn. The real flash-attn wheels are CUDA 12 builds (they do not load beside the
cu118 torch) and its kernels need sm80+, so a P40 (sm61) could not use them anyway. bert_padding itself is
pure torch + einops; this package carries that module (BSD-3-Clause, from flash-attn 2.7.4.post1) and
nothing else.

The distribution is named p40fleet-flash-attn-shim, not flash_attn: `importlib.metadata.version("flash_attn")`
still fails, so transformers' is_flash_attn_2_available() stays False and nothing selects
attn_implementation="flash_attention_2" because of this shim. Calling a kernel entry point raises.
"""

__version__ = "2.7.4.post1+p40fleet.shim"
SHIM = True


def _no_kernels(*args, **kwargs):
    raise RuntimeError(
        "flash_attn here is p40fleet's shim (bert_padding only): FlashAttention kernels need sm80+ and a CUDA 12 "
        "build; use attn_implementation='eager' or 'sdpa' on this GPU"
    )


flash_attn_func = _no_kernels
flash_attn_varlen_func = _no_kernels
flash_attn_qkvpacked_func = _no_kernels
flash_attn_varlen_qkvpacked_func = _no_kernels
flash_attn_kvpacked_func = _no_kernels
flash_attn_varlen_kvpacked_func = _no_kernels
flash_attn_with_kvcache = _no_kernels

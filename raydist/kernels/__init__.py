"""Triton kernels with their plain-torch references, and their selection for the model.

- attention.py: flash attention forward + backward (causal/full, grouped-query, LSE out) — `flash_attention`
- matmul.py: tiled matmul with a fused epilogue (bias, GELU/SiLU, SwiGLU) — `matmul`, `linear`, `swiglu`
- reference.py: the plain-torch oracle of each kernel, also the CPU path
- select.py: `apply_kernels(model, cfg.kernels, device)` installs the choice from `[kernels]`
- runtime.py: where Triton can run (CUDA, or CPU under TRITON_INTERPRET=1) and which kernels ran

Importing this package imports neither Triton nor touches a device: the @triton.jit modules
(triton_attention.py, triton_matmul.py) load on the first kernel call.
"""

from raydist.kernels.attention import attention_backward, attention_forward, flash_attention
from raydist.kernels.matmul import linear, matmul, swiglu
from raydist.kernels.reference import (attention_reference, linear_reference, matmul_reference,
                                       merge_attention, swiglu_reference)
from raydist.kernels.runtime import kernel_calls
from raydist.kernels.select import apply_kernels, resolve_kernels

__all__ = [
    "apply_kernels", "resolve_kernels", "kernel_calls",
    "flash_attention", "attention_forward", "attention_backward",
    "matmul", "linear", "swiglu",
    "attention_reference", "merge_attention", "matmul_reference", "linear_reference", "swiglu_reference",
]

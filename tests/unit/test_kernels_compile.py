"""The Triton kernels compile for real GPUs (sm_80, sm_90) without one: Triton lowers them to PTX and runs
the bundled ptxas, which catches what the CPU interpreter cannot (layouts, tl.dot shapes and dtypes,
shared-memory use). Running them on hardware is tests/gpu/test_kernels_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from raydist.kernels import runtime

pytestmark = [
    pytest.mark.skipif(runtime.triton_import_error() is not None,
                       reason=f"triton not importable: {runtime.triton_import_error()}"),
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset"),
]


@pytest.fixture
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return runtime.load_kernel_module("triton_attention"), runtime.load_kernel_module("triton_matmul")


def compile_for(kernel, arch: int, pointers: dict[str, str], constexprs: dict, floats=(), **options):
    """triton.compile of an autotuned kernel for a CUDA target, with an explicit signature."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit_fn = kernel.fn  # Autotuner -> JITFunction
    signature = {}
    for name in jit_fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in floats else "i32")
    source = ASTSource(jit_fn, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch,dtype", [(90, "bf16"), (80, "fp16")])
def test_kernels_compile_for_cuda(compiled_kernels, arch, dtype):
    attention, matmul = compiled_kernels
    assert not attention.INTERPRETED and not matmul.INTERPRETED
    tensors = {name: f"*{dtype}" for name in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    tensors.update(LSE="*fp32", DELTA="*fp32")
    common = dict(HEAD_DIM=64, CAUSAL=True, UPCAST=False, PRECISION="tf32")
    scales = ("scale", "scale_log2")
    fwd = compile_for(attention._attn_fwd, arch, tensors, dict(common, BLOCK_M=128, BLOCK_N=64), scales,
                      num_warps=4, num_stages=3)
    compile_for(attention._attn_bwd_dkdv, arch, tensors, dict(common, BLOCK_M=32, BLOCK_N=64), scales,
                num_warps=4, num_stages=2)
    compile_for(attention._attn_bwd_dq, arch, tensors, dict(common, BLOCK_M=64, BLOCK_N=32), scales,
                num_warps=4, num_stages=2)
    assert fwd.metadata.shared > 0  # it staged tiles through shared memory, as a flash kernel must
    mm = {name: f"*{dtype}" for name in ("A", "B", "B2", "BIAS", "C", "H1", "H2")}
    epilogue = dict(HAS_BIAS=False, ACTIVATION=0, SWIGLU=True, SAVE_PRE=True, UPCAST=False, PRECISION="tf32",
                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
    compile_for(matmul._matmul, arch, mm, epilogue, num_warps=8, num_stages=3)
    compile_for(matmul._matmul, arch, mm, dict(epilogue, SWIGLU=False, HAS_BIAS=True, ACTIVATION=1),
                num_warps=4, num_stages=4)


def test_fp32_configs_are_pruned_to_small_tiles(compiled_kernels):
    """fp32 tiles would overflow shared memory at BLOCK_M=128, head dim 128 (~225 KB): pruned."""
    attention, matmul = compiled_kernels
    fp32, bf16 = {"Q": torch.empty(0)}, {"Q": torch.empty(0, dtype=torch.bfloat16)}
    kept = attention._prune_fp32(attention.FWD_CONFIGS, fp32)
    assert kept and all(c.kwargs["BLOCK_M"] <= 64 and c.num_stages <= 2 for c in kept)
    assert attention._prune_fp32(attention.FWD_CONFIGS, bf16) == attention.FWD_CONFIGS
    kept = matmul._prune(matmul.MATMUL_CONFIGS, {"A": torch.empty(0, dtype=torch.bfloat16)}, SWIGLU=True)
    assert kept and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128 for c in kept)

"""MFU of a Llama-3-8B-shaped block stack training on one GPU, with the Triton kernels and with torch's.

The model is Llama 3 8B's shape (Dubey et al., "The Llama 3 Herd of Models", 2024: d_model 4096, 32 query
heads, 8 kv heads, ffn 14336, vocabulary 128256, rope_theta 500000, untied head) cut to a few blocks so it
trains on one device. One step = forward, loss, backward and AdamW, as raydist's trainer runs it on CUDA
(fp32 master weights, bf16 autocast). Timed with CUDA events after warm-up steps (Triton's autotuning
happens in the first ones).

    MFU = tokens/s x model FLOPs per token / peak FLOP/s

with the FLOPs per token of `raydist.models.gpt.flops_per_token` (6 N_matmul + 12 L d T: Chowdhery et
al., "PaLM", 2022, appendix B) and the device's dense bf16 peak from `raydist.metrics.flops`. Recompute
(activation checkpointing) is not model FLOPs: it lowers MFU, as it should.

On a CPU machine it says so and exits: a CPU figure would say nothing about the GPU. Its code path runs on
the CPU only in tests (tests/unit/test_gpu_suite.py), on a tiny model under TRITON_INTERPRET=1.

    python benchmarks/mfu.py [--layers 4] [--seq-len 8192] [--batch 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from raydist.config import ModelConfig

LLAMA3_8B = dict(d_model=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
                 rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False)


def llama3_8b_stack(layers: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, **LLAMA3_8B)


class _Timer:
    """Seconds between start() and stop(): CUDA events on a GPU (what the device did, not launch time),
    perf_counter after a synchronisation-free step on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3
        return time.perf_counter() - self.t0


def measure_mfu(cfg: ModelConfig, seq_len: int, batch: int, *, steps: int = 10, warmup: int = 3,
                device: str | torch.device = "cuda", kernels: tuple[str, str] = ("auto", "auto"),
                dtype: torch.dtype = torch.bfloat16, activation_checkpoint: str = "none") -> dict:
    """Trains `steps` timed steps (after `warmup`) of `cfg` on (batch, seq_len) random tokens; returns the
    step time, tokens/s, achieved TFLOP/s, MFU, peak memory and the kernels that ran."""
    from raydist.config import KernelsConfig
    from raydist.kernels import apply_kernels
    from raydist.kernels.select import Workload
    from raydist.metrics.flops import peak_flops
    from raydist.metrics.kernels import kernel_calls, kernels_ran
    from raydist.models.gpt import GPT, flops_per_token, param_counts
    from raydist.models.loss import cross_entropy
    from raydist.parallel.checkpointing import apply_activation_checkpointing

    device = torch.device(device)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: no host copy of the weights
        model = GPT(cfg, seq_len)
    # (`auto` on CUDA times the kernels at this run's shapes first; the head here computes logits, not the fused loss)
    chosen = apply_kernels(model, KernelsConfig(*kernels), device, Workload(batch, seq_len, dtype, fused_loss=False))
    apply_activation_checkpointing(model, activation_checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    timer = _Timer(device)

    def step() -> float:
        with autocast:
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    before = kernel_calls()
    timer.start()
    for _ in range(steps):
        loss = step()
    seconds = timer.stop() / steps
    ran = kernels_ran(since=before)
    tokens_per_s = batch * seq_len / seconds
    per_token = flops_per_token(cfg, seq_len)
    peak, source = peak_flops(device)
    achieved = tokens_per_s * per_token
    counts = param_counts(cfg)
    return {
        "layers": cfg.num_layers, "d_model": cfg.d_model, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
        "ffn": cfg.ffn_hidden, "vocab": cfg.vocab_size, "seq_len": seq_len, "batch": batch,
        "params": counts["total"], "dtype": str(dtype).removeprefix("torch."),
        "activation_checkpoint": activation_checkpoint, "kernels_selected": chosen, "kernels": ran,
        "step_s": seconds, "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
        "head_flops_share": 6.0 * cfg.vocab_size * cfg.d_model / per_token,
        "achieved_tflops": achieved / 1e12, "peak_tflops": peak / 1e12, "peak_source": source,
        "mfu": achieved / peak if peak else None, "final_loss": float(loss.detach()),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def mfu_rows(layers: int, seq_len: int, batch: int, steps: int = 10, warmup: int = 3) -> list[dict]:
    """The Triton kernels and torch's (sdpa, cuBLAS) on the same stack; an OOM is recorded, not raised."""
    rows = []
    for kernels in (("triton", "triton"), ("sdpa", "torch")):
        try:
            row = measure_mfu(llama3_8b_stack(layers), seq_len, batch, steps=steps, warmup=warmup, kernels=kernels)
        except torch.OutOfMemoryError as exc:
            row = {"layers": layers, "seq_len": seq_len, "batch": batch, "kernels_selected": dict(
                zip(("attention", "matmul"), kernels)), "error": f"out of memory: {str(exc).splitlines()[0]}"}
        torch.cuda.empty_cache()
        rows.append(row)
        if "error" in row:
            print(f"mfu  {kernels}: {row['error']}", flush=True)
        else:
            print(f"mfu  Llama-3-8B shape, {layers} blocks, batch {batch} x {seq_len}, kernels {kernels}: "
                  f"step {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['achieved_tflops']:.0f} TFLOP/s of {row['peak_tflops']:.0f} -> MFU {row['mfu']:.1%} "
                  f"(peak memory {row['peak_memory_gb']:.1f} GB)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mfu: skipped: no CUDA device visible to torch (MFU is measured on a GPU; a CPU figure would "
              "say nothing about it)")
        return 0
    rows = mfu_rows(args.layers, args.seq_len, args.batch, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

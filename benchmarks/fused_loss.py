"""The loss of one micro-batch, plain (the head's logits, then cross-entropy) against fused (the head's matmul and
the cross-entropy a chunk of tokens at a time: raydist.models.loss.linear_cross_entropy), side by side in one
run: peak memory and time of forward + backward; and the same two under tensor parallelism over 2 gloo
ranks (the head split over the vocabulary: the plain path's logits sharded and the vocabulary-parallel
cross-entropy, against the fused vocabulary-parallel loss), each rank's peak.

    python benchmarks/fused_loss.py [--tokens 2048] [--vocab 128256] [--d-model 64] [--no-tp] [--json]

Peak is the most bytes held by tensors made inside the call (raydist.metrics.memory.LiveActivations), so it
reads the same on any machine; "beyond the gradients" takes away what any loss hands back, the head weight's
gradient (V x D fp32) and the hidden states' (N x D). Time is the median of three calls (a shared machine:
compare the columns of one run). Llama 3's vocabulary by default, fp32; D is small so that the matmuls stay
cheap on a CPU (the logits' size does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from raydist.metrics.memory import LiveActivations
from raydist.models.loss import LOGITS_CHUNK_BYTES, chunk_rows, cross_entropy, linear_cross_entropy
from raydist.parallel.runtime import spawn
from raydist.parallel.vocab_loss import vocab_parallel_cross_entropy

PATHS = {"plain": lambda h, w, t: cross_entropy(F.linear(h, w), t), "fused": linear_cross_entropy}
# under tensor parallelism h and w are DTensors (Replicate, Shard(0)): F.linear gives Shard(-1) logits
TP_PATHS = {"plain": lambda h, w, t: vocab_parallel_cross_entropy(F.linear(h, w), t), "fused": linear_cross_entropy}
TP = 2


def measure(path: str, tokens: int, vocab: int, d_model: int, tp: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(1, tokens, d_model, generator=g)
    w0 = torch.randn(vocab, d_model, generator=g) / d_model ** 0.5
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    fn = (TP_PATHS if tp else PATHS)[path]
    if tp:  # this rank's rows of the head, the input replicated, as the column-parallel head holds them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (TP,))
        w0 = w0.chunk(TP)[mesh.get_local_rank()].clone()
        vocab //= TP

    def once():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if tp:
            h_in, w_in = DTensor.from_local(h, mesh, (Replicate(),)), DTensor.from_local(w, mesh, (Shard(0),))
        else:
            h_in, w_in = h, w
        loss = fn(h_in, w_in, targets)
        loss.backward()
        return loss.item()

    with LiveActivations(track_peak=True) as live:
        loss = once()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    grads = (vocab + tokens) * d_model * 4  # (vocab: this rank's rows under tp)
    return {"loss": loss, "peak_mib": live.peak_bytes / 2**20, "beyond_grads_mib": (live.peak_bytes - grads) / 2**20,
            "seconds": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel pair (2 gloo ranks)")
    p.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    args = p.parse_args()
    if min(args.tokens, args.vocab, args.d_model) < 1:
        p.error("--tokens, --vocab and --d-model must be positive")
    if not args.no_tp and args.vocab % TP:
        p.error(f"--vocab {args.vocab} must split evenly over tp {TP} (or pass --no-tp)")
    layouts = {"single": {path: measure(path, args.tokens, args.vocab, args.d_model) for path in PATHS}}
    if not args.no_tp:
        per_rank = spawn(_tp_rows, TP, args.tokens, args.vocab, args.d_model, timeout_s=1200.0)
        layouts[f"tp{TP}"] = {path: max((rank[path] for rank in per_rank), key=lambda r: r["peak_mib"])
                              for path in PATHS}
    print(f"N={args.tokens} V={args.vocab} D={args.d_model}; chunks of {LOGITS_CHUNK_BYTES / 2**20:.0f} MiB "
          f"of fp32 logits")
    out = {"benchmark": "fused_loss", "tokens": args.tokens, "vocab": args.vocab, "d_model": args.d_model,
           "layouts": {}}
    for name, rows in layouts.items():
        columns = args.vocab // (TP if name != "single" else 1)
        logits_mib = args.tokens * columns * 4 / 2**20
        plain, fused = rows["plain"], rows["fused"]
        print(f"{name}: a rank's fp32 logits {logits_mib:.0f} MiB (V {columns} a rank); chunks of "
              f"{chunk_rows(columns)} tokens (the worst rank's peak)")
        for path, row in rows.items():
            print(f"  {path:5s}  peak {row['peak_mib']:8.1f} MiB ({row['beyond_grads_mib']:8.1f} beyond the "
                  f"gradients, x{row['beyond_grads_mib'] / logits_mib:.2f} the logits)  {row['seconds']:.3f} s  "
                  f"loss {row['loss']:.6f}")
        memory_ratio = fused["beyond_grads_mib"] / plain["beyond_grads_mib"]
        print(f"  fused / plain: memory beyond the gradients x{memory_ratio:.3f}, "
              f"time x{fused['seconds'] / plain['seconds']:.2f}")
        out["layouts"][name] = {"logits_mib": logits_mib, "paths": rows, "memory_ratio": memory_ratio,
                                "fused_beyond_grads_over_logits": fused["beyond_grads_mib"] / logits_mib,
                                "time_ratio": fused["seconds"] / plain["seconds"]}
    if args.json:
        print(json.dumps(out))


def gpu_rows(tokens: int = 8192, vocab: int = 128256, d_model: int = 4096, repeats: int = 5) -> list[dict]:
    """On CUDA (the GPU suite's `loss` part): the plain loss, the fused one with torch's chunk work and with
    the Triton kernels' (kernels.loss = plain / auto / triton), under bf16 autocast with an fp32 head
    weight and bf16 hidden states, as training runs them: forward + backward seconds (median of `repeats`
    after a warm-up that compiles the kernels) and the peak bytes allocated beyond what was held before
    (the gradients included: dW in fp32, V x D x 4 bytes)."""
    from raydist.kernels.cross_entropy import TRITON_CHUNKS

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    h0 = torch.randn(1, tokens, d_model, device=device, generator=g).to(torch.bfloat16)
    w0 = torch.randn(vocab, d_model, device=device, generator=g) / d_model ** 0.5
    targets = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
    paths = {"plain": PATHS["plain"], "fused": linear_cross_entropy,
             "fused_triton": lambda h, w, t: linear_cross_entropy(h, w, t, ops=TRITON_CHUNKS)}
    rows = []
    for name, fn in paths.items():
        def once():
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(h, w, targets)
            loss.backward()
            return float(loss)

        loss = once()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            once()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append({"path": name, "tokens": tokens, "vocab": vocab, "d_model": d_model, "loss": loss,
                     "seconds": statistics.median(times),
                     "peak_mib": (torch.cuda.max_memory_allocated() - held) / 2**20,
                     "logits_fp32_mib": tokens * vocab * 4 / 2**20})
        torch.cuda.empty_cache()
    return rows


def _tp_rows(tokens: int, vocab: int, d_model: int) -> dict:
    """On each of the TP ranks: both paths, side by side."""
    return {path: measure(path, tokens, vocab, d_model, tp=True) for path in TP_PATHS}


if __name__ == "__main__":
    main()

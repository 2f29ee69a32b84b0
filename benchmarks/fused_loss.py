"""The loss of one micro-batch, plain (the head's logits, then cross-entropy) against fused (the head's matmul and
the cross-entropy a chunk of tokens at a time: raydist.models.loss.linear_cross_entropy), side by side in one
run: peak memory and time of forward + backward.

    python benchmarks/fused_loss.py [--tokens 2048] [--vocab 128256] [--d-model 64] [--json]

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

PATHS = {"plain": lambda h, w, t: cross_entropy(F.linear(h, w), t), "fused": linear_cross_entropy}


def measure(path: str, tokens: int, vocab: int, d_model: int) -> dict:
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(1, tokens, d_model, generator=g)
    w0 = torch.randn(vocab, d_model, generator=g) / d_model ** 0.5
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    fn = PATHS[path]

    def once():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w, targets)
        loss.backward()
        return loss.item()

    with LiveActivations(track_peak=True) as live:
        loss = once()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    grads = (vocab + tokens) * d_model * 4
    return {"loss": loss, "peak_mib": live.peak_bytes / 2**20, "beyond_grads_mib": (live.peak_bytes - grads) / 2**20,
            "seconds": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    args = p.parse_args()
    if min(args.tokens, args.vocab, args.d_model) < 1:
        p.error("--tokens, --vocab and --d-model must be positive")
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    rows = {path: measure(path, args.tokens, args.vocab, args.d_model) for path in PATHS}
    plain, fused = rows["plain"], rows["fused"]
    print(f"N={args.tokens} V={args.vocab} D={args.d_model}: fp32 logits {logits_mib:.0f} MiB; chunks of "
          f"{chunk_rows(args.vocab)} tokens ({LOGITS_CHUNK_BYTES / 2**20:.0f} MiB)")
    for path, row in rows.items():
        print(f"  {path:5s}  peak {row['peak_mib']:8.1f} MiB ({row['beyond_grads_mib']:8.1f} beyond the gradients, "
              f"x{row['beyond_grads_mib'] / logits_mib:.2f} the logits)  {row['seconds']:.3f} s  "
              f"loss {row['loss']:.6f}")
    print(f"  fused / plain: memory beyond the gradients x{fused['beyond_grads_mib'] / plain['beyond_grads_mib']:.3f}, "
          f"time x{fused['seconds'] / plain['seconds']:.2f}")
    if args.json:
        print(json.dumps({"benchmark": "fused_loss", "tokens": args.tokens, "vocab": args.vocab,
                          "d_model": args.d_model, "logits_mib": logits_mib, "paths": rows,
                          "memory_ratio": fused["beyond_grads_mib"] / plain["beyond_grads_mib"],
                          "time_ratio": fused["seconds"] / plain["seconds"]}))


if __name__ == "__main__":
    main()

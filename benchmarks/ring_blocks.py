"""Ring attention's torch blocks: peak memory and time of one block's forward + backward, tiled against
materialised, side by side in one run; and the time of the `aten` blocks (the CPU's fused flash attention,
what the ring runs on the CPU and, as CUDA's memory-efficient attention, for head dims the Triton kernel
lacks), whose buffers live inside one op: their peak here counts only the tensors the ops return.

    python benchmarks/ring_blocks.py [--lengths 1024 2048 4096] [--heads 4] [--kv-heads 2] [--head-dim 80] [--json]

The torch blocks (raydist.parallel.attention_blocks: the CPU path, and CUDA's for head dims the Triton
kernel lacks) run the online softmax over tiles of KEY_TILE keys, so their peak grows linearly with the
block's length T; a block with one tile of all T keys builds the (B, H, T, T) scores, what the blocks did
before, and grows with T^2. Peak is the most bytes held by tensors made inside the call
(raydist.metrics.memory.LiveActivations), so it reads the same on any machine; time is the median of
three calls (noisy on a shared machine: compare the two columns of one run, not runs).

Measured on the 2-core dev machine (head dim 80, 4 heads on 2 kv heads, fp32, batch 1):
    T = 1024: 28.4 MiB tiled, 72.8 materialised;  2048: 56.2 against 273.6;  4096: 111.8 against 1059.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from raydist.metrics.memory import LiveActivations
from raydist.parallel.attention_blocks import KEY_TILE, aten_backward, aten_forward, torch_backward, torch_forward


def measure(seq_len: int, heads: int, kv_heads: int, head_dim: int, tile: int | None) -> dict:
    """tile None: the aten blocks."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq_len, head_dim, generator=g)
    k, v = (torch.randn(1, kv_heads, seq_len, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(1, heads, seq_len, head_dim, generator=g)

    def once():
        if tile is None:
            out, lse = aten_forward(q, k, v, True)
            aten_backward(dout, q, k, v, out, lse, True)
        else:
            out, lse = torch_forward(q, k, v, True, tile=tile)
            torch_backward(dout, q, k, v, out, lse, True, tile=tile)

    with LiveActivations(track_peak=True) as live:
        once()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return {"peak_mib": live.peak_bytes / 2**20, "seconds": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=80)
    p.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    args = p.parse_args()
    if args.heads % args.kv_heads or min(args.lengths) < 1:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}, lengths positive")
    rows = []
    for t in args.lengths:
        tiled = measure(t, args.heads, args.kv_heads, args.head_dim, KEY_TILE)
        whole = measure(t, args.heads, args.kv_heads, args.head_dim, t)
        fused = measure(t, args.heads, args.kv_heads, args.head_dim, None)
        rows.append({"seq_len": t, "tiled": tiled, "materialised": whole, "aten": fused,
                     "memory_ratio": tiled["peak_mib"] / whole["peak_mib"],
                     "time_ratio": tiled["seconds"] / whole["seconds"],
                     "aten_time_ratio": fused["seconds"] / tiled["seconds"]})
        print(f"T={t:6d}  peak {tiled['peak_mib']:8.1f} MiB tiled, {whole['peak_mib']:8.1f} materialised "
              f"(x{rows[-1]['memory_ratio']:.2f});  time {tiled['seconds']:.3f} s against {whole['seconds']:.3f} s "
              f"(x{rows[-1]['time_ratio']:.2f}); aten {fused['seconds']:.3f} s (x{rows[-1]['aten_time_ratio']:.2f} "
              f"the tiled), {fused['peak_mib']:.1f} MiB returned by its ops")
    if args.json:
        print(json.dumps({"benchmark": "ring_blocks", "key_tile": KEY_TILE, "head_dim": args.head_dim, "rows": rows}))


if __name__ == "__main__":
    main()

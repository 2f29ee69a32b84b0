"""`kernels.* = auto` on CUDA: time the Triton kernel against torch's at each shape once, keep the faster.

    chooser = KernelChooser(device_name, cuda_timer("cuda:0"), ChoiceCache(choice_cache_path()))
    pick = chooser.choose(AttentionShape(batch=1, heads=32, kv_heads=8, length=8192, head_dim=128,
                                         dtype="bfloat16"))
    # Pick(kind="attention", kernel="torch", triton_ms=9.1, torch_ms=6.0, source="measured", ...)

A shape is what one call of the kernel sees on one rank: attention (batch, local heads, kv heads, length,
head dim, dtype, causal); a linear layer (tokens M, in features K, out features N, dtype, the operands'
strides; `swiglu`: the fused gate-and-up product of two weights). The candidates are timed forward and
backward together (what a training step pays): the Triton flash attention against
`F.scaled_dot_product_attention` (flash attention on CUDA), the Triton matmul against `F.linear` (cuBLAS).

Bounded: per candidate one untimed call (Triton compiles and autotunes there; the run then reuses what it
tuned), then as many timed calls as fit in `rep_budget_s` (at least 3, at most `max_reps`), the median
of CUDA-event times; per chooser at most `budget_s` of measuring, after which the remaining shapes get
torch's kernel unmeasured (and are not cached: a later run measures them). Ties go to torch.

Cached per (device name, torch and Triton versions, shape): in memory for the process and in a small JSON
file (`choice_cache_path()`: $RAYDIST_CACHE/kernel_choices.json, beside the planner's calibration). A file
that is not valid JSON of the expected form is ignored (and replaced on the next write), an entry of the
wrong form skipped; writes go to a temporary file renamed over the old one, so readers never see half a file.
Never pickle: the file holds numbers and names only.

The timer is injectable (`Timer`: (shape, candidate) -> milliseconds), so the decision logic runs on a CPU
with a fake one; `cuda_timer` is the real one. Where to decide (at model build, from the config's shapes,
on rank 0 only) is `raydist.kernels.select`'s business.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Union

import torch

from raydist.store.cache import cache_dir

log = logging.getLogger(__name__)

CANDIDATES = ("triton", "torch")
CACHE_VERSION = 1


@dataclass(frozen=True)
class AttentionShape:
    """One call of the model's attention on one rank: q (B, H, T, E), k and v (B, K, T, E)."""

    batch: int
    heads: int  # query heads on this rank (num_heads / tp)
    kv_heads: int
    length: int
    head_dim: int
    dtype: str  # torch dtype name: "bfloat16", "float16", "float32"
    causal: bool = True

    kind = "attention"

    def key(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"attention b{self.batch} h{self.heads} kv{self.kv_heads} t{self.length} e{self.head_dim} "
                f"{self.dtype} {mask}")

    def unsupported(self) -> str | None:
        """Why the Triton kernel cannot run this shape (torch's, unmeasured), or None."""
        from raydist.kernels.attention import SUPPORTED_HEAD_DIMS

        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head dim {self.head_dim} is not one of the Triton kernel's {SUPPORTED_HEAD_DIMS}"
        if self.dtype not in ("bfloat16", "float16", "float32"):
            return f"dtype {self.dtype} is not one of the Triton kernel's"
        return None


@dataclass(frozen=True)
class MatmulShape:
    """One call of a linear layer on one rank: x (M, K) @ W (N, K)^T, or with `swiglu` the fused
    silu(x W_gate^T) * (x W_up^T) of two (N, K) weights. Strides are (row, column) of x as (M, K) and of W:
    the backward's transposed GEMMs follow from them, and Triton's autotuning keys on them too."""

    tokens: int  # M
    in_features: int  # K
    out_features: int  # N
    dtype: str
    bias: bool = False
    swiglu: bool = False
    x_strides: tuple[int, int] = (0, 1)  # (0, 1): row-major, (K, 1) (the model's contiguous activations)
    weight_strides: tuple[int, int] = (0, 1)  # (0, 1): row-major (K, 1), nn.Linear's weight

    def __post_init__(self):
        if self.x_strides == (0, 1):
            object.__setattr__(self, "x_strides", (self.in_features, 1))
        if self.weight_strides == (0, 1):
            object.__setattr__(self, "weight_strides", (self.in_features, 1))

    @property
    def kind(self) -> str:
        return "swiglu" if self.swiglu else "matmul"

    def key(self) -> str:
        x, w = self.x_strides, self.weight_strides
        return (f"{self.kind} m{self.tokens} k{self.in_features} n{self.out_features} {self.dtype}"
                f"{' bias' if self.bias else ''} x[{x[0]},{x[1]}] w[{w[0]},{w[1]}]")

    def unsupported(self) -> str | None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            return f"dtype {self.dtype} is not one of the Triton matmul's"
        if max(self.tokens * self.in_features, self.tokens * self.out_features,
               self.in_features * self.out_features) >= 2**31:
            return "an operand holds >= 2^31 elements, beyond the Triton matmul's 32-bit offsets"
        return None


Shape = Union[AttentionShape, MatmulShape]
Timer = Callable[[Shape, str], float]  # (shape, "triton" | "torch") -> milliseconds of forward + backward


@dataclass(frozen=True)
class Pick:
    """The kernel `auto` runs at one shape, and why: `source` is "measured", "cache" (an earlier
    measurement on this device and versions), or the reason it was not measured (torch's kernel then)."""

    kind: str  # attention | matmul | swiglu
    shape: str  # the shape's key
    kernel: str  # "triton" or "torch" (SDPA / F.linear)
    triton_ms: float | None
    torch_ms: float | None
    source: str

    def record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "Pick":
        return cls(**{name: record[name] for name in cls.__dataclass_fields__})


def faster(triton_ms: float, torch_ms: float) -> str:
    """The kernel that ran faster; torch's on a tie (the default stays unless Triton wins)."""
    return "triton" if triton_ms < torch_ms else "torch"


def versions() -> str:
    """'torch X, triton Y': what a measurement holds for (a new compiler or library measures again)."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # (no Triton: nothing is measured anyway)
        triton_version = "none"
    return f"torch {torch.__version__}, triton {triton_version}"


def choice_cache_path() -> Path:
    return cache_dir() / "kernel_choices.json"


class ChoiceCache:
    """{key: Pick} in a JSON file: {"version": 1, "picks": {key: {kind, shape, kernel, triton_ms, torch_ms}}}."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[str, Pick]:
        """The file's measured picks; {} when it is missing, unreadable or not of this form (logged)."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # not JSON (a torn or foreign file), or unreadable
            log.warning("kernel choice cache %s is unreadable (%s); ignoring it, it is rewritten on the next "
                        "measurement", self.path, exc)
            return {}
        if not isinstance(raw, dict) or raw.get("version") != CACHE_VERSION or not isinstance(raw.get("picks"), dict):
            log.warning("kernel choice cache %s is not a version-%d cache; ignoring it", self.path, CACHE_VERSION)
            return {}
        picks = {}
        for key, entry in raw["picks"].items():
            pick = _valid_entry(key, entry)
            if pick is None:
                log.warning("kernel choice cache %s: skipping the malformed entry %r", self.path, key)
            else:
                picks[key] = pick
        return picks

    def get(self, key: str) -> Pick | None:
        return self.load().get(key)

    def put(self, key: str, pick: Pick) -> None:
        """Add one measured pick, keeping the file's other valid entries (another run may have added some)."""
        picks = self.load()
        picks[key] = pick
        body = {"version": CACHE_VERSION,
                "picks": {k: {"kind": p.kind, "shape": p.shape, "kernel": p.kernel, "triton_ms": p.triton_ms,
                              "torch_ms": p.torch_ms} for k, p in sorted(picks.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise


def _valid_entry(key: str, entry) -> Pick | None:
    """A cached pick only when every field has its form and the kernel is the faster of its two times."""
    if not isinstance(entry, dict):
        return None
    times = entry.get("triton_ms"), entry.get("torch_ms")
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
               for t in times):
        return None
    if entry.get("kernel") != faster(*times) or not isinstance(entry.get("kind"), str) \
            or entry.get("shape") != key.rpartition(" | ")[2]:
        return None
    return Pick(entry["kind"], entry["shape"], entry["kernel"], float(times[0]), float(times[1]), "cache")


class KernelChooser:
    """Decides `auto` per shape on one device: memory, then the cache file, then a measurement."""

    def __init__(self, device_name: str, timer: Timer, cache: ChoiceCache | None = None, *,
                 budget_s: float = 120.0, clock: Callable[[], float] = time.perf_counter,
                 software: str | None = None):
        self.device_name = device_name
        self.timer = timer
        self.cache = cache
        self.budget_s = budget_s
        self.clock = clock
        self.software = software or versions()
        self.spent_s = 0.0  # measuring time so far
        self.memory: dict[str, Pick] = {}

    def key(self, shape: Shape) -> str:
        return f"{self.device_name} | {self.software} | {shape.key()}"

    def choose(self, shape: Shape) -> Pick:
        reason = shape.unsupported()
        if reason is not None:
            return Pick(shape.kind, shape.key(), "torch", None, None, reason)
        key = self.key(shape)
        pick = self.memory.get(key)
        if pick is not None:
            return pick
        pick = self.cache.get(key) if self.cache is not None else None
        if pick is None:
            pick = self._measure(shape)
            if pick.source == "measured" and self.cache is not None:
                try:
                    self.cache.put(key, pick)
                except OSError as exc:  # a read-only home, a full disk: the run goes on, it measures next time
                    log.warning("could not write the kernel choice cache %s: %s", self.cache.path, exc)
        self.memory[key] = pick
        return pick

    def _measure(self, shape: Shape) -> Pick:
        if self.spent_s >= self.budget_s:
            return Pick(shape.kind, shape.key(), "torch", None, None,
                        f"not measured: the {self.budget_s:g} s measuring budget was spent")
        start = self.clock()
        try:
            triton_ms = self.timer(shape, "triton")
        except Exception as exc:  # a compile failure or out of resources: torch's kernel, and say why
            self.spent_s += self.clock() - start
            first = str(exc).splitlines()[0] if str(exc) else ""
            return Pick(shape.kind, shape.key(), "torch", None, None,
                        f"the Triton kernel failed: {type(exc).__name__}: {first}"[:300])
        torch_ms = self.timer(shape, "torch")
        self.spent_s += self.clock() - start
        return Pick(shape.kind, shape.key(), faster(triton_ms, torch_ms), float(triton_ms), float(torch_ms),
                    "measured")


# ---- the real timer: CUDA events ---------------------------------------------------------------------


def time_cuda_ms(fn: Callable[[], None], device: torch.device, *, rep_budget_s: float = 0.25,
                 max_reps: int = 20, min_reps: int = 3) -> float:
    """Median milliseconds of `fn()` on `device`'s current stream, by CUDA events: one untimed call first
    (compilation, autotuning, allocator warm-up), one timed call to size the repetitions to `rep_budget_s`,
    then min_reps..max_reps timed calls recorded back to back and read after one synchronize."""
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        first_ms = start.elapsed_time(end)
        reps = max(min_reps, min(max_reps, int(rep_budget_s * 1e3 / max(first_ms, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for begin, finish in events:
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize(device)
        return statistics.median(begin.elapsed_time(finish) for begin, finish in events)


def forward_backward(shape: Shape, candidate: str, device: torch.device) -> Callable[[], None]:
    """One forward + backward of `candidate` at `shape` on random inputs made once, in the model's layouts
    (attention's q, k, v are (B, T, H, E) tensors viewed as (B, H, T, E), as the model passes them)."""
    import torch.nn.functional as F

    from raydist.kernels.attention import flash_attention
    from raydist.kernels.matmul import linear, swiglu, torch_swiglu
    from raydist.kernels.reference import repeat_kv

    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype).requires_grad_()

    if isinstance(shape, AttentionShape):
        b, h, kv, t, e = shape.batch, shape.heads, shape.kv_heads, shape.length, shape.head_dim
        q, k, v = leaf(b, t, h, e), leaf(b, t, kv, e), leaf(b, t, kv, e)
        grad = torch.randn(b, h, t, e, generator=gen, device=device, dtype=dtype)
        inputs = (q, k, v)

        def attend(q_, k_, v_):
            if candidate == "triton":
                return flash_attention(q_, k_, v_, causal=shape.causal)
            k_, v_ = repeat_kv(k_, h), repeat_kv(v_, h)  # as the model's sdpa_attention
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=shape.causal)

        def step():
            for x in inputs:
                x.grad = None
            attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).backward(grad)
        return step

    m, k_in, n = shape.tokens, shape.in_features, shape.out_features
    x = torch.empty_strided((m, k_in), shape.x_strides, device=device, dtype=dtype)
    x.copy_(torch.randn(m, k_in, generator=gen, device=device, dtype=dtype)).requires_grad_()
    weights = [torch.empty_strided((n, k_in), shape.weight_strides, device=device, dtype=dtype)
               for _ in range(2 if shape.swiglu else 1)]
    for w in weights:
        w.copy_(torch.randn(n, k_in, generator=gen, device=device, dtype=dtype)).requires_grad_()
    bias = leaf(n) if shape.bias else None
    grad = torch.randn(m, n, generator=gen, device=device, dtype=dtype)
    inputs = [x, *weights] + ([bias] if bias is not None else [])

    def step():
        for t in inputs:
            t.grad = None
        if shape.swiglu:
            out = (swiglu if candidate == "triton" else torch_swiglu)(x, *weights)
        else:
            out = (linear if candidate == "triton" else F.linear)(x, weights[0], bias)
        out.backward(grad)
    return step


def cuda_timer(device: torch.device | str, *, rep_budget_s: float = 0.25, max_reps: int = 20) -> Timer:
    """The Timer that measures on `device` (forward + backward, `time_cuda_ms`)."""
    device = torch.device(device)

    def timer(shape: Shape, candidate: str) -> float:
        try:
            return time_cuda_ms(forward_backward(shape, candidate, device), device, rep_budget_s=rep_budget_s,
                                max_reps=max_reps)
        finally:
            torch.cuda.empty_cache()  # the inputs go back: the model is materialised after the decision

    return timer


def wall_clock_timer(device: torch.device | str = "cpu") -> Timer:
    """A Timer by the wall clock around one forward + backward: for the CPU, where the Triton candidate runs
    under the interpreter (TRITON_INTERPRET=1) and its time says nothing about a GPU (the decision path's
    tests, and the GPU suite's code run on a CPU)."""
    device = torch.device(device)

    def timer(shape: Shape, candidate: str) -> float:
        step = forward_backward(shape, candidate, device)
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3

    return timer


def default_chooser(device: torch.device | str, budget_s: float = 120.0) -> KernelChooser:
    """A chooser on CUDA `device` with the CUDA-event timer and the cache file `choice_cache_path()`."""
    device = torch.device(device)
    return KernelChooser(torch.cuda.get_device_name(device), cuda_timer(device),
                         ChoiceCache(choice_cache_path()), budget_s=budget_s)

"""The equivalence harness: run a layout on N gloo processes and the same config on one, compare.

Every parallel feature is proven the same way: same seed, same data, fp32 on CPU, losses and gradient
norms before clipping within 1e-4 relative at every step, the last step's gradients (before clipping) and
the parameters after the last step close, and every parameter of the model received a gradient. The tiny
config clips at 2.5, among its steps' norms (2.2-2.9 in the 4 steps of `run_layout`: some steps clipped,
some not; see DEFAULT_STEPS): clipping every step would hide a gradient's scale from the parameters.
tests/unit/test_harness_mutations.py plants the bugs this must catch. Tests and benchmarks use
`run_layout`, which spawns the ranks with `raydist.parallel.runtime.spawn` and plans the layout through a
`LocalSession` (rank 0 plans, all receive).

Devices, explicitly (`raydist.parallel.runtime.harness_device`, $RAYDIST_TEST_DEVICE = auto | cpu | cuda): with at
least one GPU per rank the ranks run NCCL with rank r on cuda:r, otherwise gloo on the CPU; never gloo with
CUDA tensors, never two ranks on one GPU. `tiny_config` asks for fp32 so that a GPU run keeps the contract.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raydist.config import Config
from raydist.parallel.runtime import harness_device, spawn, to_device

TINY_MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=320)


def tiny_config(data_path: str, seq_len: int = 32, **sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A config dict for a small model on prepared data at `data_path`; `sections` update it."""
    raw: dict[str, dict[str, Any]] = {
        "model": dict(TINY_MODEL),
        "data": {"path": data_path, "seq_len": seq_len, "reader": "arrow"},
        "train": {"steps": 10, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2,
                  "eval_every": 0, "log_every": 1, "seed": 0, "dtype": "fp32", "grad_clip": 2.5},
        "parallel": {"dp_replicate": 1, "dp_shard": 1},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


@dataclass
class LayoutResult:
    losses: list[float]
    grad_norms: list[float]  # per step, the whole model's gradient norm before clipping
    grads: dict[str, torch.Tensor]  # the last step's full gradients before clipping, by parameter name
    sample_ids: list[np.ndarray]  # per step, this rank's samples (batch leaders only, when recorded)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full parameters after the last step
    covered: frozenset[str] = frozenset()  # parameter names held by any rank of the layout
    clipped_norms: list[float] = field(default_factory=list)  # per step, the gradient norm after clipping
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)  # what ran on this rank (kernels_ran)


def _run(raw: dict, steps: int, record_samples: bool, capture_grads: bool) -> LayoutResult:
    import torch.distributed as dist

    from raydist.elastic.session import LocalSession
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer, TrainerOptions

    cfg = Config.from_dict(raw)
    layout = LocalSession().start(cfg)
    trainer = Trainer(cfg, pick_device(), layout, options=TrainerOptions(  # the last step's gradients only
        record_samples=record_samples, capture_grads=capture_grads, grads_at_step=steps))
    losses, norms, clipped = [], [], []
    try:
        for _ in range(steps):
            stats = trainer.train_step()
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            if capture_grads:
                clipped.append(trainer.last_clipped_norm)
    finally:
        trainer.close()
    grads = getattr(trainer, "last_grads", {}) if capture_grads else {}
    params = trainer.full_parameters() if capture_grads else {}
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(params))
    return LayoutResult(losses, norms, grads, trainer.sample_log, params, frozenset(n for part in names for n in part),
                        clipped, trainer.kernels_ran())


# Four steps: the warmup (2) and the decay of the LR schedule, AdamW's moments over several updates, and
# both sides of the tiny config's clipping threshold (2.5): in the single process the 4-layer model's steps
# have norms 2.48, 2.75, 2.39 and 2.91 (steps 2 and 4 clipped), the 2-layer model's 2.32, 2.17, 2.40 and
# 2.87 (step 4 clipped). With the threshold at 3.0 only a fifth step (3.17-3.33) was clipped; that step cost
# a fifth of every layout's steps, which are most of a layout's CPU (a rank's build is about a fifth). The
# planted bugs of tests/unit/test_harness_mutations.py are caught in four steps.
DEFAULT_STEPS = 4

# A layout without data parallelism (tp, cp or pp, alone or composed) can run 2 micro-batches of 4 rows a step
# where the single-process reference runs 4 of 2 (`tiny_config`): the same global batch of 8, so the same
# mean loss and gradients (a dense model's loss is a mean over equal micro-batches), and the comparison then
# covers a different accumulation split as well. Not for a MoE model: its balance loss is per micro-batch.
# Most of a TP or CP step's CPU here goes per micro-batch (DTensor dispatch, ring steps, P2P); per rank,
# 4 steps measured side by side: tp 2 + sp 1.07 -> 0.62 s, cp 2 0.57 -> 0.32 s, tp 2 x cp 2 1.57 -> 0.81 s.
TWO_MICROBATCHES = {"micro_batch": 4}


def run_layout(raw: dict, world_size: int, steps: int = DEFAULT_STEPS, *, record_samples: bool = False,
               capture_grads: bool = True, imports: tuple[str, ...] = ()) -> list[LayoutResult]:
    """Train `steps` steps of config `raw` on `world_size` processes; one LayoutResult per rank. `imports`:
    modules each process imports first (a test's planted bug)."""
    device = harness_device(world_size)
    if imports:
        return spawn(_after_imports, world_size, tuple(imports), _run, raw, steps, record_samples, capture_grads,
                     device=device)
    return spawn(_run, world_size, raw, steps, record_samples, capture_grads, device=device)


def _run_each(raws: list[dict], steps: int) -> list[LayoutResult]:
    return [_run(raw, steps, False, True) for raw in raws]


def run_layouts(raws: list[dict], world_size: int, steps: int = DEFAULT_STEPS, *,
                timeout_s: float = 300.0) -> list[list[LayoutResult]]:
    """`run_layout` of every config in `raws`, one after another on the same `world_size` processes (each
    its own Trainer and mesh, closed before the next): one spawn, whose start and warm-up cost more than
    most tiny runs. Results by config, then by rank; a config that raises fails them all, with its traceback."""
    per_rank = spawn(_run_each, world_size, raws, steps, timeout_s=timeout_s, device=harness_device(world_size))
    return [[rank[i] for rank in per_rank] for i in range(len(raws))]


def assert_same_steps(reference: LayoutResult, candidate: LayoutResult, rtol: float = 1e-4,
                      norm_rtol: float | None = None) -> None:
    """Every step's loss within rtol (relative), and its gradient norm before clipping and, where the
    reference recorded it, after clipping within norm_rtol (rtol unless given). The norm before clipping is
    what catches a wrong gradient scale (a sum instead of a mean over ranks, a micro-batch counted twice):
    the losses of the first steps and AdamW's updates barely react to a uniform scale, and clipping hides
    it; the norm after clipping, that clipping scaled every shard by the one global factor."""
    norm_rtol = rtol if norm_rtol is None else norm_rtol
    series = [("losses", reference.losses, candidate.losses, rtol),
              ("gradient norms before clipping", reference.grad_norms, candidate.grad_norms, norm_rtol)]
    if reference.clipped_norms:
        series.append(("gradient norms after clipping", reference.clipped_norms, candidate.clipped_norms, norm_rtol))
    for what, ref, got, tolerance in series:
        ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
        assert len(ref) == len(got), f"{what}: {len(got)} steps against the reference's {len(ref)}"
        assert len(ref), f"no {what} recorded"
        rel = np.abs(got - ref) / np.abs(ref)
        assert (rel <= tolerance).all(), (f"{what} differ: max relative {rel.max():.2e} at step "
                                          f"{int(rel.argmax()) + 1} (tolerance {tolerance:g})\n"
                                          f"ref {ref.tolist()}\ngot {got.tolist()}")


def assert_equivalent(reference: LayoutResult, candidate: LayoutResult, rtol: float = 1e-4,
                      grad_rtol: float = 1e-4, grad_atol: float = 1e-6, grad_scale_atol: float = 1e-3) -> None:
    """Losses and gradient norms before and after clipping within rtol (relative) at every step
    (`assert_same_steps`); every gradient the candidate holds (the last step's, before clipping) close to
    the reference's; every parameter it holds within rtol of the reference's after the last step (relative
    norm of the difference) and with a gradient; the layout's ranks together hold every parameter of the
    reference model."""
    assert_same_steps(reference, candidate, rtol)
    assert candidate.grads, "the candidate captured no gradients"
    missing = sorted(set(candidate.params) - set(candidate.grads))
    assert not missing, f"parameters that received no gradient in the last step: {missing}"
    for name, grad in candidate.grads.items():
        assert name in reference.grads, f"{name} not in the reference model"
        ref_grad = reference.grads[name]
        # The last step's gradients, elementwise; the absolute floor follows the tensor's own scale
        # (grad_scale_atol x its largest element): AdamW divides by sqrt(v), so fp32 rounding in elements
        # whose gradient is near zero grows over the steps, and the last gradients differed by up to 2.8e-4
        # of their tensor's scale between reduction orders (CP 2 x TP 2, ring; relative norm 9e-5) while the
        # losses and the parameters stayed within 1e-4.
        # A missing or doubled reduction, or a wrong shard, is off by the scale itself.
        atol = max(grad_atol, grad_scale_atol * float(ref_grad.abs().max()))
        torch.testing.assert_close(grad, ref_grad, rtol=grad_rtol, atol=atol,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
    if not reference.params:  # a reference run without parameters (capture_grads=False): nothing more
        return
    assert candidate.params, "the candidate captured no parameters"
    assert candidate.covered == frozenset(reference.params), \
        f"the layout's ranks hold {sorted(candidate.covered ^ frozenset(reference.params))} differently"
    for name, param in candidate.params.items():
        # Relative to the whole tensor: AdamW moves an element with a near-zero gradient by about lr whatever
        # its sign, so single elements may differ by reduction-order noise; a wrong update moves whole tensors.
        want = reference.params[name]
        error = float((param - want).norm() / want.norm().clamp_min(1e-12))
        assert error <= rtol, f"parameter {name} after the last step differs by {error:.2e} (relative norm)"


# ---- whole runs with checkpoints, crashes and resumes --------------------------------------------


@dataclass
class FitResult:
    summary: dict | None
    sample_ids: list[np.ndarray]  # per step run in this process (batch leaders)
    losses: list[float]


def _fit(raw: dict, run_dir: str, crash_after_step: int | None, before_commit_exit_step: int | None) -> FitResult:
    import os

    from raydist.checkpoint import CheckpointManager
    from raydist.parallel.runtime import pick_device
    from raydist.training.loop import fit
    from raydist.training.trainer import Trainer, TrainerOptions

    trainer = Trainer(Config.from_dict(raw), pick_device(), options=TrainerOptions(record_samples=True,
                                                                                   defer_init=True))
    losses: list[float] = []
    step_fn = trainer.train_step

    def train_step(batch=None):
        stats = step_fn(batch)
        losses.append(stats.loss)
        if crash_after_step is not None and trainer.step == crash_after_step:
            os._exit(17)  # a killed worker: no cleanup, no final checkpoint
        return stats

    trainer.train_step = train_step
    if before_commit_exit_step is not None:
        def die(step):
            if step == before_commit_exit_step:
                os._exit(18)  # dies with the shards written and no commit marker
        CheckpointManager.before_commit = staticmethod(die)
    summary = fit(trainer, run_dir, log=lambda *_: None)
    return FitResult(summary, trainer.sample_log, losses)


def _after_imports(imports: tuple[str, ...], fn, *args):
    import importlib

    for module in imports:
        importlib.import_module(module)
    return fn(*args)


def run_fit(raw: dict, world_size: int, run_dir: str, *, crash_after_step: int | None = None,
            crash_before_commit_of: int | None = None, imports: tuple[str, ...] = ()) -> list[FitResult] | None:
    """`fit` on `world_size` processes with run directory `run_dir` (resuming from it if it holds
    checkpoints). `crash_after_step=s` kills every rank right after step s; `crash_before_commit_of=s`
    kills them while checkpoint s is written but not committed. `imports` are modules each process
    imports first (e.g. one registering a test fsspec protocol). Returns None after a crash."""
    try:
        device = harness_device(world_size)
        if imports:
            return spawn(_after_imports, world_size, tuple(imports), _fit, raw, run_dir, crash_after_step,
                         crash_before_commit_of, device=device)
        return spawn(_fit, world_size, raw, run_dir, crash_after_step, crash_before_commit_of, device=device)
    except RuntimeError as exc:
        if (crash_after_step is not None or crash_before_commit_of is not None) and "exited with status" in str(exc):
            return None
        raise


def logits_after_load(raw: dict, run_dir: str | None, tokens: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """On each rank of a spawned layout: build the Trainer for `raw`, load the newest checkpoint of
    `run_dir` (unless None: the untrained model), and return the full logits of `tokens` (checks that the
    checkpoint was at `step`, when given)."""
    from raydist.checkpoint import CheckpointManager
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    trainer = Trainer(Config.from_dict(raw), pick_device())
    if run_dir is not None:
        manager = CheckpointManager(run_dir, keep=3, group=trainer.checkpoint_group, log=lambda *_: None)
        manager.load(manager.latest(), trainer.state_parts())
        assert step is None or trainer.step == step, (trainer.step, step)
    with torch.no_grad():
        out = trainer.pm.module(tokens.to(trainer.device))
    return (out.full_tensor() if hasattr(out, "full_tensor") else out).cpu()


# ---- construction ----------------------------------------------------------------------------------


@dataclass
class Constructed:
    params: dict[str, torch.Tensor]  # full (unsharded) parameters this rank's layout holds, by unsplit name
    local_param_bytes: int  # bytes of the parameter storage this rank holds (its shards)
    meta_tensors: list[str]  # parameters or buffers still on the meta device (none expected)
    rope_exact: bool  # every RoPE table this rank holds equals a fresh computation
    tied: bool  # the model's embedding and head are one parameter wherever a rank holds both


def _construct(raw: dict) -> Constructed:
    from raydist.models.gpt import rope_tables
    from raydist.parallel.runtime import pick_device
    from raydist.training.trainer import Trainer

    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, pick_device())
    try:
        local_bytes = 0
        for param in trainer.pm.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local_bytes += local.numel() * local.element_size()
        modules = trainer.pm.chunks or [trainer.pm.model]
        meta = [name for m in modules for name, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
        cos, sin = rope_tables(cfg.model.head_size, cfg.data.seq_len, cfg.model.rope_theta)
        rope = all(torch.equal(m.rope_cos.cpu(), cos) and torch.equal(m.rope_sin.cpu(), sin) for m in modules)
        tied = all(m.head.weight is m.embedding.weight for m in modules
                   if cfg.model.tie_embeddings and m.head is not None and m.embedding is not None)
        return Constructed(trainer.full_parameters(), local_bytes, meta, rope, tied)
    finally:
        trainer.close()


def constructed(raw: dict, world_size: int) -> list[Constructed]:
    """Build the Trainer of config `raw` on `world_size` processes (no step); what each rank holds."""
    return spawn(_construct, world_size, raw, device=harness_device(world_size))


# ---- Hugging Face Llama directories for the fine-tuning tests -----------------------------------


def save_tiny_hf(path, *, family: str = "llama", tied: bool = True, seed: int = 0, **shape) -> Any:
    """A `transformers` model of `family` (raydist.families.registry) in TINY_MODEL's shape (overridden by `shape`,
    in raydist's names; `head_dim` too) with weights of order one (every matrix ~ N(0, 1/D_in), vectors
    (norm gains, Qwen2's biases) ~ 1 + N(0, 0.2): logits that a wrong layout would visibly change), saved with
    save_pretrained at `path`; returns the model (fp32, eager)."""
    import math

    import transformers

    from raydist.families.registry import FAMILIES

    m = {**TINY_MODEL, "rope_theta": 10000.0, "norm_eps": 1e-5, **shape}
    fields = dict(vocab_size=m["vocab_size"], hidden_size=m["d_model"], num_hidden_layers=m["num_layers"],
                  num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                  intermediate_size=m["ffn_hidden"], rope_theta=m["rope_theta"], rms_norm_eps=m["norm_eps"],
                  tie_word_embeddings=tied, max_position_embeddings=256, attn_implementation="eager",
                  **({"head_dim": m["head_dim"]} if m.get("head_dim") else {}))
    spec = FAMILIES[family]
    extra = {k: v for k, v in spec.hf_config_extra.items() if k not in ("attention_bias", "mlp_bias")}
    if spec.moe:  # moe_experts, moe_top_k, moe_ffn_hidden in raydist's names (4, 2 and ffn_hidden by default)
        experts, top_k = m.get("moe_experts", 4), m.get("moe_top_k", 2)
        extra.update({"num_experts_per_tok": top_k, "num_local_experts": experts} if family == "mixtral" else
                     {"num_experts_per_tok": top_k, "num_experts": experts, "norm_topk_prob": True,
                      "moe_intermediate_size": m.get("moe_ffn_hidden") or m["ffn_hidden"]})
    config = transformers.AutoConfig.for_model(spec.hf_model_type, **fields, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[1]))
    model.save_pretrained(str(path))
    return model


# ---- host-device synchronisations -------------------------------------------------------------------

# Tensor reads that make the host wait for a CUDA device (a device-to-host copy, or a result the host
# needs before it can go on): values, host copies, and data-dependent shapes.
_READS = {
    torch.Tensor.item: "item", torch.Tensor.__float__: "float", torch.Tensor.__int__: "int",
    torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index", torch.Tensor.__format__: "format",
    torch.Tensor.__repr__: "repr", torch.Tensor.__array__: "numpy", torch.Tensor.numpy: "numpy",
    torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.equal: "equal", torch.Tensor.equal: "equal",
    torch.allclose: "allclose", torch.Tensor.allclose: "allclose", torch.Tensor.is_nonzero: "is_nonzero",
    torch.nonzero: "nonzero", torch.Tensor.nonzero: "nonzero", torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select", torch.unique: "unique", torch.Tensor.unique: "unique",
}
# Factories whose result is a host tensor (on a CUDA run too) unless given a device: reading such a tensor
# waits for nothing, moving it to the device with a blocking copy does.
_HOST_FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.frombuffer, torch.zeros, torch.ones,
                   torch.empty, torch.full, torch.arange}


def _device_of(args, kwargs):
    """The device a `Tensor.to` call names, if any."""
    return kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)


class HostSyncCounter:
    """Counts, while active, every call that would make the host wait for the GPU on a CUDA run: run on the
    CPU, it shows the syncs a CUDA run of the same code would have.

    Every tensor counts as a device tensor except host tensors: made by a factory (`torch.tensor`, `zeros`,
    `from_numpy`, ...) without a device, or by an op from host tensors only, as they are on a CUDA run too.
    Counted:
    - reading a device tensor: `item`, `float` / `int` / `bool` / `index`, formatting, `tolist`, `numpy`,
      `cpu`, `.to("cpu")` (the string: a `torch.device` may name the training device, the CPU here),
      `torch.equal` / `allclose`, a blocking `copy_` into a host tensor;
    - data-dependent shapes: `nonzero`, `masked_select`, `unique`, `repeat_interleave` by a tensor of
      repeats without `output_size`, indexing with a boolean tensor;
    - host data to the device by a blocking copy: `.to(device)` or `copy_` of a host tensor without
      `non_blocking`, `torch.tensor` / `as_tensor` / `new_tensor` of host data with a device (CUDA copies from pageable
      memory synchronise the stream; only a non-blocking copy from pinned memory does not, which is what
      `raydist.parallel.runtime.to_device` makes on CUDA: its result is a device tensor, not counted);
    - `torch.cuda.synchronize`, `synchronize` of CUDA events and streams, `Event.elapsed_time`.

    Not counted: torch.optim's own host bookkeeping (on the CPU its step counters are host tensors; raydist's
    CUDA optimizer is the fused one, whose counters live on the device), and calls nested inside another
    torch function's handler. On a GPU `torch.cuda.set_sync_debug_mode("error")` catches the copies and
    stream syncs this cannot see (not event or device syncs, which this counts).

    `calls`: (what, where) in order, `where` the nearest raydist or test frame; `mark()` / `since(mark)`
    split them by step."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                # raydist.parallel.runtime.to_device: pinned and non-blocking on CUDA (a plain `.to` elsewhere)
                moved = func is torch.Tensor.to and sys._getframe(1).f_code is to_device.__code__
                what = None if moved else counter._classify(func, args, kwargs)
                if what is not None:
                    counter._count(what)
                out = func(*args, **kwargs)
                counter._track(func, args, kwargs, out)
                return out

        self._mode = _Mode()
        self._host: dict[int, weakref.ref] = {}
        self.calls: list[tuple[str, str]] = []
        self._patched: list[tuple[object, str, object]] = []

    def _is_host(self, tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _all_host(self, args, kwargs) -> bool:
        """Whether an op's tensor arguments (one level into lists) are all host tensors: so is its result."""
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(self._is_host(t) for t in tensors)

    def _track(self, func, args, kwargs, out) -> None:
        """Where `out` lives on a CUDA run: on the host (a host copy, a factory without a device, an op on
        host tensors only), or on the device (moved there; anything else)."""
        if func is torch.Tensor.to and _device_of(args, kwargs) is not None:
            host = False  # (on the CPU `.to` may return its input: that one is now the device's too)
        elif func in _HOST_FACTORIES:
            host = kwargs.get("device") is None
        else:
            host = func is torch.Tensor.cpu or self._all_host(args, kwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                if host:
                    self._host[id(t)] = weakref.ref(t)
                else:
                    self._host.pop(id(t), None)

    def _classify(self, func, args, kwargs) -> str | None:
        what = _READS.get(func)
        if what is not None:
            return None if args and self._is_host(args[0]) else what
        if func is torch.Tensor.to:
            device, host = _device_of(args, kwargs), self._is_host(args[0])
            if device == "cpu" and not host:
                return "to(cpu)"
            moves = device is not None and host and not kwargs.get("non_blocking")
            return "to(device) from the host" if moves else None
        if func is torch.Tensor.copy_:
            into, src = self._is_host(args[0]), self._is_host(args[1] if len(args) > 1 else kwargs.get("src"))
            blocking = into != src and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return ("copy_ to the host" if into else "copy_ from the host") if blocking else None
        if func is torch.Tensor.__getitem__:
            if self._is_host(args[0]):
                return None
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            boolean = any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
            return "boolean index" if boolean else None
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
            dynamic = isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
            return "repeat_interleave" if dynamic else None
        if func is torch.Tensor.new_tensor:
            return None if self._is_host(args[0]) else "new_tensor"
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            data = args[0] if args else kwargs.get("data")
            return None if isinstance(data, torch.Tensor) and not self._is_host(data) else f"{func.__name__}(device=)"
        return None

    def _count(self, what: str) -> None:
        frame, where = sys._getframe(2), "?"
        while frame is not None:
            path = frame.f_code.co_filename.replace("\\", "/")
            if "/torch/optim/" in path:
                return
            if frame.f_code.co_name == "__torch_function__":  # another mode passing the call on (the strict
                frame = frame.f_back                            # mode's host-tensor marking): look further out
                continue
            if "/raydist/" in path or "/tests/" in path:
                name = path.rsplit("/raydist/", 1)[-1] if "/raydist/" in path else path.rsplit("/", 1)[-1]
                where = f"{name}:{frame.f_lineno}"
                break
            frame = frame.f_back
        self.calls.append((what, where))

    def _patch(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            counter._count(what)
            return original(*args, **kwargs)

        self._patched.append((owner, name, original))
        setattr(owner, name, counted)

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, str]]:
        return self.calls[mark:]

    def __enter__(self) -> "HostSyncCounter":
        self._patch(torch.cuda, "synchronize", "cuda.synchronize")
        for cls, label in ((torch.cuda.Event, "Event"), (torch.cuda.Stream, "Stream")):
            self._patch(cls, "synchronize", f"{label}.synchronize")
        self._patch(torch.cuda.Event, "elapsed_time", "Event.elapsed_time")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []

"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, tied or untied embeddings;
the families of raydist.families.registry (Mistral, Qwen2/2.5, Qwen3) switch on q/k/v biases and per-head q/k norms;
`model.moe_experts` makes each block's feed-forward a mixture of experts (raydist.models.moe: Qwen3-MoE, Mixtral).

Shapes use B batch, T sequence, D d_model, H query heads, K kv heads, E head dim, F ffn_hidden, V vocab.

The layout is chosen for the parallel plans that act on it by module name:
- `layers` is a ModuleDict keyed "0".."L-1" so a pipeline stage can drop blocks and the remaining ones
  keep their names (checkpoints stay keyed by the unsharded model's names);
- `tok_embeddings`, `norm` and `output` may be None on middle pipeline stages;
- attention reshapes with -1 heads, so a tensor-parallel rank that holds H/tp heads runs unchanged;
- the attention kernel is a pluggable function (`attention_fn`) so context parallelism and the Triton
  kernels replace it without touching this file; `positions` lets sharded sequences keep their RoPE angles;
- generation passes a `KVCache`: each block appends its new keys/values (K heads, not repeated for the
  grouped query heads) and attends over all of them, and RoPE angles start at the cache's length. Without
  a cache (training, evaluation) the forward is exactly the code path it always was.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raydist.config import ModelConfig
from raydist.families.registry import family_of
from raydist.metrics.kernels import count_call

# attention_fn(q, k, v) -> out, with q (B, H, T, E), k/v (B, K, T, E) and out (B, H, T, E); causal.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through torch's fused kernel; K/V heads are repeated for grouped-query heads."""
    count_call("attention.sdpa")
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The textbook formula: softmax(q k^T / sqrt(E) + causal mask) v, materialising (B, H, T, T)."""
    count_call("attention.eager")
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    t = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, K, T, E) -> (B, H, T, E): each kv head serves H/K consecutive query heads."""
    reps = num_heads // x.shape[1]
    return x if reps == 1 else x.repeat_interleave(reps, dim=1)


class KVCache:
    """Per-layer keys and values of the tokens seen so far, for incremental decoding.

    layers[name] = (k, v), each (B, K, S, E) with the K kv heads (grouped-query attention repeats them
    only inside the attention product); `length` = S, the position of the next token. Grown by
    concatenation, one forward at a time (the prompt, then one token per step).
    """

    def __init__(self) -> None:
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0

    def extend(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, K, T, E) to layer `name`'s cache; returns its keys and values (B, K, S + T, E)."""
        if name in self.layers:
            k0, v0 = self.layers[name]
            k, v = torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)
        self.layers[name] = (k, v)
        return k, v


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of T new queries q (B, H, T, E) over S + T keys/values (B, K, S + T, E), the first
    S of them cached: query i (position S + i) sees keys 0..S + i (a mask aligned to the bottom right)."""
    t, total = q.shape[2], k.shape[2]
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    visible = torch.ones(t, total, dtype=torch.bool, device=q.device).tril(total - t)  # (T, S + T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_len, E/2): angle(pos, i) = pos * theta^(-2i/E)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, N, E) by the angles cos/sin (T, E/2)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, T, N, E/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention; per the model family (raydist.families.registry) q/k/v projections with biases
    (Qwen2) and an RMSNorm over each head of q and k before RoPE (Qwen3's `q_norm`, `k_norm`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        family = family_of(cfg)
        self.head_dim = cfg.head_size
        self.wq = nn.Linear(cfg.d_model, cfg.num_heads * self.head_dim, bias=family.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.num_kv_heads * self.head_dim, bias=family.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.num_kv_heads * self.head_dim, bias=family.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if family.qk_norm else None
        self.attention_fn: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[KVCache, str] | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # x: (B, T, D); under sequence parallelism T is already gathered here
        q = self.wq(x).view(b, t, -1, self.head_dim)  # (B, T, H, E), H local under tensor parallelism
        k = self.wk(x).view(b, t, -1, self.head_dim)  # (B, T, K, E)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:  # over E, per head (heads are dim 2: tensor parallelism shards them)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, E)
        if cache is None:
            out = self.attention_fn(q, k, v)  # (B, H, T, E)
        else:
            kv, name = cache
            out = cached_attention(q, *kv.extend(name, k, v))
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), of hidden width `hidden` (default model.ffn_hidden)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, D)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down): what a fused SwiGLU kernel (raydist.kernels.select) computes with."""
        return self.w1, self.w3, self.w2


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.moe_experts:  # a mixture of experts (raydist.models.moe)
            from raydist.models.moe import MoEFeedForward

            self.feed_forward: nn.Module = MoEFeedForward(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[KVCache, str] | None = None) -> torch.Tensor:
        # the cache only as a keyword: tensor parallelism's input hooks see the positional (x, cos, sin)
        kwargs = {} if cache is None else {"cache": cache}
        h = x + self.attention(self.attention_norm(x), cos, sin, **kwargs)
        return h + self.feed_forward(self.ffn_norm(h))


def _own_containers(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` (same class, same submodules, parameters and settings) whose containers
    (submodules, parameters, buffers, hooks) are its own: changing the copy's leaves the original's alone."""
    copy = module.__class__.__new__(module.__class__)
    copy.__dict__ = {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in module.__dict__.items()}
    return copy


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_size, max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # run_layers(blocks, h, cos, sin) -> h replaces the plain loop (activation checkpointing policies)
        self.run_layers: Callable | None = None
        if self.tied:
            self.output.weight = self.tok_embeddings.weight
        # Weights are torch's module defaults until `init_weights(seed)` (build_model; the Trainer builds
        # on the meta device and initialises each rank's shards: raydist.models.init)

    @property
    def tied(self) -> bool:
        return self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None

    def init_weights(self, seed: int) -> None:
        """Normal(0, std) weights keyed by (seed, parameter name), residual output projections scaled by
        1/sqrt(2 * num_layers), norms ones: the same values in every layout (raydist.models.init)."""
        from raydist.models.init import init_weights

        init_weights(self, self.cfg, seed)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after `to_empty`, which leaves buffers uninitialised)."""
        if "rope_cos" not in self._buffers or self.rope_cos.is_meta:  # a stage view holds none
            return
        cos, sin = rope_tables(self.cfg.head_size, self.max_seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V); on a middle pipeline stage (B, T, D) -> (B, T, D).

        positions (T,) gives each token's place in the full sequence (context parallelism shards T);
        by default 0..T-1, or cache.length..cache.length+T-1 when decoding with a KV cache (which this
        call extends by T). With `targets` (B, T) the head computes the loss (models.loss.cross_entropy's
        value) with its matmul and returns it: a head whose class `fuses_loss` (raydist.kernels.select).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)
        t = h.shape[1]
        if cache is not None:  # decoding: positions continue after the cached tokens
            start = cache.length
            if start + t > self.max_seq_len:
                raise ValueError(f"{start + t} positions exceed the model's RoPE table of {self.max_seq_len}")
            for name, layer in self.layers.items():
                h = layer(h, self.rope_cos[start:start + t], self.rope_sin[start:start + t], (cache, name))
            cache.length += t
        else:
            if positions is None:
                cos, sin = self.rope_cos[:t], self.rope_sin[:t]
            else:
                cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if self.run_layers is not None:
                h = self.run_layers(list(self.layers.values()), h, cos, sin)
            else:
                for layer in self.layers.values():
                    h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        if targets is not None:
            return self.output(h, targets=targets)  # the loss, never the whole (B, T, V) logits
        return self.output(h) if self.output is not None else h  # (B, T, V)

    def set_attention(self, fn: AttentionFn) -> None:
        for layer in self.layers.values():
            layer.attention.attention_fn = fn

    def set_sequence_group(self, group) -> None:
        """The process group whose ranks hold parts of the same sequences (context parallelism): a mixture
        of experts' blocks sum their sequence statistics over it (raydist.models.moe)."""
        from raydist.models.moe import moe_blocks

        for block in moe_blocks(self):
            block.sequence_group = group

    def tensor_parallel_roles(self) -> tuple[dict[str, str], dict[str, str]]:
        """How tensor parallelism splits each module, by role: ({module in a block: role} (`block_roles`),
        {module of the root this model or pipeline stage holds: role}). raydist.parallel.tensor gives each
        role its style and knows no module name."""
        root = {name: role for name, role in self.ROOT_ROLES.items() if getattr(self, name) is not None}
        return block_roles(self.cfg), root

    # ---- the root's parts as the parallel plans see them: by role, not by name -----------------------

    # the root's modules (each absent on some pipeline stages) and their tensor-parallel roles
    ROOT_ROLES = {"tok_embeddings": "vocab_embedding", "norm": "norm", "output": "vocab_head"}

    @property
    def embedding(self) -> nn.Module | None:
        """The input embedding (None on pipeline stages after the first)."""
        return self.tok_embeddings

    @property
    def head(self) -> nn.Module | None:
        """The output head (None on pipeline stages before the last)."""
        return self.output

    def tie_head(self) -> None:
        """Share the embedding's weight with the head again (after a parallel plan replaced one of them)."""
        self.output.register_parameter("weight", self.tok_embeddings.weight)

    def tied_aliases(self) -> dict[str, str]:
        """{head weight: embedding weight}: the name the unsplit tied model knows a pipeline's head copy by."""
        return {"output.weight": "tok_embeddings.weight"}

    def stage(self, layer_keys: list[str], first: bool, last: bool) -> "GPT":
        """A shallow copy of this model keeping only the blocks `layer_keys`, the embedding when `first`, the
        final norm and head when `last` (a pipeline stage). The module's own containers (submodules,
        parameters, buffers, hooks) are copied so that later wrapping of one stage (FSDP hooks, class swap)
        does not leak into another; parameters are shared with this model."""
        chunk = _own_containers(self)
        chunk.layers = nn.ModuleDict({k: self.layers[k] for k in layer_keys})
        if not first:
            chunk.tok_embeddings = None
        if not last:
            chunk.norm = None
            chunk.output = None
        return chunk

    def give_head(self, weight: nn.Parameter, copy: bool) -> None:
        """A head on a stage that holds none of its own (a tied model's last stage): `weight` itself (the
        same rank holds the embedding), or a copy of it that the pipeline keeps equal. Like the head it
        replaces (a stage keeps the unsplit model's, whose weight is the embedding's): its class and settings
        (the installed kernel's, whose forward may also compute the loss), with its own containers."""
        head = _own_containers(self.output)
        if copy:
            own = nn.Parameter(torch.empty_like(weight), requires_grad=weight.requires_grad)  # frozen by peft: too
            with torch.no_grad():
                own.copy_(weight)
            weight = own
        head.weight = weight
        self.output = head

    def view_of(self, chunks: list["GPT"]) -> "GPT":
        """One module over a rank's stages with the unsharded model's names: what the optimizer,
        checkpoints and gradient checks see. Its parameters are the stages' own (a head copy included)."""
        view = self.__class__.__new__(self.__class__)
        nn.Module.__init__(view)
        view.cfg, view.max_seq_len, view.run_layers = self.cfg, self.max_seq_len, None
        view.layers = nn.ModuleDict({k: m for c in chunks for k, m in c.layers.items()})
        for attribute in self.ROOT_ROLES:
            setattr(view, attribute, next((getattr(c, attribute) for c in chunks if getattr(c, attribute) is not None),
                                          None))
        return view


def block_roles(cfg: ModelConfig) -> dict[str, str]:
    """{module inside a TransformerBlock: its tensor-parallel role}. Roles (raydist.parallel.tensor):
    column / row: a Linear split by its outputs / its inputs (Megatron's column- and row-parallel);
    kv: column, or replicated with each rank keeping its query heads' kv head when tp exceeds the kv heads;
    norm: a norm on the residual stream; head_norm: a norm over each head of q or k (Qwen3);
    attention_input (x, cos, sin) / mlp_input (x): a module whose input the projections under it share
    (gathered once, its gradient reduced once); moe: a mixture of experts, which splits itself. The root's
    roles: vocab_embedding, norm, vocab_head."""
    head_norms = {"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"} if family_of(cfg).qk_norm else {}
    # a mixture of experts splits itself (raydist.models.moe.MoEFeedForward.shard_tensor_parallel)
    mlp = {"feed_forward": "moe"} if cfg.moe_experts else {"feed_forward": "mlp_input", "feed_forward.w1": "column",
                                                          "feed_forward.w3": "column", "feed_forward.w2": "row"}
    return {"attention_norm": "norm", "attention": "attention_input", "attention.wq": "column",
            "attention.wk": "kv", "attention.wv": "kv", "attention.wo": "row", **head_norms,
            "ffn_norm": "norm", **mlp}


def build_model(cfg: ModelConfig, max_seq_len: int, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The whole model on one device: built on the meta device, given storage, initialised by
    (seed, parameter name), so it holds exactly what every parallel layout's shards hold."""
    from raydist.models.init import materialize

    with torch.device("meta"):
        model = GPT(cfg, max_seq_len)
    return materialize(model, torch.device(device), cfg, seed)


# ---- parameter and FLOP counts (for MFU and the memory model) ----------------------------------------


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the unsharded model by kind (biases and head norms count as norms: not matmul)."""
    family, e = family_of(cfg), cfg.head_size
    attention = cfg.d_model * cfg.num_heads * e * 2 + cfg.d_model * cfg.num_kv_heads * e * 2
    mlp = active_mlp = 3 * cfg.d_model * cfg.ffn_hidden
    if cfg.moe_experts:  # every expert is held; a token multiplies by the router, its k experts, the shared one
        router, shared = cfg.d_model * cfg.moe_experts, 3 * cfg.d_model * cfg.moe_shared_ffn_hidden
        mlp = router + cfg.moe_experts * 3 * cfg.d_model * cfg.expert_hidden + shared
        active_mlp = router + cfg.moe_top_k * 3 * cfg.d_model * cfg.expert_hidden + shared
    norms = 2 * cfg.d_model + (2 * e if family.qk_norm else 0)
    norms += (cfg.num_heads + 2 * cfg.num_kv_heads) * e if family.qkv_bias else 0
    per_block = attention + mlp + norms
    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    total = cfg.num_layers * per_block + embedding + head + cfg.d_model
    # block_matmul: the weights one token multiplies by (MoE: active parameters only), for FLOPs and MFU
    return {"per_block": per_block, "block_matmul": attention + active_mlp, "embedding": embedding,
            "head": head, "total": total}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * L * H * E * T.

    N_matmul counts every weight used in a matrix multiply (blocks and the output head, tied or not; the
    embedding lookup is not a matmul). The attention term is the QK^T and AV products, forward (4 T H E)
    plus backward (twice that), counted over the full T x T square as PaLM and Megatron report MFU.
    """
    counts = param_counts(cfg)
    n_matmul = cfg.num_layers * counts["block_matmul"] + cfg.vocab_size * cfg.d_model
    attention = 12 * cfg.num_layers * cfg.q_width * seq_len  # H E: d_model for Llama, not for Qwen3-0.6B
    return 6.0 * n_matmul + attention

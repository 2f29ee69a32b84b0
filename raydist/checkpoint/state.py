"""What a checkpoint holds, split into DCP tensors and JSON.

Tensors (DCP, resharded on load): the model's state dict and AdamW's per-parameter state, both keyed by
the unsharded parameter names (`layers.3.attention.wq.weight`, `state.layers.3.attention.wq.weight.exp_avg`),
so any layout loads any other layout's checkpoint. Everything else is JSON (`extra.json`): step, data
position (global sample index), LR-schedule state, the optimizer's hyper-parameters, RNG state and run
bookkeeping.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 aliases: dict[str, str] | None = None) -> tuple[dict, dict]:
    """({"model": ..., "optim": ...} of tensors, the optimizer's non-tensor entries).

    `aliases` ({"output.weight": "tok_embeddings.weight"} on a pipeline's last stage holding a tied
    output copy) stores that parameter's optimizer state under the unsplit model's name, where the two
    are one parameter, so pipeline and non-pipeline checkpoints load into each other."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    optim_sd = _rename(optim_sd, aliases or {})
    tensors = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    hyper = {k: _jsonable(v) for k, v in optim_sd.items() if not isinstance(v, torch.Tensor)}
    return {"model": model_sd, "optim": tensors}, hyper


def apply_tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict,
                       hyper: dict, aliases: dict[str, str] | None = None) -> None:
    optim_sd = dict(tensors["optim"])
    optim_sd.update({k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})
    optim_sd = _rename(optim_sd, {new: old for old, new in (aliases or {}).items()})
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_sd, options=OPTIONS)


def _rename(flat_optim: dict, names: dict[str, str]) -> dict:
    """Flattened optimizer keys are `state.<param>.<field>` / `param_groups.<param>.<field>`."""
    if not names:
        return flat_optim
    out = {}
    for key, value in flat_optim.items():
        for old, new in names.items():
            for prefix in ("state.", "param_groups."):
                if key.startswith(prefix + old + "."):
                    key = prefix + new + key[len(prefix + old):]
        out[key] = value
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


def rng_state() -> dict[str, str]:
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def set_rng_state(state: dict[str, str]) -> None:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode(state["cuda"]))

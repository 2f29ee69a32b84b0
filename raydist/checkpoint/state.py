"""What a checkpoint holds: stateful parts, each owning its `state_dict` / `load_state_dict`.

A checkpoint is a dict of parts (DCP's `Stateful` protocol, as TorchTitan's checkpointer uses it):

    model_optim   the model's and AdamW's state, keyed by the unsharded parameter names
                  (`model.layers.3.<name>.weight`, `optim.state.layers.3.<name>.weight.exp_avg`),
                  so any layout loads any other layout's checkpoint
    schedule      the LR schedule's position
    data          optimizer steps done and the data position (global sample index of the next sample)
    rng           the torch (and CUDA) generator states
    run           run bookkeeping that survives restarts (world size, mesh and layout it was written
                  with, small notes such as the first validation loss)

The manager splits every part's state dict by leaf: tensors go to DCP (resharded on load), everything
else to `extra.json`. Loading gives each part its own dict back with both halves merged.
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Protocol

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelOptimizerState:
    """The model and its optimizer. `aliases` (the head's weight named as the tied embedding's, on a pipeline's
    last stage holding a tied output copy) stores that parameter's optimizer state under the unsplit
    model's name, where the two are one parameter, so pipeline and non-pipeline checkpoints load into
    each other."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 aliases: dict[str, str] | None = None, on_load: Callable[[], None] | None = None):
        """`on_load`: called after the state is loaded (the Trainer then knows its weights came from it)."""
        self.model, self.optimizer, self.aliases, self.on_load = model, optimizer, aliases or {}, on_load

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        optim_sd = _rename(optim_sd, self.aliases)
        return {"model": model_sd, "optim": {k: _jsonable(v) for k, v in optim_sd.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optim_sd = {k: tuple(v) if isinstance(v, list) else v for k, v in state["optim"].items()}
        # A rank holding both the original and its alias (ZB-V's rank 0: embedding and tied output copy)
        # gives the stored entry to both
        held = {name for name, _ in self.model.named_parameters()}
        optim_sd = _rename(optim_sd, {new: old for old, new in self.aliases.items()}, keep=held)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd,
                       options=OPTIONS)
        if self.on_load is not None:
            self.on_load()


class SchedulerState:
    """A torch LR scheduler's position (its lambdas are code, rebuilt from the config)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        merged = self.scheduler.state_dict()
        merged.update(state)
        self.scheduler.load_state_dict(merged)


class RNGState:
    def state_dict(self) -> dict[str, str]:
        out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
        return out

    def load_state_dict(self, state: dict[str, str]) -> None:
        def decode(text: str) -> torch.Tensor:
            return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

        torch.set_rng_state(decode(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(decode(state["cuda"]))


class AttributeState:
    """Named plain-JSON attributes of an object (the Trainer's step and data position, its run notes)."""

    def __init__(self, owner: Any, *names: str, fixed: dict[str, Any] | None = None,
                 on_load: Callable[[], None] | None = None):
        """`fixed`: facts saved for the record but not restored; `on_load`: called after restoring."""
        self.owner, self.names, self.fixed, self.on_load = owner, names, fixed or {}, on_load

    def state_dict(self) -> dict[str, Any]:
        return {**{name: getattr(self.owner, name) for name in self.names}, **self.fixed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.names:
            if name in state:
                setattr(self.owner, name, state[name])
        if self.on_load is not None:
            self.on_load()


def split_state(parts: dict[str, Stateful]) -> tuple[dict, dict, dict[str, list[str]]]:
    """(DCP tensors, JSON, owners) of every part: tensor leaves keep their nesting at the top of the DCP tree
    (parts' top-level keys must differ; `owners[part]` lists its keys), every other leaf goes under the
    part's name in the JSON."""
    tensors: dict[str, Any] = {}
    json_state: dict[str, Any] = {}
    owners: dict[str, list[str]] = {}
    for name, part in parts.items():
        t, j = _split(part.state_dict())
        clash = set(t) & set(tensors)
        if clash:
            raise ValueError(f"checkpoint parts share tensor keys {sorted(clash)}")
        tensors.update(t)
        json_state[name] = j
        owners[name] = list(t)
    return tensors, json_state, owners


def merge_state(parts: dict[str, Stateful], tensors: dict, owners: dict[str, list[str]], json_state: dict) -> None:
    """Hands each part its state back: its keys of `tensors` (loaded in place by DCP) merged with its JSON."""
    for name, part in parts.items():
        own = {k: tensors[k] for k in owners[name]}
        part.load_state_dict(_merge(own, json_state.get(name, {})))


def _split(tree: dict) -> tuple[dict, dict]:
    tensors, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            t, r = _split(value)
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r
        else:
            rest[key] = value
    return tensors, rest


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _rename(flat_optim: dict, names: dict[str, str], keep: set[str] = frozenset()) -> dict:
    """Flattened optimizer keys are `state.<param>.<field>` / `param_groups.<param>.<field>`; entries of a
    renamed parameter in `keep` stay under the old name too."""
    if not names:
        return flat_optim
    out = {}
    for key, value in flat_optim.items():
        for old, new in names.items():
            for prefix in ("state.", "param_groups."):
                if key.startswith(prefix + old + "."):
                    if old in keep:  # both parameters get their own tensors (the optimizer updates in place)
                        out[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    key = prefix + new + key[len(prefix + old):]
        out[key] = value
    return out


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

"""TOML in and out for `raydist.config`: reading files, `--set section.key=value` overrides, typed section
construction, writing the resolved config back, and the field docs read from config.py's source (the
README's reference table)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import sys
from pathlib import Path
from typing import Any

from raydist.config.sections import CHOICES, SECTIONS
from raydist.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing TOML file "
                          "(e.g. workloads/gpt_tiny.toml)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is parsed as a TOML value when it can be,
    else kept as a bare string (so `--set checkpoint.storage=/tmp/x` needs no quotes)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
    dotted, text = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key.strip(), value


def build_section(name: str, values: dict[str, Any]):
    cls = SECTIONS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            near = _closest(key, fields)
            hint = f"; did you mean {name}.{near}?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key {name}.{key}{hint}")
        kwargs[key] = _coerce(f"{name}.{key}", value, fields[key].type)
    return cls(**kwargs)


def _coerce(dotted: str, value: Any, annotation: str) -> Any:
    kind = {"int": int, "float": float, "bool": bool, "str": str}[annotation]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        if isinstance(value, bool) and dotted in CHOICES:  # use_gpu = true in TOML
            value = str(value).lower()
        if isinstance(value, str):
            if dotted in CHOICES and value not in CHOICES[dotted]:
                raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(CHOICES[dotted])}")
            return value
    example = {"int": "4", "float": "0.5", "bool": "true", "str": "'text'"}[annotation]
    raise ConfigError(f"{dotted}={value!r} has the wrong type: expected {annotation} (e.g. {dotted}={example})")


def _closest(key: str, options) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return match[0] if match else None


def dump_toml(sections: dict[str, dict[str, Any]]) -> str:
    """Writes the flat two-level tables this config uses (scalars only)."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} as TOML")


@functools.lru_cache(maxsize=1)
def field_docs() -> dict[str, str]:
    """{'section.key': docstring} parsed from the attribute docstrings of the section classes."""
    modules = dict.fromkeys(sys.modules[cls.__module__] for cls in SECTIONS.values())
    nodes = [node for module in modules for node in ast.parse(inspect.getsource(module)).body]
    class_to_section = {cls.__name__: name for name, cls in SECTIONS.items()}
    docs = {}
    for node in nodes:
        if isinstance(node, ast.ClassDef) and node.name in class_to_section:
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                        and isinstance(getattr(nxt, "value", None), ast.Constant)):
                    doc = " ".join(str(nxt.value.value).split())
                    docs[f"{class_to_section[node.name]}.{stmt.target.id}"] = doc
    return docs


def reference_markdown() -> str:
    """The README's config reference: one table per section, from the dataclasses and docstrings."""
    docs = field_docs()
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"### [{name}]\n\n| key | default | meaning |\n| --- | --- | --- |")
        for f in dataclasses.fields(cls):
            default = _toml_value(f.default)
            choices = CHOICES.get(f"{name}.{f.name}")
            doc = docs[f"{name}.{f.name}"]
            out.append(f"| `{f.name}` | `{default}` | {doc}" + (f" One of {', '.join(choices)}." if choices and
                                                                  "`" not in doc else "") + " |")
        out.append("")
    return "\n".join(out)

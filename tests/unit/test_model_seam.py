"""The model seam holds: code outside the model package (raydist/models, raydist/families) never names one
family's modules. The names come from the models themselves (every family's module attribute names that
are not plain words: `wq`, `w1`, `tok_embeddings`, `attention_norm`, `q_norm`...), so a new family's
names are held to it too."""

from __future__ import annotations

import re
from pathlib import Path

import raydist

PACKAGE = Path(raydist.__file__).resolve().parent
SEAM = ("models", "families")  # the model package: where a family's own names belong
GENERIC = {"layers", "attention", "norm", "output"}  # plain words other code may say


def family_module_names() -> set[str]:
    from raydist.config_sections import ModelConfig
    from raydist.families.registry import FAMILY_NAMES
    from raydist.models.gpt import build_model

    names = set()
    for family in FAMILY_NAMES:
        model = build_model(ModelConfig(family=family, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                                        ffn_hidden=64, vocab_size=64, tie_embeddings=False), 16, seed=0)
        for path, _ in model.named_modules():
            names.update(part for part in path.split(".") if part and not part.isdigit())
    return names - GENERIC


def occurrences(names: set[str], sources: dict[str, str]) -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    return [f"{path}:{n}: {m.group(1)}" for path, text in sources.items()
            for n, line in enumerate(text.splitlines(), 1) for m in pattern.finditer(line)]


def outside_the_seam() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in SEAM}


def test_code_outside_the_model_package_names_no_familys_modules():
    names = family_module_names()
    assert {"wq", "w1", "tok_embeddings", "q_norm"} <= names, sorted(names)  # (Llama's and Qwen3's)
    assert occurrences(names, outside_the_seam()) == []


def test_the_scan_finds_a_planted_name():
    names = family_module_names()
    planted = {"parallel/x.py": "a = 1\nplan = {'layers.0.attention.wq': colwise}  # the q projection\n"}
    assert occurrences(names, planted) == ["parallel/x.py:2: wq"]

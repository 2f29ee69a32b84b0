"""The package's house rules, read from the source (no import runs): a root of at most 8 modules, rooms that
import only rooms below them (LAYERS, bottom first: docs/architecture.md draws the same floors), no import
cycle between modules, no import put inside a function to dodge one, no re-export glued into the middle of
a file (`noqa: E402`). Each rule is shown to catch a planted breach in a small fake package."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "raydist"
# Rooms, bottom floor first: a room imports only rooms before it. The root's modules are rooms of their own.
LAYERS = ("errors.py", "store", "schedule", "families", "config_sections.py", "config_io.py", "config.py", "strict", "metrics",
          "checkpoint", "models", "kernels", "parallel", "data", "planner", "elastic", "training", "inference",
          "driver", "report", "cli.py", "testing.py", "__main__.py")
ROOT_LIMIT = 8


def modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def room(module: str, package: Path) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return parts[1] if (package / parts[1]).is_dir() else parts[1] + ".py"


def imports(package: Path) -> list[tuple[str, str, int, bool]]:
    """(importer, imported module, line, inside a function) for every import of the package by itself."""
    mods = modules(package)
    name = package.name
    out = []

    def resolve(target: str) -> str | None:
        while target and target not in mods:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        return target or None

    for module, path in mods.items():
        def visit(node: ast.AST, nested: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and (
                        child.module == name or child.module.startswith(name + ".")):
                    targets = [f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in mods else child.module
                               for a in child.names]
                elif isinstance(child, ast.Import):
                    targets = [a.name for a in child.names if a.name == name or a.name.startswith(name + ".")]
                for target in targets:
                    if (resolved := resolve(target)) and resolved != module:
                        out.append((module, resolved, child.lineno, nested))
                visit(child, inner)

        visit(ast.parse(path.read_text()), False)
    return out


def upward(package: Path, layers=LAYERS) -> list[str]:
    rank = {r: i for i, r in enumerate(layers)}
    found = []
    for src, dst, line, _ in imports(package):
        a, b = room(src, package), room(dst, package)
        if a is None or b is None or a == b:
            continue
        if a not in rank or b not in rank:
            found.append(f"{src} -> {dst}: room {a if a not in rank else b} has no floor in LAYERS")
        elif rank[b] > rank[a]:
            found.append(f"{src}:{line} imports {dst}, a room above it ({a} < {b})")
    return found


def loops(package: Path) -> list[str]:
    """Imports that close a loop: at module level, or inside a function where the imported module reaches
    back to the importer through module-level imports (the import was moved to dodge the loop)."""
    every = imports(package)
    top: dict[str, set[str]] = {}
    for src, dst, _, nested in every:
        if not nested:
            top.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str) -> bool:
        seen, stack = set(), [a]
        while stack:
            for nxt in top.get(stack.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    return [f"{src}:{line} -> {dst}" + (" (inside a function)" if nested else "")
            for src, dst, line, nested in every if reaches(dst, src)]


def glued(package: Path) -> list[str]:
    return [f"{path}:{i}" for path in modules(package).values()
            for i, line in enumerate(path.read_text().splitlines(), 1) if "noqa: E402" in line]


def root_modules(package: Path) -> list[str]:
    return sorted(p.name for p in package.glob("*.py"))


def test_the_house_keeps_its_rules():
    assert len(root_modules(PACKAGE)) <= ROOT_LIMIT, root_modules(PACKAGE)
    rooms = {room(m, PACKAGE) for m in modules(PACKAGE)} - {None, "__init__.py"}
    assert rooms <= set(LAYERS), f"rooms without a floor in LAYERS: {sorted(rooms - set(LAYERS))}"
    assert upward(PACKAGE) == []
    assert loops(PACKAGE) == []
    assert glued(PACKAGE) == []


def _fake(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(textwrap.dedent(text))
    return package


@pytest.mark.parametrize("files, rule", [
    ({"low/a.py": "from pkg.high.b import X\n", "high/b.py": "X = 1\n"}, "upward"),
    ({"low/a.py": "import pkg.low.b\n", "low/b.py": "from pkg.low import a\n"}, "loops"),
    ({"low/a.py": "def f():\n    from pkg.low.b import Y\n", "low/b.py": "from pkg.low.a import f\nY = 1\n"}, "loops"),
    ({"low/a.py": "X = 1\nfrom pkg.low.b import Y  # noqa: E402\n", "low/b.py": "Y = 1\n"}, "glued"),
    ({f"m{i}.py": "" for i in range(ROOT_LIMIT)}, "root"),
])
def test_each_rule_catches_a_planted_breach(tmp_path, files, rule):
    package = _fake(tmp_path, files)
    found = {"upward": lambda: upward(package, ("low", "high")), "loops": lambda: loops(package),
             "glued": lambda: glued(package), "root": lambda: root_modules(package)[ROOT_LIMIT:]}[rule]()
    assert found, f"the planted {rule} breach went unseen"
    clean = _fake(tmp_path / "clean", {"low/a.py": "X = 1\n", "high/b.py": "from pkg.low.a import X\n"})
    assert upward(clean, ("low", "high")) == loops(clean) == glued(clean) == []

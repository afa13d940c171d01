"""The package layout holds: imports point down only, and no function grows past ~80 lines."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hdcli"
# bottom first: a module may import from its own unit and the units before it
ORDER = ["errors", "engine", "db", "drafting", "hsd", "config", "compose", "bench", "api", "serve", "cli"]


def unit(module: str) -> str:
    """'hdcli.engine.decode' -> 'engine'; 'hdcli' (the package: __version__) -> 'errors'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"


def imports(path: Path) -> list[str]:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
                out += names
            elif node.module and node.module.startswith("hdcli"):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("hdcli")]
    return out


def test_imports_point_down_only():
    bad = []
    for path in ROOT.rglob("*.py"):
        here = unit(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        for target in imports(path):
            there = unit(target)
            if there in ORDER and ORDER.index(there) > ORDER.index(here):
                bad.append(f"{path.relative_to(ROOT.parent)} imports {target}")
    assert not bad, bad


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.name} {n} lines")
    assert not long, long

"""The package's import order holds: imports point down only, no import circle, and no function grows past ~80 lines."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hdcli"
# bottom first: a module may import from its own unit and the units before it; inputs (files the
# user names, read with a bound) sits on errors alone. The engine's rooms
# are units of their own: environment, progress (bars on stderr) and records at the bottom, then kernels, the model, text
# (prompts, templates, tools, grammars), the decode loop, the local model stores (Ollama's and LM
# Studio's folders: paths only) and the loader that puts a model together.
ENGINE = ["engine.environment", "engine.progress", "engine.records", "engine.kernels", "engine.model", "engine.text",
          "engine.decode", "engine.local_models", "engine.loader", "engine"]
# the commands' own functions (the ones `hd build-stats`, `hd plan`, ... call) are one folder above
# the run they put together (generation) and the benchmarks, below the faces that call them
ORDER = ["errors", "inputs", *ENGINE, "db", "drafting", "hsd", "config", "compose", "bench", "generation",
         "commands", "api", "serve", "flags", "show", "cli_bench", "cli"]


def unit(module: str) -> str:
    """'hdcli.engine.decode.loop' -> 'engine.decode'; 'hdcli.db.stores' -> 'db'; 'hdcli' (the
    package: __version__) -> 'errors'."""
    parts = module.split(".")
    if parts[1:] == ["__init__"]:   # the package itself: it asks engine/environment.py for oneDNN's cap first
        return "engine.environment"
    if parts[1:] == ["__main__"]:   # `python -m hdcli`: the command line's entry, at the top
        return "cli"
    if len(parts) > 2 and parts[1] == "engine" and f"engine.{parts[2]}" in ENGINE:
        return f"engine.{parts[2]}"
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


def _graph() -> dict[str, set[str]]:
    """Every hdcli module -> the hdcli modules it imports, at the top or inside a function (a
    package's own __init__ importing its submodules aside: a re-export, not a dependency)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mods[".".join(rel.parts[:-1]) if rel.name == "__init__" else ".".join(rel.parts)] = path
    graph = {}
    for name, path in mods.items():
        targets = set()
        for t in imports(path):
            while t and t not in mods:   # 'pkg.mod.Name' -> 'pkg.mod'
                t = t.rpartition(".")[0]
            if t and t != name and not t.startswith(name + "."):
                targets.add(t)
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[str]:
    state, circles = {}, []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_no_import_circle():
    """No module reaches itself through imports, top-level or hidden inside functions: a circle
    is how a lower room comes to depend on a higher one."""
    assert not _circles(_graph())


def test_the_circle_check_finds_a_circle():
    """Negative control: the check sees the circle records -> costs -> records once it is added."""
    graph = _graph()
    graph["hdcli.engine.records"].add("hdcli.engine.decode.costs")
    assert any("hdcli.engine.records" in c for c in _circles(graph))

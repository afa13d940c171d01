"""The docs keep up with the code: docs/architecture.md maps every module under hdcli/, and the docs
cite only files that exist."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAP = REPO / "docs" / "architecture.md"
# a map entry: a list item that starts with the module's path in backticks
ENTRY = re.compile(r"^- `(hdcli/[^`]*)`", re.MULTILINE)
# a path from the repository's root: hdcli/..., benchmarks/..., tests/...
ROOTED = re.compile(r"(?<![\w/.-])((?:hdcli|benchmarks|tests)/[\w/.{},*-]*[\w/])")
# a path from inside the package (`engine/model/gguf.py`, `kernels/fused.decide`, `csrc/qmm.cpp`):
# taken where it ends in .py, a slash, or an attribute or extension after a dot
INSIDE = re.compile(r"(?<![\w/.-])((?:engine|db|drafting|hsd|serve|bench|kernels|model|decode|text|forward|csrc)"
                    r"/[\w/]*?\w+)(\.py\b|/|\.\w+)")
BARE = re.compile(r"`(\w+\.py)`")
INSIDE_BASES = ("hdcli/", "hdcli/engine/", "hdcli/engine/kernels/")


def module_names(package: Path) -> set[str]:
    """Every module under `package` as the map names it: `hdcli/db/stores.py`, a package by its
    folder (`hdcli/db/` for hdcli/db/__init__.py)."""
    names = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).as_posix()
        names.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    return names


def map_problems(modules: set[str], entries: list[str]) -> list[str]:
    missing = [f"not in the map: {m}" for m in sorted(modules - set(entries))]
    stale = [f"in the map, not in hdcli/: {e}" for e in sorted(set(entries) - modules)]
    return missing + stale


def _exists(path: str, root: Path) -> bool:
    if any(c in path for c in "{}*") or path.endswith("_"):   # a pattern (`stats_{fp32,bf16}.json`)
        return True
    if path.endswith((".py", "/")) or (root / path).exists():
        return (root / path).exists()
    module = re.sub(r"\.\w+$", "", path)                     # `engine/loader.load`: the module
    return (root / f"{module}.py").exists() or (root / module).is_dir()


def stale_citations(text: str, root: Path = REPO, file_names: set[str] | None = None) -> list[str]:
    """The paths `text` cites that do not exist under `root`."""
    if file_names is None:
        file_names = {p.name for d in ("hdcli", "benchmarks", "tests") for p in (root / d).rglob("*.py")}
    out = []
    for m in ROOTED.finditer(text):
        if not _exists(m.group(1), root):
            out.append(m.group(1))
    for m in INSIDE.finditer(text):
        inner, tail = m.groups()
        if not any(_exists(base + inner + tail, root) for base in INSIDE_BASES):
            out.append(inner + tail)
    out += [m.group(1) for m in BARE.finditer(text) if m.group(1) not in file_names]
    return out


def test_every_module_is_in_the_map_and_the_map_names_only_modules():
    problems = map_problems(module_names(REPO / "hdcli"), ENTRY.findall(MAP.read_text()))
    assert not problems, "docs/architecture.md:\n" + "\n".join(problems)


def test_map_check_catches_a_missing_and_a_deleted_module():
    modules = {"hdcli/", "hdcli/engine/", "hdcli/engine/decode/loop.py", "hdcli/cli.py"}
    text = "- `hdcli/`: x\n- `hdcli/engine/`: x\n- `hdcli/engine/decode.py`: x\n- `hdcli/cli.py`: x\n"
    assert map_problems(modules, ENTRY.findall(text)) == [
        "not in the map: hdcli/engine/decode/loop.py", "in the map, not in hdcli/: hdcli/engine/decode.py"]
    assert module_names(REPO / "hdcli") >= {"hdcli/", "hdcli/engine/decode/", "hdcli/engine/decode/loop.py"}


def test_docs_cite_only_files_that_exist():
    problems = [f"{doc.relative_to(REPO)}: {path}" for doc in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
                for path in stale_citations(doc.read_text())]
    assert not problems, "cited, not there:\n" + "\n".join(problems)


def test_citation_check_catches_deleted_files():
    text = ("the loop (`hdcli/engine/decode.py`), `engine/models.load`, `forward/llama.Step`, (`fused.py`, "
            "`decode.py`), engine/forward/; and what exists: `hdcli/engine/decode/loop.py`, "
            "`engine/loader.load`, `kernels/fused.decide`, `csrc/qmm.cpp`, `loop.py`, hdcli/engine/model/")
    assert stale_citations(text) == ["hdcli/engine/decode.py", "engine/models.load", "forward/llama.Step",
                                     "engine/forward/", "decode.py"]

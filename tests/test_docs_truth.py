"""The docs say what the code does: the default drafting order the README, docs/ and docstrings
state is the registry's, and environment variables are read in engine/environment.py alone."""
from __future__ import annotations

import re
from pathlib import Path

from hdcli.drafting import registry

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hdcli"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a stated order: "Default order: context → stats → model → recycle" (a line break may fall inside)
STATED = re.compile(r"Default\s+order:\s+(\w+(?:\s*→\s*\w+)+)")
# where the order must be stated, so that a reader finds it
MUST_STATE = ["README.md", "docs/model-db.md", "docs/engine.md"]
# docs/benchmarks.md records what each run ran, in that day's order; elsewhere a list of the
# default layers by name is the order they run in
HISTORY = ["docs/benchmarks.md"]


def code_order() -> list[str]:
    """The default hierarchy with every DB given, as the registry builds it (LayerSpec.rank)."""
    return registry.default_layers(registry.LayerInputs(stats_stores=["stats"], model_db="model"))


def stated_orders(text: str) -> list[list[str]]:
    return [re.split(r"\s*→\s*", m.group(1)) for m in STATED.finditer(text)]


def listed_orders(text: str, names: list[str]) -> list[list[str]]:
    """Every list of exactly the default layers' names ("context, stats, model, recycle", by
    commas or arrows), in the order written."""
    word = "|".join(names)
    lists = re.finditer(rf"\b(?:{word})(?:(?:,\s+|\s*(?:→|->)\s*)(?:{word})\b)+", text)
    found = [re.findall(rf"\b(?:{word})\b", m.group(0)) for m in lists]
    return [f for f in found if sorted(f) == sorted(names)]


def _sources() -> list[tuple[str, str]]:
    files = [*DOCS, *sorted(PACKAGE.rglob("*.py"))]
    return [(p.relative_to(REPO).as_posix(), p.read_text()) for p in files]


def test_the_stated_default_order_is_the_codes():
    order = code_order()
    assert order[0] == "context" and len(order) >= 2, order   # the registry has its layers
    wrong, stating = [], set()
    for name, text in _sources():
        for stated in stated_orders(text):
            stating.add(name)
            if stated != order:
                wrong.append(f"{name}: {' → '.join(stated)}")
        # a list of two layer names is English as often ("the model, context and ..."): lists are
        # checked where the default has three names or more
        if name not in HISTORY and len(order) >= 3:
            wrong += [f"{name}: {', '.join(listed)}" for listed in listed_orders(text, order) if listed != order]
    assert not wrong, f"the code's default order is {' → '.join(order)}; these say otherwise:\n" + "\n".join(wrong)
    missing = [name for name in MUST_STATE if name not in stating]
    assert not missing, f"say 'Default order: {' → '.join(order)}' in: {missing}"


def test_the_order_check_catches_a_wrong_order():
    order = ["context", "stats", "model", "recycle"]
    text = ("Default order: context → model →\n   recycle → stats. The hierarchy: context, model,\n"
            "recycle, stats; methods context+model+recycle; context 76%, model 18%, recycle 4%, stats 1%")
    assert stated_orders(text) == [["context", "model", "recycle", "stats"]]
    assert listed_orders(text, order) == [["context", "model", "recycle", "stats"]] * 2   # the arrows, the commas
    assert listed_orders("layers context, stats, model, recycle", order) == [order]


# where os.environ or os.getenv may appear outside environment.py, and why
ENV_READ = re.compile(r"\bos\.(?:environ|getenv|putenv|unsetenv)\b|\bfrom\s+os\s+import\b[^\n]*\b(?:environ|getenv)\b")
ENV_ALLOWED = {
    # pip's ninja put on PATH for the processes torch's extension build starts (not a setting of hd's)
    "hdcli/engine/kernels/build.py": "PATH",
}


def env_uses(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if ENV_READ.search(line)]


def test_environment_variables_are_read_in_environment_py_alone():
    stray, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        if name == "hdcli/engine/environment.py":
            continue
        for n, line in env_uses(path.read_text()):
            if ENV_ALLOWED.get(name, "\0") in line:
                used.add(name)
            else:
                stray.append(f"{name}:{n}: {line}")
    assert not stray, "read the environment through hdcli/engine/environment.py:\n" + "\n".join(stray)
    assert used == set(ENV_ALLOWED), f"allowed, no longer needed: {sorted(set(ENV_ALLOWED) - used)}"


def test_the_environment_check_catches_a_stray_read():
    text = 'x = os.environ.get("HD_X")\nfrom os import getenv\ny = os.getenv("Y")\n# environ in a comment\n'
    assert [n for n, _ in env_uses(text)] == [1, 2, 3]


def test_environment_readers_keep_their_meaning(monkeypatch):
    from hdcli.engine import environment
    for name, read in [("OLLAMA_MODELS", environment.ollama_models), ("LMSTUDIO_MODELS", environment.lmstudio_models)]:
        monkeypatch.delenv(name, raising=False)
        assert read() is None
        monkeypatch.setenv(name, "")
        assert read() is None                      # set but empty: the store's default folder
        monkeypatch.setenv(name, "/x/models")
        assert read() == "/x/models"
    monkeypatch.delenv("HD_API_KEY", raising=False)
    assert environment.api_key() is None
    monkeypatch.setenv("HD_API_KEY", "")
    assert environment.api_key() == ""                 # set but empty: refused by the CLI

"""The drafting layers hd knows, by name, and how a hierarchy is built from them.

Each layer module registers a LayerSpec when it is imported (hdcli/drafting/__init__.py imports
them all). Everything that needs to know which layers exist reads this table: the hierarchy
builder below, the configuration's validation (hdcli.config), the CLI's help and colours, and
`hd bench`'s single-layer methods. Adding a layer touches its own module, one import in
drafting/__init__.py, and its tests.

Invariants
  layer names are unique and contain no ':' (a suffix after ':' names one of several DBs of a
  layer, e.g. 'stats:wiki', and shares the layer's settings);
  `build` returns the layer objects in the order they are asked, or raises HdError naming the
  option that is missing (a DB layer without its DB).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import HdError


@dataclass
class LayerInputs:
    """What a layer is built from: the drafting settings of a run (defaults resolved, see
    hdcli.config) and the opened resources."""
    min_n: int = 1                 # shortest context-DB key
    max_n: int = 4                 # longest context-DB key
    min_prob: float = 0.0          # stats/model DB walk: least probability of the whole draft
    min_expected: float = 0.0      # stats/model DB: least expected accepted tokens of a draft
    stats_stores: Sequence = ()    # open hdcli.db.stores.Store objects (the config's stats_dbs: their paths)
    model_db: object = None        # an open Store, or None
    recycle_table: object = None   # a shared drafting.recycle.RecycledTable, or None for a new one
    answer_index: object = None    # a drafting.model.AnswerIndex over model_db, or None for the
                                   # process's own (one per DB file, drafting.model.index_for)


@dataclass(frozen=True)
class LayerSpec:
    name: str
    build: Callable[[LayerInputs], list]    # the layer objects (stats: one per DB)
    help: str                               # one line: `hd generate --help`, `hd bench` methods
    # prior per-token acceptance once the verification reaches a drafted token, by its place in
    # the tree: a later sibling, or a first child at depth 1, 2, 3+. Acceptance rises with depth
    # (a match that held so far goes on holding) and later siblings are rarely right. Measured by
    # replaying Spec-Bench outputs (docs/engine.md); the estimate of `first-hit` and `fill`, and
    # where `adaptive` starts every request.
    prior: tuple[float, float, float, float]
    in_default: Callable[[LayerInputs], bool] = lambda s: False  # in the default hierarchy?
    # (DecodingConfig field it cannot run without, what to say when it is missing)
    needs: tuple[str, str] | None = None
    style: str = ""                         # colour of its accepted tokens in a terminal
    short: str = ""                         # label in 80-column tables
    bench_default: bool = True              # a single-layer method of `hd bench` by default
    # place in the default hierarchy, lowest first (ties: registration order): context 0, stats 10,
    # model 20, recycle 30. Declared, not taken from import order, which an import in the model
    # layer's module once decided (and which put `stats` second before this was declared: the
    # ranks keep that order; docs/benchmarks.md's earlier hierarchy runs had `stats` last)
    rank: int = 100

    def missing(self, cfg) -> str | None:
        """What cfg (a DecodingConfig: needs names its field) lacks for this layer, or None."""
        return self.needs[1] if self.needs and not getattr(cfg, self.needs[0]) else None


LAYERS: dict[str, LayerSpec] = {}           # by rank: the default order too
PRIOR_RATES: dict[str, tuple] = {}          # name -> prior (benchmarks/tuning/recycle_tuning.py varies it)


def register(spec: LayerSpec) -> None:
    assert ":" not in spec.name and spec.name not in LAYERS, spec.name
    ordered = sorted([*LAYERS.values(), spec], key=lambda x: x.rank)   # stable: ties keep their order
    LAYERS.clear()
    LAYERS.update((x.name, x) for x in ordered)
    PRIOR_RATES[spec.name] = spec.prior


def names() -> tuple[str, ...]:
    return tuple(LAYERS)


def default_layers(inputs: LayerInputs) -> list[str]:
    """The hierarchy run when no layers are named: every layer whose in_default holds, by rank
    (context, then model: the model DB's answers where given, and this process's; stats and
    recycle only where named)."""
    return [n for n, spec in LAYERS.items() if spec.in_default(inputs)]


def build_layers(names_: Sequence[str], inputs: LayerInputs) -> list:
    layers = []
    for name in names_:
        spec = LAYERS.get(name)
        if spec is None:
            raise HdError(f"unknown drafting layer '{name}'; known layers: {', '.join(LAYERS)}")
        layers += spec.build(inputs)
    return layers

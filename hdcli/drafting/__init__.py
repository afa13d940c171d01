"""Drafting: the layers that propose continuations of the token history, and the hierarchy over
them (the engine's Drafter, hdcli/engine/decode/draft.py).

    registry.py    the layers by name: how each is built, its prior, its default place
    hierarchy.py   Hierarchy (asks the layers, policies first-hit/fill/adaptive), AcceptanceTracker
    context.py     `context`: n-grams of the current request (prompt lookup)
    recycle.py     `recycle`: the target's own predictions from earlier forwards
    stats.py       `stats`: continuations from an n-gram store (LMDB); a model DB's n-gram table
    model.py       `model`: the target's own earlier answers (a model DB), matched on long suffixes
    suffix.py      SuffixDecoding's drafts (arctic-inference): a peer `hd bench` runs, not a layer

The imports below register the layers; each LayerSpec's `rank` gives its place in the hierarchy:
context, stats, model, recycle; the default one is context, then model (the model DB's answers
where given, and this process's; stats and recycle, in no default hierarchy, take their places
where named). The
model DB comes before the recycled predictions: both are the target's own writing, and a long
match in its earlier answers is the stronger evidence (docs/model-db.md, "Place in the
hierarchy"). The statistics DB comes before both (docs/benchmarks.md). Recycle and then stats
left the default when leaving them out made hd faster (`hd bench spec-bench --ablate`,
docs/benchmarks.md).
"""
from ..engine.decode.draft import Draft, base_name, bucket
from . import context, stats, model, recycle  # noqa: F401  (registers them; order: LayerSpec.rank)
from .context import ContextDB
from .stats import StatsLayer
from .model import AnswerIndex, ModelLayer
from .hierarchy import DEFAULT_PRIOR, AcceptanceTracker, Hierarchy, Layer
from .recycle import RecycledLayer, RecycledTable
from .registry import PRIOR_RATES, LayerInputs, LayerSpec, build_layers, default_layers, register

__all__ = ["Draft", "base_name", "bucket", "ContextDB", "StatsLayer", "AnswerIndex", "ModelLayer", "DEFAULT_PRIOR", "AcceptanceTracker",
           "Hierarchy", "Layer", "RecycledLayer", "RecycledTable", "PRIOR_RATES", "LayerInputs",
           "LayerSpec", "build_layers", "default_layers", "register"]

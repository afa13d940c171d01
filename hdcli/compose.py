"""From a DecodingConfig and a loaded target to the thing that drafts.

`build_drafter` is the one place a run's drafter is put together: the database hierarchy
(hdcli/drafting), a stack of draft models over it (hdcli/hsd), or nothing (plain decoding).
`hd generate`, `hd bench`, `hd plan` and the Python API all call it; none composes drafters itself.
A configuration's target is loaded here too (`load_model_for`) and its DBs opened (`open_dbs`).

Defaults that depend on the machine are chosen here, from the target's measured forward cost
(engine/decode/costs.py): where a verification forward over a draft costs about one token's forward
(bf16, packed kernels: "cheap"), shorter keys and likelier-to-fail drafts pay; where it costs
much more (fp32 with torch's kernels), they do not. `resolved` writes the choices into the
configuration a run records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .config import DecodingConfig
from .drafting import Hierarchy, LayerInputs, RecycledTable, build_layers, default_layers, registry
from .engine.decode import costs
from .engine import loader
from .errors import HdError
from .db.stores import Store
from .config import DEFAULT_CANDIDATES, DEFAULT_LEVEL_TOKENS, DEFAULT_POLICY
from .config import level_problems
from .engine.decode.verify import Sampling
from .hsd import draft_models as draftmodels
from .hsd.stack import ModelStack
from .engine.kernels import fused
from .drafting import ContextDB
from .engine.decode.loop import Decoder

Status = Callable[[str], None]  # progress and warnings for a person; ignored under --json


def cheap_verification(lm: loader.LoadedModel) -> bool:
    """Whether verification is nearly free with this model, dtype, kernels and machine
    (costs.CostCurve.verifies_cheaply on costs.curve_for: measured once, cached)."""
    return costs.curve_for(lm).verifies_cheaply()


def default_min_n(cheap_verify: bool) -> int:
    """Shortest context-DB key. Where a verification forward costs much more than one token's,
    unigram matches are accepted too rarely to pay for it; where it costs about one token's, even
    unigram drafts pay (benchmarks/tuning/context_tuning.py)."""
    return 1 if cheap_verify else 2


def default_min_prob(cheap_verify: bool) -> float:
    """Where the statistics/model DB walk stops: the estimated probability of the whole draft."""
    return 0.1 if cheap_verify else 0.2


def default_min_expected(cheap_verify: bool) -> float:
    """Least expected accepted tokens for a DB draft to be worth a verification forward: 1 where
    a forward over a draft costs much more than a plain step, 0 where it costs about one. Both defaults come
    from replaying Spec-Bench outputs (benchmarks/tuning/stats_tuning.py, docs/stats-db.md)."""
    return 0.0 if cheap_verify else 1.0


@dataclass
class DBs:
    """The open DBs of a run (hdcli.db.stores.Store objects)."""
    stats: list = field(default_factory=list)
    model: object = None

    def all(self) -> list:
        return self.stats + ([self.model] if self.model is not None else [])


def open_dbs(cfg: DecodingConfig, lm: loader.LoadedModel | None = None) -> DBs:
    """Open the configuration's DBs (the model DB writable with `learn`), refusing those built for
    another tokenizer when lm is given. Opening before the model loads makes a bad path fail fast."""
    dbs = DBs([Store(p) for p in cfg.stats_dbs],
              Store(cfg.model_db, writable=cfg.learn) if cfg.model_db else None)
    if lm is not None:
        check_tokenizers(dbs, lm)
    return dbs


def check_tokenizers(dbs: DBs, lm: loader.LoadedModel) -> None:
    for db in dbs.all():
        db.check_tokenizer(lm.tokenizer, lm.name, embedding_rows=lm.model.config.vocab_size)


def load_model_for(cfg: DecodingConfig, quiet: bool = False) -> loader.LoadedModel:
    """The target of a configuration, with its dtype, device and kernels."""
    return loader.load(cfg.model, dtype=cfg.dtype, device=cfg.device, kernels=cfg.kernels,
                       quiet=quiet, invariant=cfg.invariant, attention=cfg.attention)


def open_stats_dbs(paths: Sequence[str], lm: loader.LoadedModel | None = None,
                   writable: bool = False) -> list:
    """Open statistics or model DBs, refusing those built for another tokenizer. writable: for
    --learn (model DB)."""
    dbs = [Store(p, writable=writable) for p in paths]
    if lm is not None:
        check_tokenizers(DBs(dbs), lm)
    return dbs


def layer_inputs(cfg: DecodingConfig, dbs: DBs, cheap_verify: bool,
                 recycle_table: RecycledTable | None = None, answer_index=None) -> LayerInputs:
    """The drafting settings with the machine's defaults filled in, and the resources."""
    return LayerInputs(
        min_n=default_min_n(cheap_verify) if cfg.min_n is None else cfg.min_n, max_n=cfg.max_n,
        min_prob=default_min_prob(cheap_verify) if cfg.stats_min_prob is None else cfg.stats_min_prob,
        min_expected=(default_min_expected(cheap_verify) if cfg.stats_min_expected is None
                      else cfg.stats_min_expected),
        stats_stores=dbs.stats, model_db=dbs.model, recycle_table=recycle_table, answer_index=answer_index)


def db_hierarchy(cfg: DecodingConfig, dbs: DBs, cheap_verify: bool, candidates: int | None = None,
                 recycle_table: RecycledTable | None = None, answer_index=None) -> Hierarchy | None:
    """The database hierarchy of the configuration (None when it has no layers). candidates
    overrides cfg.candidates (a level under draft models verifies one chain). recycle_table: pass
    one to share the target's recycled predictions across the drafters of a run; answer_index: the
    model DB's answers to draft from (drafting.model.AnswerIndex; default: the process's own)."""
    inputs = layer_inputs(cfg, dbs, cheap_verify, recycle_table, answer_index)
    names = default_layers(inputs) if cfg.layers is None else cfg.layers
    built = build_layers(names, inputs)
    if not built:
        return None
    return Hierarchy(built, policy=cfg.policy, draft_len=cfg.draft_len,
                     max_candidates=cfg.candidates if candidates is None else candidates)


def make_drafter(layers: Sequence[str] = ("context",), draft_len: int | dict[str, int] = 16,
                 min_n: int | None = None, max_n: int = 4, cheap_verify: bool = False,
                 stats_stores: Sequence = (), stats_min_prob: float | None = None,
                 stats_min_expected: float | None = None, model_db=None,
                 policy: str = DEFAULT_POLICY, candidates: int = DEFAULT_CANDIDATES,
                 recycle_table: RecycledTable | None = None, answer_index=None) -> Hierarchy | None:
    """The drafting hierarchy from open DBs (stats_stores: open statistics DBs, open_stats_dbs;
    model_db: an open model DB), most local layer first (an empty `layers` means plain decoding):
    a shorthand for db_hierarchy with a DecodingConfig. cheap_verify
    (see cheap_verification) picks the defaults of min_n, min_prob and min_expected.
    answer_index: the model DB's answers to draft from (default: the process's own index)."""
    cfg = DecodingConfig(layers=list(layers), draft_len=draft_len, min_n=min_n, max_n=max_n,
                         stats_dbs=[str(getattr(db, "path", "db")) for db in stats_stores],
                         model_db=None if model_db is None else str(getattr(model_db, "path", "db")),
                         stats_min_prob=stats_min_prob, stats_min_expected=stats_min_expected,
                         policy=policy, candidates=candidates).validate()
    return db_hierarchy(cfg, DBs(list(stats_stores), model_db), cheap_verify, recycle_table=recycle_table,
                        answer_index=answer_index)


def make_stack(lm: loader.LoadedModel, draft_models: Sequence[str], level_tokens: Sequence[int] = (),
               base: Hierarchy | None = None, sampling=None, seed: int = 0, loaded: dict | None = None):
    """A hierarchy of draft models (smallest first) over the database hierarchy `base` (None:
    the smallest model drafts alone). level_tokens: T_i per model level, the tokens a level holds
    before it returns its batch (default DEFAULT_LEVEL_TOKENS each). loaded: name -> DraftModel
    cache, so repeated stacks share their draft models."""
    bad = level_problems(draft_models, level_tokens)
    if bad:
        raise HdError(bad[0])
    names = [n.strip() for n in draft_models if n.strip()]
    Ts = list(level_tokens) or [DEFAULT_LEVEL_TOKENS] * len(names)
    loaded = {} if loaded is None else loaded
    levels = []
    for name, T in zip(names, Ts):
        if name not in loaded:
            loaded[name] = draftmodels.load(name, lm)
        levels.append((name, loaded[name].model, T))
    return ModelStack(levels, base, sampling or Sampling(), seed)


def _cheap(cfg: DecodingConfig, lm: loader.LoadedModel) -> bool:
    """cheap_verification where the run drafts (plain decoding measures no cost curve for it)."""
    return cfg.drafting and cheap_verification(lm)


def build_drafter(cfg: DecodingConfig, lm: loader.LoadedModel, dbs: DBs | None = None, *,
                  recycle_table: RecycledTable | None = None, loaded: dict | None = None,
                  answer_index=None):
    """The drafter a configuration describes (with_plan applied): a drafting.Hierarchy, a
    hsd.stack.ModelStack over one (or alone, no_db), or None for plain decoding. dbs: the open
    DBs (default: opened here). loaded: draft models already loaded, by name. The configuration is
    checked here; a run's own (generation.Run) was checked once and calls drafter_for."""
    cfg.validate()
    return drafter_for(cfg, lm, open_dbs(cfg, lm) if dbs is None else dbs, recycle_table=recycle_table,
                       loaded=loaded, answer_index=answer_index)


def drafter_for(cfg: DecodingConfig, lm: loader.LoadedModel, dbs: DBs, *,
                recycle_table: RecycledTable | None = None, loaded: dict | None = None, answer_index=None):
    """build_drafter of a configuration already checked, over its open DBs."""
    cheap = _cheap(cfg, lm)
    if not cfg.draft_models:
        return db_hierarchy(cfg, dbs, cheap, recycle_table=recycle_table, answer_index=answer_index)
    base = None if cfg.no_db else db_hierarchy(cfg, dbs, cheap, candidates=1, recycle_table=recycle_table,
                                               answer_index=answer_index)
    return make_stack(lm, cfg.draft_models, cfg.level_tokens, base, cfg.sampling, cfg.seed or 0, loaded)


def resolved(cfg: DecodingConfig, lm: loader.LoadedModel, dbs: DBs) -> DecodingConfig:
    """The configuration as the run used it: the machine's choices (dtype, device, kernels, the
    drafting defaults, the default layers) written in, so repeating it repeats the run."""
    inputs = layer_inputs(cfg, dbs, _cheap(cfg, lm))
    return cfg.replace(dtype=lm.dtype, device=lm.device, kernels=lm.kernels,
                       invariant="on" if lm.invariant else "off",
                       attention=_attention(cfg, lm),
                       layers=default_layers(inputs) if cfg.layers is None else cfg.layers,
                       min_n=inputs.min_n, stats_min_prob=inputs.min_prob,
                       stats_min_expected=inputs.min_expected)


def _attention(cfg: DecodingConfig, lm: loader.LoadedModel) -> str:
    """Which invariant attention the run used (it changes the numbers: a repeated run must use the
    same), or the configuration's where the mode is off."""
    if not lm.invariant:
        return cfg.attention
    return "fused" if fused.enabled() else "torch"


def warm_up(lm: loader.LoadedModel) -> None:
    """Short runs so the first timed generation pays for no allocations or kernel set-up: plain
    steps, chain verification and a branching tree (its mask path), and the cost curve."""
    eos = next(iter(lm.eos_ids), 0)
    Decoder(lm.model, ()).generate([eos, eos], max_new_tokens=4)
    a, b, c, d = (min(t, lm.model.config.vocab_size - 1) for t in (100, 200, 300, 400))
    branching = Hierarchy([ContextDB(min_n=1)], policy="fill", max_candidates=4)  # 'a' was followed by b, c, d
    Decoder(lm.model, (), branching).generate([a, b, a, c, a, d, a], max_new_tokens=12)
    costs.curve_for(lm)


__all__ = ["DBs", "Status", "build_drafter", "cheap_verification", "db_hierarchy", "default_min_expected",
           "default_min_n", "default_min_prob", "drafter_for", "layer_inputs", "load_model_for", "make_drafter",
           "make_stack", "open_dbs", "open_stats_dbs", "registry", "resolved", "warm_up"]

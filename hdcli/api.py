"""The Python API the CLI is a thin layer over.

    from hdcli import api
    lm = api.load_model("smollm2-135m", dtype="fp32")
    res = api.generate(lm, "Summarise: ...", max_new_tokens=128)
    print(res.text, res.stats.mean_accepted)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .engine import costs, models
from .engine.decode import Decoder, Generation
from .drafting import ContextDB, Hierarchy, RecycledLayer, RecycledTable, StatsDB
from .errors import HdError
from .engine.prompts import TextStream, cut_at_stop, encode_messages, encode_prompt, stop_checker
from .engine.verify import Sampling

load_model = models.load

LAYER_NAMES = ("context", "recycle", "model", "stats")


def cheap_verification(lm: models.LoadedModel) -> bool:
    """Whether verification is nearly free with this model, dtype, kernels and machine
    (costs.CostCurve.verifies_cheaply on costs.curve_for: measured once, cached). The drafting
    defaults below follow this, not the dtype's name."""
    return costs.curve_for(lm).verifies_cheaply()


def default_min_n(cheap_verify: bool) -> int:
    """Shortest context-DB key. Where a verification forward costs ~1.65x one token, unigram
    matches are accepted too rarely to pay for it; where it costs ~1.1x, even unigram drafts pay
    (benchmarks/context_tuning.py)."""
    return 1 if cheap_verify else 2


def default_min_prob(cheap_verify: bool) -> float:
    """Where the statistics/model DB walk stops: the estimated probability of the whole draft."""
    return 0.1 if cheap_verify else 0.2


def default_min_expected(cheap_verify: bool) -> float:
    """Least expected accepted tokens for a DB draft to be worth a verification forward: ~1 where
    a forward over a draft costs ~1.65 plain steps, 0 where it costs about one. Both defaults come
    from replaying Spec-Bench outputs (benchmarks/stats_tuning.py, docs/stats-db.md); on packed fp32
    kernels the cheap defaults raised hd from 1.64x to 1.72x over plain (docs/benchmarks.md)."""
    return 0.0 if cheap_verify else 1.0


def open_stats_dbs(paths: Sequence[str], lm: models.LoadedModel | None = None,
                   writable: bool = False) -> list:
    """Open statistics or model DBs, refusing those built for another tokenizer. writable: for
    --learn (model DB)."""
    from .db.stores import Store
    dbs = []
    for p in paths:
        db = Store(p, writable=writable)
        if lm is not None:
            db.check_tokenizer(lm.tokenizer, lm.name)
        dbs.append(db)
    return dbs


SEED_RANGE = (0, 2 ** 64 - 1)  # what torch.Generator.manual_seed takes


def check_seed(seed: int | None) -> None:
    """A seed torch can take, or a one-line error naming --seed."""
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise HdError(f"--seed must be between 0 and 2**64 - 1, not {seed}")


def default_layers(stats_dbs: Sequence = (), model_db=None) -> list[str]:
    """The hierarchy run when no --layers is given, most local first: the context DB, the
    target's recycled predictions (free, +5-7% measured on Spec-Bench, docs/benchmarks.md), then
    the model DB and statistics DBs where given."""
    return ["context", "recycle"] + ["model"] * (model_db is not None) + ["stats"] * bool(stats_dbs)


DEFAULT_POLICY = "fill"  # measured: docs/benchmarks.md, "Token trees and policies"
DEFAULT_CANDIDATES = 4


def parse_draft_len(spec: str | int) -> int | dict[str, int]:
    """'16' -> 16; 'context=16,stats=8' -> {'context': 16, 'stats': 8}."""
    if isinstance(spec, int):
        return spec
    try:
        if "=" not in spec:
            return int(spec)
        out = {}
        for part in spec.split(","):
            name, _, n = part.partition("=")
            out[name.strip()] = int(n)
        return out
    except ValueError:
        raise HdError(f"--draft-len takes a number or layer=number pairs (context=16,stats=8), "
                      f"not {spec!r}") from None


def make_drafter(layers: Sequence[str] = ("context",), draft_len: int | dict[str, int] = 16,
                 min_n: int | None = None, max_n: int = 4, cheap_verify: bool = False,
                 stats_dbs: Sequence = (), stats_min_prob: float | None = None,
                 stats_min_expected: float | None = None, model_db=None,
                 policy: str = DEFAULT_POLICY, candidates: int = DEFAULT_CANDIDATES,
                 recycle_table: RecycledTable | None = None) -> Hierarchy | None:
    """The drafting hierarchy, most local layer first. An empty `layers` means plain decoding.

    draft_len: most tokens per candidate, one number or {layer: number}; shorter context-DB keys
    draft less (see ContextDB). `stats` stands for every DB in stats_dbs, in the order given;
    `model` for model_db; both draft with the same walk, min_prob and min_expected. cheap_verify
    (see cheap_verification) picks the defaults of min_n, min_prob and min_expected. policy and
    candidates (C): see drafting.Hierarchy; candidates 1 verifies one chain. `recycle` drafts
    from the target's own predictions in earlier forwards (drafting.RecycledTable): pass one
    recycle_table to share them across the drafters of a run, or a new one is made."""
    min_n = default_min_n(cheap_verify) if min_n is None else min_n
    min_prob = default_min_prob(cheap_verify) if stats_min_prob is None else stats_min_prob
    min_expected = default_min_expected(cheap_verify) if stats_min_expected is None else stats_min_expected
    lens = draft_len.items() if isinstance(draft_len, dict) else [(None, draft_len)]
    for name, n in lens:
        if n < 1:
            where = f" for every layer, not {name}={n}" if name else f", not {n}"
            raise HdError("--draft-len must be >= 1" + where)
    if isinstance(draft_len, dict):
        unknown = [k for k in draft_len if k.split(":")[0] not in LAYER_NAMES]
        if unknown:
            raise HdError(f"--draft-len names unknown layer '{unknown[0]}'; known layers: {', '.join(LAYER_NAMES)}")
    if policy not in Hierarchy.POLICIES:
        raise HdError(f"unknown --policy '{policy}'; known: {', '.join(Hierarchy.POLICIES)}")
    if candidates < 1:
        raise HdError(f"--candidates must be >= 1, not {candidates}")
    if not 1 <= min_n <= max_n:
        raise HdError(f"n-gram sizes need 1 <= --min-n <= --max-n, got {min_n}..{max_n}")
    built = []
    for name in layers:
        if name == "context":
            built.append(ContextDB(min_n=min_n, max_n=max_n))
        elif name == "recycle":
            built.append(RecycledLayer(recycle_table))
        elif name == "model":
            if model_db is None:
                raise HdError("layer 'model' needs a model DB: pass --model-db PATH")
            built.append(StatsDB(model_db, name="model", min_prob=min_prob, min_expected=min_expected))
        elif name == "stats":
            if not stats_dbs:
                raise HdError("layer 'stats' needs a statistics DB: pass --stats-db PATH")
            for db in stats_dbs:
                label = "stats" if len(stats_dbs) == 1 else f"stats:{db.path.stem}"
                built.append(StatsDB(db, name=label, min_prob=min_prob, min_expected=min_expected))
        else:
            raise HdError(f"unknown drafting layer '{name}'; known layers: {', '.join(LAYER_NAMES)}")
    return Hierarchy(built, policy=policy, draft_len=draft_len, max_candidates=candidates) if built else None


def learn(model_db, prompt_ids: Sequence[int], tokens: Sequence[int]) -> int:
    """Add the n-grams of a generation to the model DB (keys may start in the prompt's last
    tokens, continuations are generated tokens only). Returns keys touched."""
    from .db.statsdb import add_counts
    max_n = int(model_db.header["n_range"][1])
    context = list(prompt_ids[-max_n:]) if prompt_ids else []
    doc = context + list(tokens)
    # counting starts where a continuation is generated: drop keys that end before the output
    return add_counts(model_db, [doc], first_end=len(context) - 1)


@dataclass
class Result:
    text: str
    tokens: list[int]
    layers: list[str | None]
    stop_reason: str
    stats: object  # RunStats
    prompt_ids: list[int]

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "stop_reason": self.stop_reason,
                "stats": self.stats.to_dict()}


def generate(lm: models.LoadedModel, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
             max_new_tokens: int = 256, sampling: Sampling = Sampling(), seed: int | None = None,
             chat: bool = True, system: str | None = None, stop: Sequence[str] = (),
             drafter: Hierarchy | None | str = "default",
             on_text: Callable[[str, str | None], None] | None = None,
             cost: costs.CostCurve | None = None) -> Result:
    """Generate a completion. drafter: a Hierarchy, None for plain decoding, "default" for the
    context DB and recycled predictions with default settings. cost: the forward-cost curve that caps draft trees (default:
    measured once for this model and machine, see costs.curve_for). Greedy output equals plain
    greedy decoding token for token whatever the drafts."""
    if max_new_tokens < 1:
        raise HdError(f"--max-new-tokens must be >= 1, not {max_new_tokens}")
    check_seed(seed)
    if prompt_ids is None:
        prompt_ids = encode_prompt(lm.tokenizer, prompt or "", chat=chat, system=system)
    room = lm.max_context - len(prompt_ids)
    if room < 1:
        raise HdError(f"the prompt is {len(prompt_ids)} tokens but the model's context is "
                      f"{lm.max_context}: shorten the prompt")
    if drafter == "default":
        drafter = make_drafter(default_layers(), cheap_verify=cheap_verification(lm))
    if drafter and cost is None:
        cost = costs.curve_for(lm)
    decoder = Decoder(lm.model, lm.eos_ids, drafter, cost=cost)
    stream = TextStream(lm.tokenizer, on_text) if on_text else None
    g: Generation = decoder.generate(prompt_ids, min(max_new_tokens, room), sampling, seed,
                                     stop_check=stop_checker(lm.tokenizer, stop), on_tokens=stream)
    text = cut_at_stop(lm.tokenizer.decode(g.tokens, skip_special_tokens=True), stop)
    return Result(text=text, tokens=g.tokens, layers=g.layers, stop_reason=g.stop_reason,
                  stats=g.stats, prompt_ids=list(prompt_ids))


def stock_model(lm: models.LoadedModel) -> models.LoadedModel:
    """The same model with torch's own kernels, as transformers ships it: lm itself where it
    already is, else loaded once more (from the converted-weights cache, ~1-2 s)."""
    if lm.kernels == "torch":
        return lm
    return load_model(lm.name, dtype=lm.dtype, device=lm.device, kernels="torch", quiet=True)


def hf_generate(lm: models.LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                sampling: Sampling = Sampling(), seed: int | None = None,
                prompt_lookup: int | None = None) -> tuple[list[int], float]:
    """transformers' own generate() on lm (greedy, or sampling with the same settings), with its
    prompt lookup decoding when prompt_lookup is given: the baselines users have. Returns (new
    tokens, wall seconds, prefill included)."""
    import time
    import torch
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(lm.eos_ids) or None,
                  pad_token_id=lm.tokenizer.pad_token_id or (sorted(lm.eos_ids) or [0])[0])
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None)
        torch.manual_seed(seed or 0)
    ids = torch.tensor([list(prompt_ids)], device=next(lm.model.parameters()).device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ (or where the shorter ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def warm_up(lm: models.LoadedModel) -> None:
    """Short runs so the first timed generation pays for no allocations or kernel set-up: plain
    steps, chain verification and a branching tree (its mask path), and the cost curve."""
    eos = next(iter(lm.eos_ids), 0)
    Decoder(lm.model, ()).generate([eos, eos], max_new_tokens=4)
    a, b, c, d = (min(t, lm.model.config.vocab_size - 1) for t in (100, 200, 300, 400))
    branching = make_drafter(min_n=1, policy="fill", candidates=4)  # 'a' was followed by b, c, d
    Decoder(lm.model, (), branching).generate([a, b, a, c, a, d, a], max_new_tokens=12)
    costs.curve_for(lm)


def cost_report(model: str = models.DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
                kernels: str = "auto", remeasure: bool = False, quiet: bool = False) -> dict:
    """What `hd costs` shows: the forward-cost curve of each kernel set `kernels` allows for this
    model on this machine (cached, or measured now; all measured again with remeasure) and which
    set `auto` keeps."""
    import torch
    from .engine import kernels as kern
    dev = models.resolve_device(device)
    dt = models.resolve_dtype(dtype, dev)
    kn = kern.resolve(kernels, dev, dt)
    if remeasure:
        source = models.resolve(model)[1]
        for k in ("torch", "onednn"):
            costs.forget(costs.curve_key(source, dt, dev, k))
    lm = load_model(model, dtype=dt, device=dev, kernels=kernels, quiet=quiet)
    if kn == "measure":
        choice = lm.info["kernel_choice"]
        curves = {k: costs.cached_curve(costs.curve_key(lm.source, dt, dev, k), None,
                                        measure_missing=False) for k in ("torch", "onednn")}
    else:
        choice = None
        curves = {lm.kernels: costs.curve_for(lm, quiet=quiet)}
    out = {"model": lm.name, "source": lm.source, "dtype": dt, "device": dev, "cpu": costs.cpu_name(),
           "threads": torch.get_num_threads(), "kernels": lm.kernels, "choice": choice, "curves": {}}
    for k, c in curves.items():
        if c is None:
            continue
        out["curves"][k] = {"one_token_ms": None if c.one_token_seconds is None else 1e3 * c.one_token_seconds,
                            "cost": c.to_dict(), "verifies_cheaply": c.verifies_cheaply(),
                            "measured_at": c.info.get("measured_at"),
                            "plausible": c.info.get("plausible", True)}
    return out


DEFAULT_LEVEL_TOKENS = 4


def draft_model_names(draft_models: str | Sequence[str]) -> list[str]:
    """'a, b' or ['a', 'b'] -> ['a', 'b'], refusing an empty list (before any model loads)."""
    parts = draft_models.split(",") if isinstance(draft_models, str) else draft_models
    names = [n.strip() for n in parts if n.strip()]
    if not names:
        raise HdError("--draft-models is empty: name at least one draft model (e.g. self:layers=8)")
    return names


def make_stack(lm: models.LoadedModel, draft_models: Sequence[str], level_tokens: Sequence[int] = (),
               base: Hierarchy | None = None, sampling: Sampling = Sampling(), seed: int = 0,
               loaded: dict | None = None):
    """A hierarchy of draft models (smallest first) over the database hierarchy `base` (None:
    the smallest model drafts alone). level_tokens: T_i per model level, the tokens a level holds
    before it returns its batch (default DEFAULT_LEVEL_TOKENS each). loaded: name -> DraftModel
    cache, so repeated stacks share their draft models."""
    from .hsd import draft_models as draftmodels
    from .hsd.stack import ModelStack
    names = draft_model_names(draft_models)
    Ts = list(level_tokens) or [DEFAULT_LEVEL_TOKENS] * len(names)
    if len(Ts) != len(names):
        raise HdError(f"--level-tokens gives {len(Ts)} sizes for {len(names)} draft models")
    if any(t < 1 for t in Ts):
        raise HdError(f"--level-tokens must all be >= 1, not {Ts}")
    loaded = {} if loaded is None else loaded
    levels = []
    for name, T in zip(names, Ts):
        if name not in loaded:
            loaded[name] = draftmodels.load(name, lm)
        levels.append((name, loaded[name].model, T))
    return ModelStack(levels, base, sampling, seed)


def read_plan_file(path) -> dict:
    """The whole document saved by `hd plan --out`, checked to hold a chain."""
    import json
    from pathlib import Path
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        chain = data["chain"]
        chain["bottom"], [(lv["model"], int(lv["T"])) for lv in chain["levels"]]
    except FileNotFoundError:
        raise HdError(f"plan {path} not found: make one with `hd plan --out {path}`") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise HdError(f"{path} is not a plan written by `hd plan`") from None
    return data


def plan_dbs(plan_path, data: dict, stats_dbs: list, model_db) -> tuple[list, object]:
    """The DBs a run with this plan drafts from: the plan's own when none are given; the given
    ones only when they are the plan's (a plan measured with a statistics DB and run without it
    would draft less than it predicted)."""
    import os
    from pathlib import Path
    planned_stats = [Path(p) for p in data.get("stats_dbs", [])]
    planned_model = Path(data["model_db"]) if data.get("model_db") else None
    if not stats_dbs and model_db is None:
        return planned_stats, planned_model
    same = lambda a, b: (a is None) == (b is None) and (a is None or os.path.realpath(a) == os.path.realpath(b))
    if (len(stats_dbs) != len(planned_stats) or not all(map(same, stats_dbs, planned_stats))
            or not same(model_db, planned_model)):
        planned = [str(p) for p in planned_stats] + ([f"model DB {planned_model}"] if planned_model else [])
        raise HdError(f"plan {plan_path} was measured with {', '.join(planned) or 'no DB'}: pass the same "
                      "--stats-db/--model-db (or none, to use the plan's), or run `hd plan` again")
    return list(stats_dbs), model_db


def read_plan(path, lm: models.LoadedModel | None = None) -> dict:
    """The chain saved by `hd plan` ({"bottom": "none"|"db", "levels": [{"model", "T"}]})."""
    data = read_plan_file(path)
    chain = data["chain"]
    if lm is not None and (data.get("target") != lm.name or data.get("dtype") != lm.dtype):
        raise HdError(f"plan {path} was made for {data.get('target')} in {data.get('dtype')}, not "
                      f"{lm.name} in {lm.dtype}: costs and acceptance differ, run `hd plan` again")
    return chain


def build_stats(corpus: Sequence[str], out, model: str = models.DEFAULT_MODEL, *, field: str = "text",
                with_prompt: bool = False, limit: int | None = None, shard: tuple[int, int] = (0, 1),
                strict: bool = False, num_proc: int = 1, chunk_tokens: int = 4_000_000,
                overwrite: bool = False, progress=None, **params) -> tuple[dict, dict]:
    """Count a corpus into a statistics DB at `out` in this process (what `hd build-stats` and
    each task of a cluster build run). params: min_n, max_n, draft_len, top_k, min_count.
    Returns (header, read report: skipped and replaced counts, the first malformed record)."""
    from .db import corpus as corpus_mod, statsdb
    texts, report = corpus_mod.read_corpus(list(corpus), field=field, with_prompt=with_prompt,
                                           limit=limit, shard=shard, strict=strict)
    tok = models.load_tokenizer(model)
    try:
        header = statsdb.build(texts, out, tok, model, shard=shard, chunk_tokens=chunk_tokens,
                               num_proc=num_proc, overwrite=overwrite, progress=progress,
                               extra_header={"sources": report.files, "field": field,
                                             "with_prompt": with_prompt}, **params)
    except HdError as exc:
        if "no documents" in str(exc):  # name what was read and what was skipped
            raise corpus_mod.no_documents(report.files, corpus, field, report.counts()) from None
        raise
    return header, report.counts()

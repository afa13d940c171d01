"""The expected latency of a drafting hierarchy, and the latency-optimal one (`hd plan`).

The model (docs/planner.md derives it). A hierarchy is a chain: a bottom (`none`: nothing, the
lowest model drafts alone; or `db`: the database hierarchy), then draft models, then the target.
Each model level i has a batch size T_i. Per-token acceptance between levels is i.i.d.: a token
of level j survives level i's verification with probability a[j, i] (its parent surviving).

  bottom   `none` hands up B = 0 tokens at no cost; `db` hands up B ~ its measured proposal-length
           distribution for its measured time per call.
  level i  repeats rounds: the level below produces a batch (B_j tokens, time tau_j), level i
           verifies it in one forward of cost c_i(B_j + 1) and keeps X = min(G, B_j) + 1 tokens,
           G geometric: P(G >= g) = a^g. It stops once it holds >= T_i tokens and hands up
           exactly T_i (the rest is dropped), so the level above always sees B_i = T_i.
           By Wald's identity tau_i = E[N] * (tau_j + E[c_i(B_j + 1)]), N the number of rounds,
           computed exactly by a recursion over the tokens held so far.
  target   one round per decode step: tokens/s = E[X] / (tau_top + E[c_t(B_top + 1)]).

With one draft model drafting alone (bottom `none`, T tokens) and a target whose forward costs
the same for any width, this is the classic single-draft formula: tokens per target-step time
(1 - a^(T+1)) / ((1 - a) (T c + 1)).

Since a level above sees only T_i, the cheapest way to make level i produce T_i tokens does not
depend on what is above: the dynamic programme over (level, T) is exact
(tests/test_plan.py checks it against brute force over every chain and every T_i, and the formula
against a Monte-Carlo run of the same process).
"""
from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .. import inputs
from ..errors import HdError
from ..engine.decode import costs
from ..engine.decode.loop import Decoder
from ..engine.decode.verify import Sampling
from ..engine.decode.verify import target_probs

Cost = Callable[[int], float]  # seconds of one forward over w tokens


@dataclass
class Params:
    """What the planner knows about the levels it may use.

    models      names of the draft models, smallest (cheapest) first
    cost        name -> seconds of a forward over w tokens, for every model and "target"
    accept      (lower, upper) -> per-token acceptance; lower in {"none", "db", models}, upper in
                models or "target" ("none" needs no entry)
    db_lengths  P(db proposes b tokens), b = 0..len-1 (empty: no database level available)
    db_seconds  time of one database proposal
    """
    models: list[str]
    cost: dict[str, Cost]
    accept: dict[tuple[str, str], float]
    db_lengths: list[float] = field(default_factory=list)
    db_seconds: float = 0.0


@dataclass(frozen=True)
class Chain:
    bottom: str                      # "none" | "db"
    levels: tuple[tuple[str, int], ...]  # (model, T) from the smallest up

    def describe(self) -> str:
        parts = ([] if self.bottom == "none" else ["db"]) + [f"{m}(T={t})" for m, t in self.levels]
        return " -> ".join(parts + ["target"]) if parts else "target alone (plain decoding)"

    def to_dict(self) -> dict:
        return {"bottom": self.bottom, "levels": [{"model": m, "T": t} for m, t in self.levels]}


def x_dist(a: float, b_dist: Sequence[float]) -> list[float]:
    """P(X = x), X = min(G, B) + 1 tokens kept in a round (x = 0 has probability 0)."""
    out = [0.0] * (len(b_dist) + 1)
    for b, pb in enumerate(b_dist):
        if pb == 0.0:
            continue
        for g in range(b):  # G = g < b: g accepted, then a correction
            out[g + 1] += pb * (a ** g) * (1 - a)
        out[b + 1] += pb * (a ** b)  # the whole batch accepted, then a bonus token
    return out


def expected_rounds(T: int, xd: Sequence[float]) -> float:
    """E[number of rounds until the tokens held reach >= T], rounds i.i.d. with P(X=x) = xd[x]."""
    reach = [0.0] * T  # P(the held count ever equals s), s < T
    reach[0] = 1.0
    for s in range(T):
        for x in range(1, len(xd)):
            if s + x < T:
                reach[s + x] += reach[s] * xd[x]
    return sum(reach)


def point(n: int) -> list[float]:
    return [0.0] * n + [1.0]


def level_time(lower: tuple[list[float], float, str], model: str, T: int, p: Params) -> float:
    """tau of `model` making T tokens over a lower level (B distribution, tau, name)."""
    b_dist, tau, name = lower
    xd = x_dist(p.accept.get((name, model), 0.0), b_dist)
    round_cost = tau + sum(pb * p.cost[model](b + 1) for b, pb in enumerate(b_dist))
    return expected_rounds(T, xd) * round_cost


def bottom(name: str, p: Params) -> tuple[list[float], float, str]:
    if name == "none":
        return point(0), 0.0, "none"
    return list(p.db_lengths), p.db_seconds, "db"


def tokens_per_second(chain: Chain, p: Params) -> float:
    if chain.bottom == "none" and not chain.levels:
        return 1.0 / p.cost["target"](1)
    lower = bottom(chain.bottom, p)
    for model, T in chain.levels:
        lower = (point(T), level_time(lower, model, T, p), model)
    b_dist, tau, name = lower
    xd = x_dist(p.accept.get((name, "target"), 0.0), b_dist)
    ex = sum(x * px for x, px in enumerate(xd))
    return ex / (tau + sum(pb * p.cost["target"](b + 1) for b, pb in enumerate(b_dist)))


def candidates(p: Params, t_max: int):
    """Every chain and every T vector (brute force)."""
    bottoms = ["none"] + (["db"] if p.db_lengths else [])
    yield Chain("none", ())
    if p.db_lengths:
        yield Chain("db", ())
    for r in range(1, len(p.models) + 1):
        for subset in itertools.combinations(p.models, r):
            for b in bottoms:
                for Ts in itertools.product(range(1, t_max + 1), repeat=r):
                    yield Chain(b, tuple(zip(subset, Ts)))


def brute_force(p: Params, t_max: int) -> tuple[Chain, float]:
    return max(((c, tokens_per_second(c, p)) for c in candidates(p, t_max)), key=lambda x: x[1])


def dp(p: Params, t_max: int) -> tuple[Chain, float]:
    """best[(model, T)] = the cheapest chain below `model` making it produce T tokens.
    O(models^2 * t_max^2) level evaluations."""
    best: dict[tuple[str, int], tuple[float, Chain]] = {}
    bottoms = ["none"] + (["db"] if p.db_lengths else [])
    for i, model in enumerate(p.models):
        for T in range(1, t_max + 1):
            options = []
            for b in bottoms:
                options.append((level_time(bottom(b, p), model, T, p), Chain(b, ((model, T),))))
            for lower_model in p.models[:i]:
                for Tj in range(1, t_max + 1):
                    tau_j, chain_j = best[(lower_model, Tj)]
                    tau = level_time((point(Tj), tau_j, lower_model), model, T, p)
                    options.append((tau, Chain(chain_j.bottom, chain_j.levels + ((model, T),))))
            best[(model, T)] = min(options, key=lambda o: o[0])
    tops = [Chain("none", ())] + ([Chain("db", ())] if p.db_lengths else [])
    tops += [chain for _, chain in best.values()]
    scored = [(c, tokens_per_second(c, p)) for c in tops]
    return max(scored, key=lambda x: x[1])


def ranked(p: Params, t_max: int) -> list[tuple[Chain, float]]:
    """The best T vector of every chain of levels (for the table `hd plan` prints), best first."""
    by_shape: dict[tuple, tuple[Chain, float]] = {}
    for c in candidates(p, t_max):
        key = (c.bottom, tuple(m for m, _ in c.levels))
        v = tokens_per_second(c, p)
        if key not in by_shape or v > by_shape[key][1]:
            by_shape[key] = (c, v)
    return sorted(by_shape.values(), key=lambda x: -x[1])


def simulate(chain: Chain, p: Params, steps: int, seed: int = 0) -> float:
    """Monte-Carlo run of the same process (Bernoulli acceptances, DB lengths drawn from their
    distribution, deterministic costs): target tokens per second."""
    rng = random.Random(seed)

    def produce(level: int) -> tuple[int, float]:
        """(tokens handed up, seconds spent) by chain level `level` (-1: the bottom)."""
        if level < 0:
            if chain.bottom == "none":
                return 0, 0.0
            u, acc = rng.random(), 0.0
            for b, pb in enumerate(p.db_lengths):
                acc += pb
                if u < acc:
                    return b, p.db_seconds
            return len(p.db_lengths) - 1, p.db_seconds
        model, T = chain.levels[level]
        lower_name = chain.levels[level - 1][0] if level > 0 else chain.bottom
        a = p.accept.get((lower_name, model), 0.0)
        held, spent = 0, 0.0
        while held < T:
            b, t = produce(level - 1)
            spent += t + p.cost[model](b + 1)
            g = 0
            while g < b and rng.random() < a:
                g += 1
            held += g + 1
        return T, spent

    tokens = seconds = 0.0
    top_name = chain.levels[-1][0] if chain.levels else chain.bottom
    a = p.accept.get((top_name, "target"), 0.0)
    for _ in range(steps):
        b, t = produce(len(chain.levels) - 1)
        seconds += t + p.cost["target"](b + 1)
        g = 0
        while g < b and rng.random() < a:
            g += 1
        tokens += g + 1
    return tokens / seconds


# ---------------------------------------------------------------------------------------------
# Measuring the parameters on a calibration set (hd plan)

def measure(lm, drafts, db_factory, prompts: Sequence[list[int]], tokens: int = 64,
            sampling=None, t_max: int = 16, progress=None) -> tuple[Params, dict]:
    """Params of the levels on this machine: forward costs by width, acceptance between every
    pair of levels, and the database level's proposal lengths and time.

    drafts: hsd.draft_models.DraftModel list (smallest first); db_factory: () -> Hierarchy or
    None. Acceptance is read on the target's own greedy continuations of the prompts: between
    models, from both models' distributions at the same positions (greedy: the argmaxes agree;
    sampling: sum_x min(p, q), the chance the standard rule keeps a draw); for the database, the
    chance the level keeps its proposed token (greedy: it is the argmax; sampling: p(token))."""
    import torch

    s = sampling or Sampling()
    names = [d.name for d in drafts]
    model_of = {d.name: d.model for d in drafts}
    model_of["target"] = lm.model
    widths = tuple(sorted(set(w for w in costs.WIDTHS if w <= t_max + 1) | {t_max + 1}))
    cost = {}
    for name, m in model_of.items():
        curve = costs.measure(m, widths=widths)
        cost[name] = (lambda c: (lambda w: c.one_token_seconds * c(w)))(curve)
        if progress:
            progress(f"cost of {name}: {curve.one_token_seconds * 1000:.1f} ms per token")
    refs = [Decoder(lm.model, ()).generate(p, max_new_tokens=tokens).tokens for p in prompts]
    dists = {name: _predictions(m, prompts, refs, s) for name, m in model_of.items()}
    uppers = names + ["target"]
    accept: dict[tuple[str, str], float] = {}
    for i, lo in enumerate(names):
        for up in uppers[i + 1:]:
            vals = [(a == b).float().mean() if s.greedy else torch.minimum(a, b).sum(-1).mean()
                    for a, b in zip(dists[lo], dists[up])]
            accept[(lo, up)] = float(sum(vals) / len(vals))
    db_lengths, db_seconds = [], 0.0
    if db_factory is not None:
        db_lengths, db_seconds, db_accept = _db_level(db_factory(), prompts, refs, dists, uppers, s)
        accept.update({("db", u): v for u, v in db_accept.items()})
    info = {"references": len(refs), "reference_tokens": sum(len(r) for r in refs),
            "one_token_seconds": {k: cost[k](1) for k in cost}, "accept": {f"{a}->{b}": v for (a, b), v in accept.items()},
            "db_lengths": db_lengths, "db_seconds": db_seconds}
    return Params(models=names, cost=cost, accept=accept, db_lengths=db_lengths, db_seconds=db_seconds), info


def _predictions(model, prompts, refs, s) -> list:
    """Per prompt, the model's prediction for each reference token: argmaxes (greedy) or
    distributions [len(ref), V] (sampling), from one forward over prompt + reference."""
    import torch

    rows = []
    with torch.inference_mode():
        for p, ref in zip(prompts, refs):
            ids = torch.tensor([list(p) + ref[:-1]], device=model.device)
            logits = model.forward(ids)[len(p) - 1:].float()
            rows.append(logits.argmax(-1) if s.greedy else target_probs(logits, s))
    return rows


def _db_level(hier, prompts, refs, dists, uppers, s) -> tuple[list[float], float, dict[str, float]]:
    """The database level along the references: P(it proposes b tokens), its seconds per call,
    and per upper level the chance a proposed token is kept (read where the models' predictions
    are known: along the reference)."""
    import time
    counts: dict[int, int] = {}
    tested = {u: 0 for u in uppers}
    kept = {u: 0.0 for u in uppers}
    calls, spent = 0, 0.0
    for pi, (p, ref) in enumerate(zip(prompts, refs)):
        hist = list(p)
        hier.reset(hist)
        for t in range(len(ref) - 1):
            t0 = time.perf_counter()
            drafts = hier.propose(hist, len(ref) - t - 1)
            spent += time.perf_counter() - t0
            calls += 1
            d = list(drafts[0].tokens) if drafts else []
            counts[len(d)] = counts.get(len(d), 0) + 1
            for k, x in enumerate(d):
                if t + k >= len(ref) or (k and d[k - 1] != ref[t + k - 1]):
                    break  # the models' predictions are known along the reference only
                for u in uppers:
                    row = dists[u][pi][t + k]
                    tested[u] += 1
                    kept[u] += float(row == x) if s.greedy else float(row[x])
            hist.append(ref[t])
            hier.extend([ref[t]])
    n = max(counts) + 1 if counts else 1
    lengths = [counts.get(b, 0) / calls for b in range(n)] if calls else [1.0]
    return lengths, spent / max(1, calls), {u: kept[u] / tested[u] if tested[u] else 0.0 for u in uppers}


# ---------------------------------------------------------------------------------------------
# Ranking and measuring for `hd plan` (commands/plan.plan runs them)

def ranked_rows(p: Params, t_max: int, best_v: float) -> list[dict]:
    """Every chain with its predicted speed, fastest first, as the rows `hd plan` reports."""
    table = ranked(p, t_max)
    assert abs(best_v - table[0][1]) < 1e-9 * max(1.0, best_v), "DP and enumeration disagree"
    return [{"hierarchy": c.describe(), "chain": c.to_dict(), "predicted_tokens_per_second": v,
             "predicted_speedup": v * p.cost["target"](1)} for c, v in table]


def rows_to_measure(rows: list[dict], top: int) -> list[dict]:
    """The best `top` rows, plus the references: the best single drafting level and plain
    decoding (marks the single level's row with single_level)."""
    single = [r for r in rows if len(r["chain"]["levels"]) + (r["chain"]["bottom"] == "db") == 1]
    plain = [r for r in rows if not r["chain"]["levels"] and r["chain"]["bottom"] == "none"]
    for r in rows:
        r["single_level"] = r in single[:1]
    out = []
    for r in rows[:top] + single[:1] + plain:
        if r not in out:
            out.append(r)
    return out


def measured_speed(lm, drafter, prompts: Sequence[list[int]], max_new_tokens: int) -> float:
    """Tokens per second of the target with this drafter over the prompts (greedy)."""
    toks = secs = 0.0
    for p in prompts:
        g = Decoder(lm.model, lm.eos_ids, drafter).generate(p, max_new_tokens=max_new_tokens)
        toks += g.stats.new_tokens
        secs += g.stats.wall_seconds
    return toks / secs


# ---------------------------------------------------------------------------------------------
# Plan files (`hd plan --out`, read by `hd generate --plan` and DecodingConfig.with_plan)

def read_plan_file(path) -> dict:
    """The whole document saved by `hd plan --out`, checked (check_plan)."""
    if inputs.kind_of(path) == "missing":
        raise HdError(f"plan {path} not found: make one with `hd plan --out {path}`")
    text = inputs.read_text(path, "--plan", inputs.DOCUMENT_BYTES, "a plan is the JSON file `hd plan --out` wrote")
    try:
        data = json.loads(text)
    except ValueError:
        raise HdError(f"{path} is not a plan written by `hd plan`") from None
    return check_plan(path, data)


def check_plan(path, data) -> dict:
    """data, the document read from the plan file at path, checked to hold a chain, its target,
    dtype and kernels strings."""
    try:
        chain = data["chain"]
        chain["bottom"], [(lv["model"], int(lv["T"])) for lv in chain["levels"]]
    except (ValueError, KeyError, TypeError):
        raise HdError(f"{path} is not a plan written by `hd plan`") from None
    bad = [k for k in ("target", "dtype", "kernels") if data.get(k) is not None and not isinstance(data[k], str)]
    if bad:   # read as if the user had typed them: named as the plan's, not as an option
        raise HdError(f"plan {path}: field '{bad[0]}' must be a string, not {json.dumps(data[bad[0]])}; "
                      "run `hd plan` again")
    return data


def plan_dbs(plan_path, data: dict, stats_dbs: list, model_db) -> tuple[list, object]:
    """The DBs a run with this plan drafts from: the plan's own when none are given; the given
    ones only when they are the plan's (a plan measured with a statistics DB and run without it
    would draft less than it predicted)."""
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


def check_made_for(path, data: dict, lm) -> None:
    """Refuse a plan (its document, read_plan_file's) made for another target or dtype than lm."""
    if data.get("target") != lm.name or data.get("dtype") != lm.dtype:
        raise HdError(f"plan {path} was made for {data.get('target')} in {data.get('dtype')}, not "
                      f"{lm.name} in {lm.dtype}: costs and acceptance differ, run `hd plan` again")

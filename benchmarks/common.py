"""What the benchmark scripts share: the machine they ran on, the Spec-Bench questions they pick,
interleaved timing of several methods, and the model-free replay of drafters.

Timing. Methods run one after another on each item (A B C, A B C, ...), so drift of the machine
hits all of them alike (`interleaved`); a method's tokens/s is the mean (or median) over items and
its speedup that over the base method's (`speedups`, `summarize`: Spec-Bench's definition, ratio
of means). Every JSON with timings carries `machine()`.

Replay. Under greedy decoding the tokens a draft gets accepted are exactly its common prefix with
the plain output at that point (for a tree: the path that matches it), so a drafter can be scored
without running the model again: record the plain outputs once (fp32, exact: `record`), measure
the target's forward cost by number of input tokens once (`forward_costs`, or a measured
costs.CostCurve), then replay any drafter setting in milliseconds (`replay`, with the decoder's
own tree builder and cost cap, hdcli.engine.decode.tree.build_tree). Used by the tunings in tuning/
(context_tuning.py, stats_tuning.py, tree_tuning.py, match_length.py, hierarchy_replay.py).

Scripts run as `python benchmarks/NAME.py`, so `from common import ...` finds this file; those in
tuning/ (one-off tunings, their results recorded in the docs) put this folder on sys.path first.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from hdcli.engine import records
from hdcli.engine.decode.tree import build_tree, reached


# ---------------------------------------------------------------- results

def command_line(script: str, args) -> str:
    """The command that reproduces a run from its parsed arguments, as recorded in its JSON:
    unset (None, False, empty list) options left out, a True flag alone, a list's values spaced."""
    parts = [f"python benchmarks/{script}"]
    for k, v in vars(args).items():
        if v is None or v is False or v == []:
            continue
        flag = f"--{k.replace('_', '-')}"
        parts.append(flag if v is True else f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(parts)


def write_result(path: Path | None, doc: dict) -> None:
    """A run's JSON document at `path` (its folder made), where one was asked for."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")


# ---------------------------------------------------------------- machine

def machine() -> dict:
    """What the timings depend on: CPU model (lscpu's 'Model name'), cores, torch threads, versions."""
    import transformers
    return {"cpu": records.cpu_name(), "arch": platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


# ---------------------------------------------------------------- Spec-Bench questions

def load_questions(data: str | Path | None = None) -> list[dict]:
    """Every question of the Spec-Bench file (--data path, or found under . or ../shared), in file
    order, as specbench.load gives them: `category` mapped (mt_bench), `subcategory` as in the file."""
    # imported here, not at the top: gpu_check.py needs only machine() and runs where the DB
    # stack's packages (lmdb, datasets) are not installed
    from hdcli.bench import specbench
    return specbench.load(specbench.find(data))


def first_per_subcategory(questions: list[dict], n: int) -> list[dict]:
    """The first n questions of each category as the file names them (the 13 of Spec-Bench:
    MT-Bench's eight sub-categories count apart), in file order."""
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q["subcategory"], 0) < n:
            seen[q["subcategory"]] = seen.get(q["subcategory"], 0) + 1
            out.append(q)
    return out


def requests_from(questions: list[dict], count: int) -> list[dict]:
    """`count` questions for a serving benchmark: the first of each of the 13 subcategories in file
    order, then the second of each, and so on (the first 13 are first_per_subcategory's)."""
    order = list(dict.fromkeys(q["subcategory"] for q in questions))
    return round_robin(questions, count, key="subcategory", order=order)


def round_robin(questions: list[dict], count: int, key: str = "category",
                order: Iterable[str] | None = None) -> list[dict]:
    """`count` questions (or all there are) taken one group at a time, groups by `key` in `order`
    (default: sorted names): the first of every group, then the second, ...; each group keeps the
    order of `questions`."""
    groups: dict[str, list[dict]] = {}
    for q in questions:
        groups.setdefault(q[key], []).append(q)
    names = [g for g in (order if order is not None else sorted(groups)) if g in groups]
    out, i = [], 0
    while len(out) < count and any(i < len(groups[g]) for g in names):
        for g in names:
            if i < len(groups[g]) and len(out) < count:
                out.append(groups[g][i])
        i += 1
    return out


# ---------------------------------------------------------------- interleaved timing

def interleaved(items: Iterable, methods: dict[str, Callable], on_item: Callable | None = None) -> dict[str, list]:
    """Run every method on each item in turn (A B C, A B C, ...), so drift of the machine hits all
    methods alike. methods: name -> callable(item) -> result. on_item(n, item, {name: result}) is
    called after the n-th item (progress, per-item rows). Returns name -> results in item order."""
    runs: dict[str, list] = {name: [] for name in methods}
    for n, item in enumerate(items, 1):
        got = {}
        for name, run in methods.items():
            got[name] = run(item)
            runs[name].append(got[name])
        if on_item is not None:
            on_item(n, item, got)
    return runs


def speedups(tps: dict[str, list[float]], base: str = "plain",
             average: Callable = statistics.mean) -> dict[str, dict]:
    """name -> {tokens_per_second: average of its tokens/s, speedup: that / the base's average}."""
    ref = average(tps[base])
    return {m: {"tokens_per_second": average(v), "speedup": average(v) / ref} for m, v in tps.items()}


def summarize(runs: dict, base: str = "plain", echo: bool = True) -> dict:
    """runs: method -> list of results with .tokens and .stats (api.Result, decode.Generation), one
    per question, `base` (plain decoding) among them. Returns Spec-Bench's figures: speedup = mean
    tokens/s / mean base tokens/s, mean accepted tokens pooled over all steps, per-layer totals, and
    outputs differing from the base; prints a line per method unless echo is False."""
    rates = speedups({m: [r.stats.tokens_per_second for r in rs] for m, rs in runs.items()}, base)
    out = {}
    for m, rs in runs.items():
        layers = {}
        for r in rs:
            for name, ls in r.stats.layers.items():
                agg = layers.setdefault(name, {"queries": 0, "hits": 0, "drafted": 0, "accepted": 0})
                for f in agg:
                    agg[f] += getattr(ls, f)
        for v in layers.values():
            v["hit_rate"] = v["hits"] / max(1, v["queries"])
            v["acceptance_rate"] = v["accepted"] / max(1, v["drafted"])
        steps = [a for r in rs for a in r.stats.accept_lengths]
        out[m] = {**rates[m], "mean_accepted_tokens": sum(steps) / len(steps),
                  "differ_from_plain": sum(r.tokens != p.tokens for r, p in zip(rs, runs[base])),
                  "layers": layers}
        if echo:
            print(f"{m:20s} {out[m]['tokens_per_second']:6.1f} tok/s  {out[m]['speedup']:5.2f}x  "
                  f"mean accepted {out[m]['mean_accepted_tokens']:.2f}"
                  f"  differ {out[m]['differ_from_plain']}/{len(rs)}  " +
                  "  ".join(f"{k}: hit {v['hit_rate']:.0%} acc {v['acceptance_rate']:.0%}" for k, v in layers.items()))
    return out


def median_forward_seconds(forward: Callable[[], object], cache, repeats: int) -> float:
    """Median wall time of forward() over `repeats` runs on the same KV cache, the tokens each run
    adds cropped off after it (the upper median of an even count)."""
    base = cache.get_seq_length()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward()
        ts.append(time.perf_counter() - t0)
        cache.crop(-(cache.get_seq_length() - base))
    return sorted(ts)[len(ts) // 2]


# ---------------------------------------------------------------- replay

SIZES = [1, 2, 4, 6, 8, 10, 12, 16, 20, 24]  # widths forward_costs measures


@torch.inference_mode()
def forward_costs(lm, ids, repeats: int = 12) -> dict:
    """Median time of one forward over k new tokens on a len(ids) context, relative to k = 1."""
    m = lm.model
    cache = m.new_cache()
    m.forward(torch.tensor([ids]), cache)
    med = {k: median_forward_seconds(lambda k=k: m.forward(torch.tensor([ids[:k]]), cache),
                                     cache, repeats) for k in SIZES}
    return {k: v / med[1] for k, v in med.items()}


def record(texts: list[str], max_new_tokens: int, cache: str | Path | None = None, lm=None) -> list:
    """[prompt ids, plain greedy output] per text, in fp32 so the outputs are exact, or with a
    loaded model `lm` in its dtype (the answers a run in that mode verifies). cache: a JSON file,
    read when it holds these texts, max_new_tokens and dtype, else (re)written."""
    key = {"texts_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
           "max_new_tokens": max_new_tokens, "dtype": "fp32" if lm is None else lm.dtype}
    if cache is not None and Path(cache).exists():
        try:
            data = json.loads(Path(cache).read_text())
            if isinstance(data, dict) and data.get("key") == key:
                return data["refs"]
        except ValueError:
            pass
        print(f"{cache} holds other outputs: recording again", file=sys.stderr)
    from hdcli import api
    lm = api.load_model(dtype="fp32") if lm is None else lm
    refs = []
    for t in texts:
        ids = api.encode_prompt(lm.tokenizer, t)
        refs.append([ids, api.generate(lm, prompt_ids=ids, max_new_tokens=max_new_tokens, drafter=None).tokens])
        print(f"recorded {len(refs)}/{len(texts)}", file=sys.stderr, flush=True)
    if cache is not None:
        Path(cache).write_text(json.dumps({"key": key, "refs": refs}))
    return refs


def cost_function(cost) -> Callable[[int], float]:
    """cost(width) of a verification forward: a costs.CostCurve (or any callable) as it is; a dict
    {width: cost} (forward_costs, or read back from JSON) as steps: the cost of the smallest
    measured width >= w, the widest one's beyond."""
    if callable(cost):
        return cost
    table = {int(w): float(c) for w, c in cost.items()}
    widths = sorted(table)

    def step(w: int) -> float:
        return table[next((s for s in widths if s >= w), widths[-1])]
    return step


def replay(refs, make_hierarchy: Callable, cost, cap: bool = True) -> dict:
    """Predicted speedup (plain cost / drafted cost), mean accepted tokens, mean drafted nodes per
    step and per-layer drafted/accepted tokens of a drafter over recorded outputs.

    refs: [prompt ids, plain output] pairs (record). make_hierarchy(): a fresh drafting Hierarchy
    (or anything with reset/extend/propose/rate/observe) per output. Each step merges the drafts
    into a tree (build_tree, as the decoder does; one candidate is a chain), keeps the path that
    matches the plain output, and costs cost(1 + drafted nodes). cap: cut the tree to what pays for
    its forward, as the decoder does; False sends every drafted token."""
    c = cost_function(cost)
    spent = plain = steps = nodes = 0
    layers: dict[str, list[int]] = {}
    for prompt, ref in refs:
        hier, pos, h = make_hierarchy(), 0, list(prompt)
        hier.reset(h)
        while pos < len(ref):
            drafts = hier.propose(h, len(ref) - pos - 1)
            tree = build_tree(drafts, hier.rate, c if cap else None)
            path, node = [], 0
            while pos + len(path) < len(ref):
                nxt = next((i for i in tree.children[node] if tree.tokens[i] == ref[pos + len(path)]), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            tested, accepted = reached(tree, path)
            hier.observe(tested, accepted)
            for name in tree.layers[1:]:
                layers.setdefault(name, [0, 0])[0] += 1
            for i in path:
                layers[tree.layers[i]][1] += 1
            new = ref[pos:pos + len(path) + 1]
            spent += c(1 + tree.size())
            nodes += tree.size()
            steps += 1
            pos += len(new)
            h += new
            hier.extend(new)
        plain += len(ref)
    return {"predicted_speedup": plain / spent, "mean_accepted": plain / steps,
            "mean_tree": nodes / steps,
            "layers": {k: {"drafted": v[0], "accepted": v[1]} for k, v in layers.items()}}

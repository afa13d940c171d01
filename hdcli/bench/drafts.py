"""`hd bench drafts`: drafting configurations replayed over the target's recorded greedy answers.

Recording, once per model, tokenizer, question set and answer length (cached, `Recording`): the
target's plain greedy answer to each question's first turn, and its best `k` tokens at every
position of the prompt and of the answer. Replay (`replay`): the decode loop itself
(engine/decode/loop.py's Stream: the drafter, the tree and its cost cap, the acceptance rule, the
per-layer statistics) runs over each answer against a stand-in target (`Recorded`) whose rows are
the recorded ones, so a configuration costs seconds and no forward.

What a replay cannot know: the target's row after a node off the greedy path (a rejected draft).
Acceptance never reads it (greedy keeps a node when the row of its parent, on the path, names it),
but the recycle layer records every row of a forward: under replay it is told the rows on the path
only (and the prompt's, where the configuration records the prefill). That is the one way a
replay differs from the live engine; tests/test_bench_drafts.py shows both agree token for token
without recycle and measures the gap with it.

Predicted speed of a configuration: the tokens of the answers over their cost in one-token
forwards of this machine's cost curve (engine/decode/costs.py): each step's forward over its tree
(branches and all, tree.forward_cost) plus the drafting time the replay measured (proposing,
building the tree and, for layers that learn, recording) over the one-token time. Plain decoding
costs one a token. The verification's own bookkeeping, which plain decoding pays too, is left out.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..db.fingerprint import tokenizer_fingerprint
from ..engine.decode import costs
from ..engine.decode.draft import Drafter
from ..engine.decode.loop import Decoder
from ..engine.decode.request import Request
from ..engine.decode.tree import forward_cost
from ..engine.decode.verify import top_tokens
from ..engine.kernels import invariant
from ..engine.records import cpu_name, write_json
from ..engine.text.prompts import encode_messages
from ..errors import HdError
from . import runner

FORMAT = 1
TOP_K = 8        # best tokens kept per position: Token Recycling keeps top-8
BUDGETS = (4, 8, 16, 32, 64)   # tokens verified a step: the root and up to b - 1 drafted nodes


@dataclass
class Answer:
    """One question's recording: prompt and answer ids, the most new tokens it was given (limit);
    top[j] the target's best tokens predicting answer[j] (top[j][0] == answer[j]); prompt_top[i]
    its best tokens after prompt[:i + 1]."""
    category: str
    limit: int
    prompt: list[int]
    answer: list[int]
    top: list[list[int]]
    prompt_top: list[list[int]]


@dataclass
class Recording:
    key: dict                      # what it was recorded for (model, tokenizer, questions, ...)
    answers: list[Answer] = field(default_factory=list)


def recording_key(lm, questions: Sequence[dict], max_new_tokens: int, k: int = TOP_K) -> dict:
    """What a recording is valid for: the model file, its dtype and kernels, the tokenizer, the
    questions' texts, the answer length, k and the CPU (the M-invariant rows are the machine's)."""
    src = Path(str(lm.source))
    stat = src.stat() if src.exists() else None
    texts = json.dumps([q["turns"][0] for q in questions])
    return {"format": FORMAT, "model": f"{lm.name} ({lm.source})",
            "model_file": None if stat is None else f"{stat.st_size} bytes, mtime {stat.st_mtime_ns}",
            "dtype": lm.dtype, "kernels": lm.kernels, "tokenizer": tokenizer_fingerprint(lm.tokenizer),
            "questions": hashlib.sha256(texts.encode()).hexdigest()[:32],
            "max_new_tokens": max_new_tokens, "k": k, "cpu": cpu_name()}


def default_cache(key: dict) -> Path:
    from ..engine.environment import cache_dir
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "replay" / f"{digest}.json"


def load(path: Path, key: dict) -> Recording | None:
    """The recording at path, None if there is none; one recorded for anything else is refused in
    one line naming what differs (never reused)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        got = data["key"]
        answers = [Answer(**a) for a in data["answers"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HdError(f"replay cache {path} is not a recording ({type(exc).__name__}): delete it, or pass "
                      "--record to record again") from None
    for name in key:
        if got.get(name) != key[name]:
            raise HdError(f"replay cache {path} was recorded for another {name} ({got.get(name)!r}, here "
                          f"{key[name]!r}): pass --record to record again, or another --cache")
    return Recording(got, answers)


class _Recorder(Drafter):
    """Drafts nothing (plain decoding) and keeps the target's best tokens at each step's root."""
    records = True

    def __init__(self, k: int):
        self.record_k, self.rows = k, []

    def reset(self, tokens): self.rows = []
    def extend(self, tokens): pass
    def propose(self, history, max_len, stats=None): return []
    def rate(self, layer, depth=1, first_child=True): return 0.0
    def observe(self, tested, accepted): pass

    def record(self, before, tokens, parents, top, stats=None, probs=None):
        self.rows.append(list(top[0]))


@torch.inference_mode()
def _prompt_top(lm, prompt: Sequence[int], k: int) -> list[list[int]]:
    """The target's best tokens after every prefix of the prompt, in the prefill's causal pieces."""
    m = lm.model
    cache, rows = m.new_cache(), []
    for a in range(0, len(prompt), invariant.MAX_ROWS):
        piece = torch.tensor([list(prompt[a:a + invariant.MAX_ROWS])], dtype=torch.long, device=m.device)
        rows += top_tokens(m.forward(piece, cache), k)
    return rows


def record(lm, questions: Sequence[dict], max_new_tokens: int, k: int = TOP_K,
           progress: Callable[[int, int], None] | None = None) -> Recording:
    """Each question's first turn answered by plain greedy decoding, with its top-k rows."""
    key = recording_key(lm, questions, max_new_tokens, k)
    rec = Recording(key)
    dec = Decoder(lm.model, lm.eos_ids, _Recorder(k))
    for n, q in enumerate(questions, 1):
        ids = encode_messages(lm.tokenizer, [{"role": "user", "content": q["turns"][0]}])
        room = lm.max_context - len(ids) - 1
        if room < 1:
            raise HdError(f"question {q.get('question_id')}: prompt of {len(ids)} tokens leaves no room")
        limit = min(max_new_tokens, room)
        g = dec.generate(Request(ids, limit))
        rows = dec.drafter.rows
        assert [r[0] for r in rows] == g.tokens, "a recorded row's best token is not the greedy answer's"
        rec.answers.append(Answer(q["category"], limit, list(ids), list(g.tokens), rows, _prompt_top(lm, ids, k)))
        if progress:
            progress(n, len(questions))
    return rec


def recorded(lm, questions, max_new_tokens: int, cache: Path | None = None, again: bool = False,
             progress=None) -> tuple[Recording, Path]:
    """The recording for these questions, from the cache where it holds it, else recorded and saved."""
    key = recording_key(lm, questions, max_new_tokens)
    path = Path(cache) if cache is not None else default_cache(key)
    rec = None if again else load(path, key)
    if rec is None:
        rec = record(lm, questions, max_new_tokens, progress=progress)
        write_json(path, {"key": rec.key, "answers": [a.__dict__ for a in rec.answers]})
    return rec, path


class _Cache:
    """The stand-in target's KV cache: a length."""

    def __init__(self):
        self.n = 0

    def get_seq_length(self) -> int: return self.n
    def keep_path(self, past, path) -> None: self.n = past + 1 + len(path)
    def crop(self, max_length) -> None: self.n = max_length if max_length >= 0 else self.n + max_length
    def sliding_windows(self) -> list: return []
    def supports_trees(self) -> bool: return True


class Recorded:
    """A stand-in TargetModel for replay: no forward; the replay hands each step's rows to the
    stream itself (`rows`)."""
    invariant = False
    numerics = None
    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.config = type("Config", (), {"vocab_size": vocab_size})()
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def new_cache(self): return _Cache()
    def prefill(self, input_ids, cache): cache.n += input_ids.shape[-1]


def on_path(tree, answer: Sequence[int], pos: int) -> list[int]:
    """The nodes of a tree whose path is the answer's next tokens (root first), in depth order:
    greedy acceptance's path and its root."""
    nodes, node = [0], 0
    while pos + len(nodes) - 1 < len(answer):
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == answer[pos + len(nodes) - 1]), None)
        if nxt is None:
            break
        nodes.append(nxt)
        node = nxt
    return nodes


def rows(tree, nodes: Sequence[int], top: Sequence[Sequence[int]], pos: int, vocab: int) -> torch.Tensor:
    """Logits [tree nodes, V]: a node on the path at depth d has the recorded row of position
    pos + d (its top-k scored k .. 1, every other token -inf); any other row is flat (never read by
    acceptance; replay withholds it from recording layers)."""
    out = torch.zeros((len(tree.tokens), vocab), dtype=torch.float32)
    k = len(top[0]) if top else 1
    scores = torch.arange(k, 0, -1, dtype=torch.float32)
    for d, i in enumerate(nodes):
        if pos + d < len(top):
            out[i].fill_(float("-inf"))
            out[i, torch.tensor(top[pos + d])] = scores[:len(top[pos + d])]
    return out


class _OnPath:
    """The drafter under replay: everything passes through but `record`, which is told only the
    rows the recording holds (the path's; `nodes` set by the replay each step) and, at reset, the
    prompt's where `prefill` is set. Its time recording is counted (record_seconds)."""

    def __init__(self, inner: Drafter, prompt_top: Sequence[Sequence[int]] | None):
        self.inner, self.prompt_top = inner, prompt_top
        self.nodes: list[int] = []
        self.known = 0            # how many of `nodes` have recorded rows
        self.record_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, tokens) -> None:
        self.inner.reset(tokens)
        if self.prompt_top is not None and self.inner.records and len(tokens) > 1:
            t0 = time.perf_counter()
            n = len(tokens) - 1   # the last prompt token is the first step's root
            self.inner.record([], list(tokens[:n]), [-1] + list(range(n - 1)),
                              [r[:self.inner.record_k] for r in self.prompt_top[:n]], None, None)
            self.record_seconds += time.perf_counter() - t0

    def record(self, before, tokens, parents, top, stats=None, probs=None) -> None:
        keep = self.nodes[:self.known]
        if not keep:
            return
        t0 = time.perf_counter()
        self.inner.record(before, [tokens[i] for i in keep], [-1] + list(range(len(keep) - 1)),
                          [top[i] for i in keep], stats, None)
        self.record_seconds += time.perf_counter() - t0


@dataclass
class Replayed:
    """A configuration's replay over a recording."""
    steps: int = 0
    tokens: int = 0
    nodes: int = 0                 # drafted nodes verified, all steps
    forward_cost: float = 0.0      # in one-token forwards
    draft_seconds: float = 0.0     # proposing, the tree, recording
    layers: dict = field(default_factory=dict)      # layer -> {drafted, accepted, seconds}
    categories: dict = field(default_factory=dict)  # category -> [tokens, steps, cost]
    accept_lengths: list = field(default_factory=list)   # per answer, per step

    def report(self, one_token_seconds: float | None) -> dict:
        overhead = self.draft_seconds / one_token_seconds if one_token_seconds else 0.0
        spent = self.forward_cost + overhead
        total = sum(v["accepted"] for v in self.layers.values()) or 1
        return {"mean_accepted": self.tokens / max(self.steps, 1), "mean_tree": self.nodes / max(self.steps, 1),
                "predicted_speedup": self.tokens / spent if spent else 0.0,
                "forward_only_speedup": self.tokens / self.forward_cost if self.forward_cost else 0.0,
                "draft_ms_per_step": 1e3 * self.draft_seconds / max(self.steps, 1),
                "layers": {k: {**v, "share_of_accepted": v["accepted"] / total} for k, v in self.layers.items()},
                "categories": {c: {"mean_accepted": t / max(s, 1), "predicted_speedup": t / c_ if c_ else 0.0}
                               for c, (t, s, c_) in self.categories.items()}}


def replay(rec: Recording, make_drafter: Callable[[], Drafter | None], vocab: int, eos_ids=(), *,
           price, cap=None, max_nodes: int = 63, prefill: bool = False) -> Replayed:
    """Each recorded answer decoded again by the live Stream with make_drafter()'s drafter (a fresh
    one per answer; what it shares across answers, a recycle table, it shares), against the
    recorded rows. price: the cost curve a step's forward is priced by (this machine's); cap: the
    curve that cuts each tree (None: sent whole, up to max_nodes; costs.flat(): every node up to
    max_nodes, a tree budget). prefill: recording layers are told the prompt's rows first. The
    tokens must come out as the recording's: replay asserts it."""
    model = Recorded(vocab)
    cost = cap
    out = Replayed()
    one = getattr(price, "one_token_seconds", None)
    for a in rec.answers:
        inner = make_drafter()
        drafter = None if inner is None else _OnPath(inner, a.prompt_top if prefill else None)
        dec = Decoder(model, eos_ids, drafter, cost=cost, max_nodes=max_nodes)
        s = dec.stream(Request(a.prompt, a.limit))
        cost_here = 0.0
        while not s.done:
            tree = s.propose()
            pos = len(s.out)
            nodes = on_path(tree, a.answer, pos)
            if drafter is not None:
                drafter.nodes, drafter.known = nodes, sum(pos + d < len(a.answer) for d in range(len(nodes)))
            s.accept(rows(tree, nodes, a.top, pos, vocab))
            branched = 0 if tree.is_chain() else len(tree.tokens)
            cost_here += forward_cost(price, len(tree.tokens), 1, branched)
        g = s.result()
        assert g.tokens == a.answer[:len(g.tokens)] and len(g.tokens) == len(a.answer), \
            "replay left the recorded answer: the recording does not match the decoder"
        st = g.stats
        out.steps += len(st.accept_lengths)
        out.tokens += len(g.tokens)
        out.nodes += sum(st.tree_sizes)
        out.forward_cost += cost_here
        spent = st.draft_seconds + (drafter.record_seconds if drafter is not None else 0.0)
        out.draft_seconds += spent
        out.accept_lengths.append(list(st.accept_lengths))
        for name, ls in st.layers.items():
            row = out.layers.setdefault(name, {"drafted": 0, "accepted": 0, "seconds": 0.0})
            row["drafted"] += ls.drafted
            row["accepted"] += ls.accepted
            row["seconds"] += ls.seconds
        c = out.categories.setdefault(a.category, [0, 0, 0.0])
        c[0] += len(g.tokens)
        c[1] += len(st.accept_lengths)
        c[2] += cost_here + (spent / one if one else 0.0)
    return out


def configurations(lm, cfg, dbs, methods: Sequence[str]):
    """name -> a maker of (drafter factory, capped) for each method (bench/runner.py's names,
    checked by the caller): called once per replay, so what a method shares across answers starts
    empty each time."""
    for name in methods:   # fail now, not after the recording
        runner.drafter_factory(name, lm, cfg, dbs)
    return {name: (lambda name=name: runner.drafter_factory(name, lm, cfg, dbs)) for name in methods}


def bench(lm, rec: Recording, makers: dict, budgets: Sequence[int] = BUDGETS, prefill: bool = False,
          progress: Callable[[str], None] | None = None) -> dict:
    """Each configuration replayed as this machine runs it (its trees cut by the cost curve, the
    decoder's 63 nodes at most) and at each tree budget b (every node up to b - 1 drafted ones,
    costs.flat: b tokens verified with the root),
    priced by this machine's curve (or the one costs.assume gave the model: `--price-by`, where
    the predicted speedup is that curve's model's, with this model's acceptance): the report of
    `hd bench drafts`."""
    curve = costs.curve_for(lm)
    vocab, eos = int(lm.model.config.vocab_size), lm.eos_ids
    out = {}
    for name, make in makers.items():
        factory, capped = make()
        t0 = time.perf_counter()
        mine = replay(rec, factory or (lambda: None), vocab, eos, price=curve, cap=curve if capped else None,
                      prefill=prefill)
        row = {"machine": mine.report(curve.one_token_seconds), "replay_seconds": time.perf_counter() - t0,
               "budgets": {}}
        for b in budgets:
            factory, _ = make()
            r = replay(rec, factory or (lambda: None), vocab, eos, price=curve, cap=costs.flat(),
                       max_nodes=b - 1, prefill=prefill)
            rb = r.report(curve.one_token_seconds)
            row["budgets"][str(b)] = {k: rb[k] for k in ("mean_accepted", "mean_tree", "predicted_speedup")}
        out[name] = row
        if progress:
            progress(name)
    return {"cost_curve": curve.to_dict(), "one_token_ms": 1e3 * (curve.one_token_seconds or 0.0),
            "questions": len(rec.answers), "tokens": sum(len(a.answer) for a in rec.answers),
            "recording": rec.key, "prefill_recorded": prefill, "methods": out}


def table(report: dict):
    """The replay's table: per configuration, as this machine runs it, then MAT per tree budget."""
    from rich import box
    from rich.table import Table
    budgets = list(next(iter(report["methods"].values()))["budgets"]) if report["methods"] else []
    by = report.get("priced_by")
    t = Table(title=f"Drafting replay · {report['questions']} answers · {report['tokens']} tokens · "
                    f"one-token forward {report['one_token_ms']:.2f} ms"
                    + (f" · priced by {by.get('model')}'s curve (a prediction)" if by else ""),
              caption="MAT: mean accepted tokens a step · pred.: predicted speedup over plain (forwards by the "
                      "cost curve, and drafting time) · tree: drafted nodes a step · ms: drafting a step · "
                      "bN: MAT where every drafted node is sent, N tokens verified at most",
              box=box.SIMPLE_HEAD, pad_edge=False)
    from ..drafting import registry
    for col in ("method", "MAT", "pred.", "tree", "ms", *[f"b{b}" for b in budgets], "accepted by layer"):
        t.add_column(col, justify="left" if col in ("method", "accepted by layer") else "right")

    def short(layer: str) -> str:
        spec = registry.LAYERS.get(layer.split(":", 1)[0])
        return spec.short if spec is not None and spec.short and ":" not in layer else layer
    for name, row in report["methods"].items():
        m = row["machine"]
        shares = " ".join(f"{short(k)} {v['share_of_accepted']:.0%}" for k, v in
                          sorted(m["layers"].items(), key=lambda kv: -kv[1]["accepted"]) if v["accepted"])
        t.add_row(name, f"{m['mean_accepted']:.2f}", f"{m['predicted_speedup']:.2f}x", f"{m['mean_tree']:.1f}",
                  f"{m['draft_ms_per_step']:.2f}", *[f"{row['budgets'][b]['mean_accepted']:.2f}" for b in budgets],
                  shares)
    return t

"""Acceptance rules: which drafted tokens the target keeps. Both rules are lossless.

Greedy (temperature 0): the target's choice at each position is argmax of its logits. A drafted
token is kept while it equals that argmax; the first position where it differs, or the position
after the last drafted token, contributes the target's own argmax. Every kept token is therefore
exactly what plain greedy decoding would have produced.

Logits processors (frequency and presence penalties, logit_bias) are part of the target's
distribution: each row of a verification forward is processed with the counts of the tokens
generated before it on its own path (the output so far, then the row's ancestors in the tree), as
plain decoding processes its one row, elementwise in fp32, so a processed row is torch.equal to
plain decoding's and both rules above stay exact (`processed`). Log-probabilities are those of the
processed row, before temperature and truncation (`logprobs_of`), one row at a time.

Sampling: a drafted token x is a point-mass proposal q = delta_x. Accept x with probability p(x)
(p: the target's distribution after temperature/top-k/top-p). On rejection set p(x) = 0 and
renormalise; then try the next candidate at this position, if any, or sample from what remains.
P(out = x) = p(x), and P(out = y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for y != x, so the
output has exactly the target's distribution, candidate by candidate (sample_point_masses, used by
the draft-model stack; the decode loop runs the coupled form below, which has the same law).

Seeded sampling is coupled to the output position (`coupled_choice`): output position i has one
uniform u_i from a counter-based generator keyed by (seed, choice index, i), and the target's token
at a row for position i is the inverse CDF of its distribution at u_i. A drafted token is kept iff
it equals that token, so it is kept with probability p(x), candidate by candidate, as above; and
since a row's logits depend only on its path (the M-invariant forward), the output is token for
token plain sampled decoding's with the same seed, whatever was drafted, verified beside it or
learned before. Without a seed the key is drawn at random: the same rule, a fresh sample.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..kernels import quants


MAX_PENALTY = 2.0     # OpenAI's range for frequency_penalty and presence_penalty: [-2, 2]
MAX_BIAS = 100.0      # and for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class Range:
    """The numbers an option takes: finite, low <= v (low < v where low_open) and v <= high; None:
    no bound. Declared once per option (a Sampling field's here, in SAMPLING_RANGES; the others'
    with their DecodingConfig field, hdcli/config.py), and read by what checks it: Sampling,
    DecodingConfig.problems, hd serve's request schema (hdcli/serve/protocol.py, `bounds`)."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def holds(self, v) -> bool:
        if isinstance(v, float) and not math.isfinite(v):   # nan and inf: no bound holds them
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or v <= self.high

    def bounds(self) -> dict:
        """The range as pydantic's Field takes it (ge or gt, le)."""
        out = {} if self.low is None else {"gt" if self.low_open else "ge": self.low}
        return out if self.high is None else {**out, "le": self.high}


# what each number of a Sampling takes (DecodingConfig's fields of the same names declare these)
SAMPLING_RANGES = {"temperature": Range(0.0), "top_k": Range(0), "top_p": Range(0.0, 1.0, low_open=True),
                   "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
                   "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY)}


@dataclass(frozen=True)
class Sampling:
    """How the target's next token is chosen.

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.
    frequency_penalty, presence_penalty: OpenAI's, over the tokens generated so far (the prompt
    is not counted): logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty.
    logit_bias: ((token id, bias), ...) added to those logits (a tuple, so Sampling stays hashable).
    The defaults are every option's (DecodingConfig's sampling fields take them); the ranges are
    SAMPLING_RANGES'."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        r = SAMPLING_RANGES
        for name in r:   # NaN passes every comparison: said as what it is, before any range
            v = getattr(self, name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, not {v}")
        if not r["temperature"].holds(self.temperature):
            raise ValueError(f"temperature must be a finite number >= {r['temperature'].low:g}, not {self.temperature}")
        if not r["top_k"].holds(self.top_k):
            raise ValueError(f"top_k must be >= {r['top_k'].low}")
        if not r["top_p"].holds(self.top_p):
            raise ValueError(f"top_p must be in ({r['top_p'].low:g}, {r['top_p'].high:g}]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not r[name].holds(v):
                raise ValueError(f"{name} must be in [{r[name].low:g}, {r[name].high:g}], not {v}")
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        for t, b in bias:
            if not math.isfinite(b):
                raise ValueError(f"logit_bias: the bias of token {t} must be a finite number, not {b}")
            if t < 0 or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-{MAX_BIAS:g}, "
                                 f"{MAX_BIAS:g}], not {t}: {b}")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether logits go through a processor (penalties, biases) before the choice."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


def processed(logits: torch.Tensor, s: Sampling, generated: Sequence[int],
              parents: Sequence[int] = (0,), tokens: Sequence[int] = (0,)) -> torch.Tensor:
    """The logits [n, V] after the processors, fp32: row i is the prediction after node i of a tree
    (parents[i], tokens[i]; row 0 is the root, the last token of the history) and is penalised by
    the counts of `generated` (the output before this step) plus the tokens on its path below the
    root. Elementwise per row, so row i is torch.equal to plain decoding's row for the same path.
    Without processors, the logits as they are."""
    if not s.processes:
        return logits
    x = logits.float()
    n, vocab = x.shape
    if s.frequency_penalty or s.presence_penalty:
        base = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab]
        counts = base.to(x.device, torch.float32).repeat(n, 1)
        for i in range(1, n):   # a parent comes before its children (engine/decode/tree.py)
            counts[i] = counts[parents[i]]
            counts[i, tokens[i]] += 1.0
        x = x - (counts * s.frequency_penalty + (counts > 0).float() * s.presence_penalty)
    if s.logit_bias:
        bias = torch.zeros(vocab, dtype=torch.float32, device=x.device)
        ids = [t for t, _ in s.logit_bias if t < vocab]   # an id past the vocabulary biases nothing
        bias[ids] = torch.tensor([b for t, b in s.logit_bias if t < vocab], dtype=torch.float32)
        x = x + bias
    return x


def logprobs_of(logits: torch.Tensor, rows: Sequence[int], chosen: Sequence[int],
                top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of `rows`: (log-probability of chosen[i], the `top` best (token, log-probability)),
    from the row's (processed) logits. Each row is computed alone ([1, V] log_softmax and topk),
    so its numbers are those of plain decoding's one-row forward, whatever else was verified.
    Tokens a grammar forbids (-inf) are no alternatives: left out, as OpenAI leaves out tokens it
    never offers, so a row may have fewer than `top`, and every number is finite (JSON has no
    infinity: Python writes -Infinity, which JSON.parse refuses, and Starlette's strict encoder
    failed the response)."""
    out = []
    for r, tok in zip(rows, chosen):
        lp = torch.log_softmax(logits[r:r + 1].float(), dim=-1)[0]
        best = []
        if top:
            v, i = torch.topk(lp, top)
            best = [(t, x) for t, x in zip(i.tolist(), v.tolist()) if x != float("-inf")]
        out.append((float(lp[tok]), best))
    return out


def target_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution plain sampling draws from, per row of logits [n, V] (float32)."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


# --- seeded sampling coupled to the output position ----------------------------------------------
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15     # splitmix64's increment: consecutive counters land far apart
NEAR = 16.0          # nats below the best token (after temperature) that _ranked sorts first,
NEAR_MAX = 2048      # when they are at most this many
NUCLEUS_FIRST = 64   # else the nucleus is looked for among this many best tokens first, then
NUCLEUS_GROWTH = 8   # 8x as many until it closes (exact either way: the rule is applied after)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints whose every output bit depends on every
    input bit, so counters 0, 1, 2, ... give independent-looking words."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def sampling_key(seed: int | None, choice: int = 0) -> int:
    """The key of one generation's position-coupled randomness: (seed, choice index) mixed, or a
    fresh random key without a seed (behaviour as unseeded sampling: a new sample each time)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    return _mix64(_mix64((int(seed) & MASK64) + GOLDEN) ^ (int(choice) * GOLDEN & MASK64))


def position_uniform(key: int, position: int) -> float:
    """u_i in [0, 1 - 2**-52] for output position i of the generation keyed by key: a counter-based
    draw (splitmix64 of key + i), so it depends on the position only, never on how many draws a
    step made. 52 bits, so u * c < c for any positive double c (coupled_choice's search)."""
    return (_mix64((key + (int(position) + 1) * GOLDEN) & MASK64) >> 12) * 2.0 ** -52


def _ranked(z: torch.Tensor, k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, ids, log of the row's partition function or None) of the tokens top-k and top-p can
    keep, best first. Top-k: torch.topk. Top-p alone: most rows are peaked, and the tokens within
    NEAR nats of the best are sorted alone when they hold top_p of the mass (every token outside
    ranks below them all, so the mass before it is already >= top_p, and top-p drops it); else the
    best NUCLEUS_FIRST, 8x as many until the nucleus closes."""
    vocab = z.shape[-1]
    if k < vocab:
        v, ids = torch.topk(z, k)
        return v, ids, None
    lse = torch.logsumexp(z, -1)
    near = torch.nonzero(z >= z.max() - NEAR).flatten()
    if near.numel() <= NEAR_MAX and float(torch.exp(z[near] - lse).sum()) >= top_p:
        v, order = torch.sort(z[near], descending=True, stable=True)
        return v, near[order], lse
    m = min(vocab, NUCLEUS_FIRST)
    while True:
        v, ids = torch.topk(z, m)
        if m == vocab or float(torch.exp(v[:-1] - lse).sum()) >= top_p:   # the nucleus closed inside
            return v, ids, lse
        m = min(vocab, m * NUCLEUS_GROWTH)


def _loaded_for(scores: torch.Tensor):
    """csrc/qmm.cpp's module where it is already loaded and `scores` are what its row choosers
    read (bf16 or fp32 on the CPU), else None: it is never built for them alone."""
    if scores.device.type != "cpu" or scores.dtype not in (torch.bfloat16, torch.float32):
        return None
    return quants.GEMM.compiled


_DRAWER: list = []   # [the compiled module or None], decided at the process's first draw (coupled_choice)


def _drawer():
    if not _DRAWER:
        _DRAWER.append(quants.GEMM.compiled)
    return _DRAWER[0]


def coupled_choice(row: torch.Tensor, s: Sampling, u: float) -> int:
    """The target's token at one (processed) row [V] for the position whose uniform is u: the
    inverse CDF at u of the distribution plain sampling draws from (target_probs: temperature, then
    top-k, then top-p over what top-k kept). P(token = x) = p(x) for u uniform.

    Cheap and exact: temperature and exp on the row once; under top-k or top-p only the candidates
    are sorted (_ranked); the inverse CDF is a cumulative sum (fp64) over the kept tokens in a fixed
    order (ids ascending without truncation, best first with it). A row alone, so its token is
    plain decoding's for the same row bits, however many rows were verified beside it.

    On the CPU, without top-k or top-p, the compiled module draws (csrc/qmm.cpp's draw: the same
    law, the CDF's order by lanes of eight and its exp its own, every build the same bits) where
    it was loaded when the process first drew (it is wherever hd's own forward runs on the CPU;
    never built for this alone: a transformers forward's first sampled token paying a minute's
    compile), decided then for the process so that the law a seed draws by never changes in it:
    the compiled pass draws over the bundled model's 49152 logits in less than half the torch ops'
    time. Plain and speculative decoding draw through here alike, so a seed gives
    one answer with or without drafts either way."""
    vocab = row.shape[-1]
    k = s.top_k if 0 < s.top_k < vocab else vocab
    if k == vocab and s.top_p >= 1.0 and _loaded_for(row) is not None:
        compiled = _drawer()
        if compiled is not None:   # the same law by a fixed-order inverse CDF in one pass (qmm.cpp's draw)
            got = compiled.draw(row, float(s.temperature), float(u))
            if got >= 0:
                return int(got)
    z = row.float() / s.temperature
    if not math.isfinite(float(z.max())):
        # a NaN in the row, +inf (inf - inf) or every token -inf: no distribution to draw from. The
        # token greedy decoding takes there (numpy's argmax: the first NaN, else the lowest index
        # of the max), in plain and speculative decoding alike, not an index past the vocabulary.
        return int(np.argmax(z.cpu().numpy()))
    if k == vocab and s.top_p >= 1.0:
        ids, w = None, torch.exp(z - z.max())
    else:
        v, ids, lse = _ranked(z, k, s.top_p)
        if s.top_p < 1.0:   # the mass is over what top-k kept, as in target_probs
            p = torch.softmax(v, -1) if lse is None else torch.exp(v - lse)
            # drop a token when the tokens ranked above it already reach top_p (the first stays)
            keep = int(((p.cumsum(-1) - p) < s.top_p).sum())
            v, ids = v[:keep], ids[:keep]
        w = torch.exp(v - v[0])
    c = w.double().cumsum(-1)
    t = torch.tensor([u * float(c[-1])], dtype=torch.float64, device=c.device)
    i = int(torch.searchsorted(c, t, right=True)[0])   # the first index whose cumulative mass > t
    return i if ids is None else int(ids[i])


def sample_point_masses(p: torch.Tensor, candidates, gen: torch.Generator | None) -> tuple[int, int | None]:
    """Draw one token from p [V] given point-mass proposals tried in order.

    Returns (token, index of the accepted candidate or None when all were rejected)."""
    for j, x in enumerate(candidates):
        px = float(p[x])
        if px > 0.0 and float(torch.rand((), generator=gen)) < px:
            return int(x), j
        if px > 0.0:
            p = p.clone()
            p[x] = 0.0
            p = p / p.sum()
    return int(torch.multinomial(p, 1, generator=gen)), None


def top_probs(logits: torch.Tensor, top: Sequence[Sequence[int]], s: Sampling) -> list[list[float]]:
    """Per row of logits [rows, V], the probability of each of `top[row]`'s tokens under the
    sampling temperature (softmax of logits / T, top-k and top-p not applied: what a sampled step
    keeps such a token with, slightly under-estimated where a truncation renormalises). These are
    estimates for drafting (a later step with the same tokens has another context); acceptance
    never reads them. One logsumexp over the rows and one gather; where the compiled module is
    loaded, its probs_of (csrc/qmm.cpp: the same probabilities to its exp's 1e-8, a pass a row)."""
    if not top or not top[0]:
        return [[] for _ in top]
    compiled = _loaded_for(logits)
    if compiled is not None and logits.dim() == 2 and len({len(t) for t in top}) == 1:
        return compiled.probs_of(logits, torch.tensor(top, dtype=torch.long), float(s.temperature)).tolist()
    x = logits.float() / s.temperature
    idx = torch.tensor(top, dtype=torch.long, device=x.device)
    return (x.gather(1, idx) - torch.logsumexp(x, -1, keepdim=True)).exp().tolist()


def numpy_top(logits: torch.Tensor, k: int) -> list[list[int]]:
    """top_tokens on the CPU by numpy: k argmaxes a row, each rank set to -inf for the next."""
    # fp32 is exact for bf16/fp16 logits; a copy where the ranks after the first mask it
    a = logits.to(torch.float32, copy=k > 1).numpy()
    rows = np.arange(a.shape[0])
    ranks = []
    for r in range(k):
        best = a.argmax(-1)
        ranks.append(best)
        if r + 1 < k:
            a[rows, best] = -np.inf
    return np.stack(ranks, 1).tolist()


def top_tokens(logits: torch.Tensor, k: int = 1) -> list[list[int]]:
    """Per row of logits [rows, V], the k highest-scoring token ids, best first. The first is
    exactly argmax's (the lowest index among equal maxima), so greedy acceptance can take it; each
    next one is the argmax of what is left. One device->host transfer a step. On the CPU the
    argmaxes are numpy's (vectorised): over the bundled model's 49152 logits two of them cost a
    fraction of torch's argmax and topk(2) together, and a verification step needs both
    (acceptance, the recycle layer). Where the compiled GEMM is already loaded (csrc/qmm.cpp's
    top_indices: the same indices, one pass a row) it does it instead, in a fraction of numpy's
    two argmaxes, widening copy and lists."""
    if logits.device.type == "cpu":
        compiled = _loaded_for(logits)
        if compiled is not None and logits.dim() == 2 and 0 < k <= logits.shape[-1]:
            return compiled.top_indices(logits, k).tolist()
        return numpy_top(logits, k)
    x = logits.float()
    first = x.argmax(-1, keepdim=True)
    if k == 1:
        return first.tolist()
    rest = x.scatter(-1, first, float("-inf")).topk(k - 1, dim=-1).indices
    return torch.cat([first, rest], -1).tolist()


def accept_chain(logits: torch.Tensor, draft, s: Sampling, gen: torch.Generator | None) -> tuple[int, int]:
    """Verify one drafted chain. logits [len(draft)+1, V]: row i is the target's prediction for the
    token after draft[:i]. Returns (number of drafted tokens accepted, the target's next token)."""
    k = len(draft)
    if s.greedy:
        targets = [t[0] for t in top_tokens(logits)]  # argmax's, one transfer
        n = 0
        while n < k and draft[n] == targets[n]:
            n += 1
        return n, targets[n]
    return accept_chain_q(logits, draft, None, s, gen)


def _to_host(*rows: torch.Tensor) -> list[list[float]]:
    """Small per-node values in one device->host transfer: on a GPU each float(t) would wait for
    the device, once per node; this waits once per step."""
    return torch.stack([r.float() for r in rows]).tolist()


def _uniforms(n: int, gen: torch.Generator | None, device) -> torch.Tensor:
    return torch.rand(n, generator=gen, device=gen.device if gen is not None else device)


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen))  # multinomial normalises p itself


def accept_tree(logits: torch.Tensor, tree, s: Sampling, key: int = 0, position: int = 0,
                targets: list[int] | None = None) -> tuple[list[int], int]:
    """Verify a token tree (hdcli.engine.decode.tree.Tree). logits [nodes, V]: row i is the
    target's prediction for the token after node i's path. Walk from the root: at each node the
    target chooses its token (greedy: argmax; sampling: coupled_choice with the uniform of the
    node's output position, position + depth, under key); follow the child that holds it, stop
    where none does. A child is thus kept with the target's probability of it, whichever
    candidates stand beside it. Returns (accepted nodes, root excluded, in path order; the target's
    next token). targets: greedy's argmax per row where the caller has it (top_tokens)."""
    children, tokens = tree.children, tree.tokens
    if s.greedy and targets is None:
        targets = [t[0] for t in top_tokens(logits)]
    path: list[int] = []
    node = 0
    while True:
        tok = targets[node] if s.greedy else coupled_choice(
            logits[node], s, position_uniform(key, position + len(path)))
        nxt = next((c for c in children[node] if tokens[c] == tok), None)
        if nxt is None:
            return path, tok
        path.append(nxt)
        node = nxt


def sample_with_draft(p: torch.Tensor, x: int, q: torch.Tensor, gen: torch.Generator | None) -> tuple[int, bool]:
    """The standard speculative sampling rule for a token x drawn from a draft distribution q:
    accept with probability min(1, p(x) / q(x)); on rejection draw from norm(max(0, p - q)).
    Then P(out = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z))) (p(y) - q(y))+ / Z = p(y).
    Returns (token, accepted?)."""
    px, qx = float(p[x]), float(q[x])
    if qx > 0.0 and float(torch.rand((), generator=gen)) < min(1.0, px / qx):
        return int(x), True
    residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=gen)), False


def accept_chain_q(logits: torch.Tensor, draft, q_rows, s: Sampling, gen: torch.Generator | None) -> tuple[int, int]:
    """Verify a chain drafted by a model level: q_rows[i] is the distribution draft[i] was drawn
    from (None, or q_rows None: a point mass, as from a database). Greedy ignores q. Every
    position's p(x), q(x) and uniform come to the host in one transfer (see accept_tree).
    Returns (kept, next token)."""
    if s.greedy:
        return accept_chain(logits, draft, s, gen)
    probs = target_probs(logits, s)
    k = len(draft)
    if k == 0:
        return 0, _draw(probs[0], gen)
    dev = probs.device
    xs = torch.tensor(list(draft), dtype=torch.long, device=dev)
    p_x = probs[torch.arange(k, device=dev), xs]
    q_given = [q_rows is not None and q_rows[i] is not None for i in range(k)]
    q_x = torch.stack([q_rows[i][int(x)].to(dev, torch.float32) if q_given[i] else p_x.new_zeros(())
                       for i, x in enumerate(draft)])
    p_h, q_h, u = _to_host(p_x, q_x, _uniforms(k, gen, dev))
    for i, x in enumerate(draft):
        if not q_given[i]:  # point mass: keep x with probability p(x), else draw from p without x
            if p_h[i] > 0.0 and u[i] < p_h[i]:
                continue
            p = probs[i].clone()
            p[int(x)] = 0.0
            return i, _draw(p, gen)
        # drawn from q: keep with probability min(1, p/q), else draw from norm(max(0, p - q))
        if q_h[i] > 0.0 and u[i] < min(1.0, p_h[i] / q_h[i]):
            continue
        residual = torch.clamp(probs[i] - q_rows[i].to(dev, torch.float32), min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
            residual = probs[i]
        return i, _draw(residual, gen)
    return k, _draw(probs[k], gen)

"""Acceptance rules: which drafted tokens the target keeps. Both rules are lossless.

Greedy (temperature 0): the target's choice at each position is argmax of its logits. A drafted
token is kept while it equals that argmax; the first position where it differs, or the position
after the last drafted token, contributes the target's own argmax. Every kept token is therefore
exactly what plain greedy decoding would have produced.

Sampling: a drafted token x is a point-mass proposal q = delta_x. Accept x with probability p(x)
(p: the target's distribution after temperature/top-k/top-p). On rejection set p(x) = 0 and
renormalise; then try the next candidate at this position, if any, or sample from what remains.
P(out = x) = p(x), and P(out = y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for y != x, so the
output has exactly the target's distribution, candidate by candidate.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # nan fails >= too
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def accept_chain(logits: torch.Tensor, draft, s: Sampling, gen: torch.Generator | None) -> tuple[int, int]:
    """Verify one drafted chain. logits [len(draft)+1, V]: row i is the target's prediction for the
    token after draft[:i]. Returns (number of drafted tokens accepted, the target's next token)."""
    k = len(draft)
    if s.greedy:
        targets = logits.argmax(-1).tolist()
        n = 0
        while n < k and draft[n] == targets[n]:
            n += 1
        return n, targets[n]
    probs = target_probs(logits, s)
    for i in range(k):
        tok, won = sample_point_masses(probs[i], (draft[i],), gen)
        if won is None:
            return i, tok
    return k, int(torch.multinomial(probs[k], 1, generator=gen))


def accept_tree(logits: torch.Tensor, children: list[list[int]], tokens: list[int], s: Sampling,
                gen: torch.Generator | None) -> tuple[list[int], int]:
    """Verify a token tree (hdcli.engine.tree.Tree's children/tokens). logits [nodes, V]: row i is the
    target's prediction for the token after node i's path. Walk from the root: at each node the
    target draws its token (greedy: argmax; sampling: the point-mass rule over the node's children
    tried in order, then the residual); follow the child that holds it, stop where none does.
    Returns (accepted nodes, root excluded, in path order; the target's next token)."""
    path: list[int] = []
    node = 0
    if s.greedy:
        targets = logits.argmax(-1).tolist()
        while True:
            nxt = next((c for c in children[node] if tokens[c] == targets[node]), None)
            if nxt is None:
                return path, targets[node]
            path.append(nxt)
            node = nxt
    probs = target_probs(logits, s)
    while True:
        kids = children[node]
        tok, won = sample_point_masses(probs[node], [tokens[c] for c in kids], gen)
        if won is None:
            return path, tok
        node = kids[won]
        path.append(node)


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
    from (None: a point mass, as from a database). Greedy ignores q. Returns (kept, next token)."""
    if s.greedy:
        return accept_chain(logits, draft, s, gen)
    probs = target_probs(logits, s)
    for i, x in enumerate(draft):
        q = q_rows[i] if q_rows is not None else None
        if q is None:
            tok, won = sample_point_masses(probs[i], (x,), gen)
            if won is None:
                return i, tok
        else:
            tok, ok = sample_with_draft(probs[i], x, q, gen)
            if not ok:
                return i, tok
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=gen))

"""The hierarchy: asks its layers in order and returns candidates tagged by layer, best first.

A layer sees the whole token history (prompt and generated tokens) and gives up to
`max_candidates` continuations of up to `max_len` tokens, best first (its `candidates`; a
drafter's `propose` is the step's drafts, made here of the layers' candidates). Layers are told
about every token that becomes part of the history, so an index can be kept incrementally instead
of rescanning.

    class Layer:
        name: str
        def reset(self, tokens: list[int]) -> None          # a new request: the prompt tokens
        def extend(self, tokens: list[int]) -> None         # tokens appended to the history
        def candidates(self, history, max_len, max_candidates) -> list[list[int]]

    class RecordingLayer(Layer):                            # a layer that learns from the target:
        top_k: int                                          # its best tokens per node it keeps,
        def record(self, before, tokens, parents, top, probs) -> None  # after every verification

The hierarchy asks its layers in order (most local first: context DB, then the model DB and
the statistics DB) and returns `Draft`s tagged with the layer that made them, so statistics and
colouring can be kept per layer. It is the engine's Drafter (hdcli.engine.decode.draft).
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence, runtime_checkable

from ..engine.decode.draft import Draft, Drafter, base_name, bucket, clamped
from . import registry


class Layer(Protocol):
    name: str

    def reset(self, tokens: Sequence[int]) -> None: ...
    def extend(self, tokens: Sequence[int]) -> None: ...
    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int) -> list[list[int]]: ...


@runtime_checkable
class RecordingLayer(Layer, Protocol):
    """A layer that learns from the target's own predictions (drafting/recycle.py): top[i] is node
    i's best tokens, best first, top_k of them; probs[i] their probabilities under sampling (None
    when greedy)."""
    top_k: int

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               top: Sequence[Sequence[int]], probs: Sequence[Sequence[float]] | None = None) -> None: ...


# A layer's prior acceptance per tree place is registered with it (registry.LayerSpec.prior);
# a layer name without one (a peer's drafts) gets this.
DEFAULT_PRIOR = (0.1, 0.3, 0.45, 0.55)


class AcceptanceTracker:
    """Online, per-request estimate of each layer's per-token acceptance, per tree place (bucket).

    rate = (accepted + prior * weight) / (tested + weight), where `tested` counts the layer's
    drafted tokens the verification reached (their parent was kept) and `accepted` those it kept.
    Both counts decay by `decay` at every step, so the estimate follows the current stretch of the
    answer, and a layer whose drafts stop being sent drifts back to its prior and is tried again:
    no layer starves for good.
    """

    def __init__(self, priors: dict[str, tuple] | None = None, weight: float = 2.0, decay: float = 0.9):
        self.priors = dict(registry.PRIOR_RATES if priors is None else priors)
        self.weight, self.decay = weight, decay
        self.reset()

    def reset(self) -> None:
        self.tested: dict[tuple, float] = {}
        self.accepted: dict[tuple, float] = {}

    def prior(self, layer: str | None, b: int = 1) -> float:
        p = self.priors.get(layer or "", self.priors.get(base_name(layer), DEFAULT_PRIOR))
        return p if isinstance(p, float) else p[b]

    def rate(self, layer: str | None, b: int = 1) -> float:
        t, a = self.tested.get((layer, b), 0.0), self.accepted.get((layer, b), 0.0)
        return (a + self.prior(layer, b) * self.weight) / (t + self.weight)

    def update(self, tested: dict[tuple, int], accepted: dict[tuple, int]) -> None:
        """tested/accepted: counts keyed by (layer, bucket)."""
        for d in (self.tested, self.accepted):
            for k in d:
                d[k] *= self.decay
        for k, v in tested.items():
            self.tested[k] = self.tested.get(k, 0.0) + v
        for k, v in accepted.items():
            self.accepted[k] = self.accepted.get(k, 0.0) + v


class Hierarchy(Drafter):
    """Asks the layers in order (most local first) and returns candidates tagged by layer, best first.

    Parameters
      policy          `first-hit`: candidates come only from the first layer that proposes any.
                      `fill`: the C slots are filled in layer order, each layer's best first (the
                      order of the published Hierarchy Drafting method).
                      `fill-tracked`: fill's slots and order; `rate` (which cuts the tree by
                      cost) is the online tracker's, not the prior: the default (measured,
                      docs/engine.md "Drafting policies").
                      `adaptive`: every layer is asked; layers are ordered, and given slots and
                      draft length, by their online acceptance in this request (AcceptanceTracker):
                      a layer being accepted now gets more; every layer that matches keeps at
                      least one slot, so none starves.
      draft_len       most tokens per candidate: one int, or {layer: int} (a base name such as
                      'stats' covers 'stats:wiki'; missing layers use `default_len`).
      max_candidates  C, the most candidates per step (1 = single-chain verification).
    `rate(layer)` is the per-token acceptance estimate the verifier uses to cap the tree by cost:
    the prior for `first-hit`/`fill`, the online tracker for `fill-tracked` and `adaptive`.
    """

    POLICIES = ("first-hit", "fill", "fill-tracked", "adaptive")

    def __init__(self, layers: Sequence[Layer], policy: str = "first-hit",
                 draft_len: int | dict[str, int] = 16, max_candidates: int = 1,
                 priors: dict[str, float] | None = None, default_len: int = 16):
        if policy not in self.POLICIES:
            raise ValueError(f"unknown drafting policy {policy!r}; known: {', '.join(self.POLICIES)}")
        if max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        self.layers = list(layers)
        self.recording = [layer for layer in self.layers if isinstance(layer, RecordingLayer)]
        self.policy, self.max_candidates = policy, max_candidates
        if isinstance(draft_len, int):
            self.lengths, self.draft_len = {}, draft_len
        else:
            self.lengths, self.draft_len = dict(draft_len), default_len
        self.tracker = AcceptanceTracker(priors)
        self._priors: dict[tuple, float] = {}

    def layer_len(self, name: str) -> int:
        return self.lengths.get(name, self.lengths.get(base_name(name), self.draft_len))

    @property
    def max_len(self) -> int:
        return max([self.layer_len(layer.name) for layer in self.layers] or [self.draft_len])

    def rate(self, layer: str | None, depth: int = 1, first_child: bool = True) -> float:
        b = bucket(depth, first_child)
        if self.policy in ("adaptive", "fill-tracked"):
            return self.tracker.rate(layer, b)
        key = (layer, b)   # the priors never change: asked for every tree node of every step
        got = self._priors.get(key)
        if got is None:
            got = self._priors[key] = self.tracker.prior(layer, b)
        return got

    def depth_for(self, layer: str, floor: float = 1 / 8) -> int:
        """How deep a first-choice candidate of this layer stays likely: while the chance of
        keeping the whole prefix is >= floor (at least 2 tokens)."""
        p, d = 1.0, 0
        while d < 64:
            p *= min(self.rate(layer, d + 1), 0.97)
            if p < floor:
                break
            d += 1
        return max(2, d)

    def reset(self, tokens: Sequence[int]) -> None:
        self.tracker.reset()
        for layer in self.layers:
            layer.reset(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for layer in self.layers:
            layer.extend(tokens)

    def observe(self, tested: dict[str, int], accepted: dict[str, int]) -> None:
        """What the last verification reached and kept, per layer (feeds `adaptive`)."""
        self.tracker.update(tested, accepted)

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               top: Sequence[Sequence[int]], stats=None, probs=None) -> None:
        """A verification forward's predictions (see RecycledTable.record), for layers that learn
        from them: top[i] is node i's best tokens, best first (record_k of them), probs[i] their
        probabilities under sampling (None when greedy)."""
        for layer in self.recording:
            t0 = time.perf_counter()
            layer.record(before, tokens, parents, top, probs)
            if stats is not None:
                stats.layer(layer.name).seconds += time.perf_counter() - t0

    @property
    def record_k(self) -> int:
        """How many best tokens per node the recording layers keep."""
        return max([layer.top_k for layer in self.recording] or [1])

    @property
    def records(self) -> bool:
        return bool(self.recording)

    def _ask(self, layer, history, max_len, slots, stats) -> list[Draft]:
        length = min(max_len, self.layer_len(layer.name))
        t0 = time.perf_counter()
        cands = layer.candidates(history, length, slots) if length > 0 and slots > 0 else []
        if stats is not None:
            stats.layer(layer.name).record_query(cands, time.perf_counter() - t0)
        # a layer returns token lists, or Drafts where it knows the target's probabilities (recycle)
        # (its own name, or a tag of its own such as 'recycle:next', tracked apart)
        return clamped([Draft(tuple(c.tokens), c.layer or layer.name, p=c.p) if isinstance(c, Draft)
                        else Draft(tuple(c), layer.name) for c in cands], length)   # a layer may ignore length

    def propose(self, history: Sequence[int], max_len: int | None = None,
                stats=None) -> list[Draft]:
        max_len = self.max_len if max_len is None else min(max_len, self.max_len)
        if max_len <= 0:
            return []
        C = self.max_candidates
        if self.policy == "first-hit":
            for layer in self.layers:
                got = self._ask(layer, history, max_len, C, stats)
                if got:
                    return got
            return []
        if self.policy in ("fill", "fill-tracked"):
            # a layer whose drafts carry the target's probabilities (`priced`: recycle under
            # sampling) is priced exactly by them (tree.node_estimates), so it takes no slot of the
            # C the other layers share: its candidates go after theirs, in the same tree
            out: list[Draft] = []
            priced: list[Draft] = []
            for layer in self.layers:
                if getattr(layer, "priced", False):
                    priced += self._ask(layer, history, max_len, C, stats)
                elif len(out) < C:
                    out += self._ask(layer, history, max_len, C - len(out), stats)
            return out + priced
        # adaptive: order the layers by how well their first token is accepted now, and let each
        # draft as deep as its candidates stay likely (depth_for)
        ranked = sorted(self.layers, key=lambda l: -self.rate(l.name))
        found: list[list[Draft]] = []
        for layer in ranked:
            found.append(self._ask(layer, history, min(max_len, self.depth_for(layer.name)), C, stats))
        # every layer that matched gets one slot, the slots left go to the best layers' next
        # candidates; the output keeps the ranking (best layer first) as the order children are tried
        quota = [min(1, len(got)) for got in found]
        spare = C - sum(quota)
        while spare < 0:  # more matching layers than slots: the worst matching one goes
            last = max(i for i, q in enumerate(quota) if q)
            quota[last], spare = 0, spare + 1
        for i, got in enumerate(found):
            extra = min(spare, len(got) - quota[i])
            quota[i] += extra
            spare -= extra
        return [d for got, q in zip(found, quota) for d in got[:q]]

"""What the decode loop asks of a drafter, and the draft it gets back.

The engine knows drafters only through this interface; hdcli.drafting (the database hierarchy)
and hdcli.hsd.stack (draft models stacked over it) implement it.

    class Drafter:
        def reset(self, tokens) -> None                      # a new request: the prompt tokens
        def extend(self, tokens) -> None                     # tokens appended to the history
        def propose(self, history, max_len, stats) -> list[Draft]   # best first
        def rate(self, layer, depth, first_child) -> float   # per-token acceptance estimate
        def observe(self, tested, accepted) -> None          # what the last verification kept
        records: bool                                        # wants every forward's predictions ...
        record_k: int                                        # ... this many best tokens per node,
        def record(self, before, tokens, parents, top, stats, probs)  # ... given here (top[i], best
                                                             # first; probs[i] theirs when sampling)
        def record_target(self, proposed, accepted) -> None  # a step's drafted and accepted node counts

The last four have defaults (records False, record_k 1, record and record_target do nothing): a
drafter that subclasses Drafter inherits them; the loop calls every method above, probing none.

Invariant: a drafter proposes; only the target's verification decides what is kept, so no
drafter can change greedy output (tests/test_exactness.py, tests/test_tree.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    layer: str
    # the distribution each token was drawn from, [len(tokens), V], when a draft model sampled it
    # (hdcli.hsd.stack); None for point masses (database layers, greedy)
    q: object = field(default=None, compare=False, repr=False)
    # the drafter's estimate of the target's probability of each token, where it knows one (the
    # recycle layer under sampling: recorded from the target's own rows, verify.top_probs); the
    # tree prices such a node by it instead of the layer's rate (tree.node_estimates)
    p: tuple[float, ...] | None = field(default=None, compare=False, repr=False)



def clamped(drafts: Sequence[Draft], max_len: int, vocab: int | None = None) -> list[Draft]:
    """Drafts cut to max_len tokens and before their first id outside [0, vocab), empty ones
    dropped: the decode loop never verifies past the room it asked for, whatever a drafter (a
    custom one included) returns, so the output never grows past max_new_tokens; and no drafted id
    reaches the embedding it would index out of range (a damaged DB, a drafter of another model)."""
    out = []
    for d in drafts:
        keep = max(max_len, 0)
        if vocab is not None:
            keep = next((i for i, t in enumerate(d.tokens[:keep]) if not 0 <= t < vocab), keep)
        if len(d.tokens) > keep:
            d = Draft(tuple(d.tokens[:keep]), d.layer, None if d.q is None else d.q[:keep],
                      None if d.p is None else d.p[:keep])
        if d.tokens:
            out.append(d)
    return out


def base_name(layer: str | None) -> str:
    """'stats:wiki' -> 'stats' (several statistics DBs share the stats settings)."""
    return (layer or "").split(":", 1)[0]



def bucket(depth: int, first_child: bool) -> int:
    """0: a later sibling; 1, 2, 3: a first child at depth 1, 2, 3 or more."""
    return min(depth, 3) if first_child else 0


class Drafter(Protocol):
    """See the module docstring; drafting.Hierarchy, drafting.suffix.SuffixDrafter and
    hsd.stack.ModelStack implement it."""

    records: bool = False
    record_k: int = 1

    def reset(self, tokens: Sequence[int]) -> None: ...
    def extend(self, tokens: Sequence[int]) -> None: ...
    def propose(self, history: Sequence[int], max_len: int, stats=None) -> list[Draft]: ...
    def rate(self, layer: str | None, depth: int = 1, first_child: bool = True) -> float: ...
    def observe(self, tested: dict, accepted: dict) -> None: ...

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               top: Sequence[Sequence[int]], stats=None, probs=None) -> None:
        """The target's best tokens at every node of a verification forward (where records), and
        under sampling their probabilities (verify.top_probs; None when greedy)."""

    def record_target(self, proposed: int, accepted: int) -> None:
        """How many nodes a step drafted and how many the target accepted."""

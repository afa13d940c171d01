"""Statistics of one generation: per drafting layer and per decode step.

Definitions (the ones Spec-Bench uses, so figures compare with published tables):
  accepted length of a step = drafted tokens the target kept + 1 (its own next token);
  mean accepted tokens      = mean accepted length over all steps;
  hit rate of a layer       = queries where it proposed something / queries it received;
  acceptance rate           = drafted tokens of the layer kept / drafted tokens of the layer verified.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LayerStats:
    name: str
    queries: int = 0     # times the hierarchy asked this layer
    hits: int = 0        # ... and it proposed at least one candidate
    candidates: int = 0  # candidates it proposed
    won: int = 0         # steps whose accepted path ended in a node it drafted
    drafted: int = 0     # its tokens sent to the target for verification (tree nodes it created)
    accepted: int = 0    # its tokens the target kept
    # Under the tree merge a token two layers drafted is the earlier layer's node, so `drafted`
    # and `accepted` are what this layer adds beyond the layers asked before it (its marginal part).
    seconds: float = 0.0  # time in its candidates (and, for layers that learn from forwards, record)

    def record_query(self, cands, seconds: float = 0.0) -> None:
        self.queries += 1
        self.seconds += seconds
        if cands:
            self.hits += 1
            self.candidates += len(cands)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "acceptance_rate": self.acceptance_rate}


@dataclass
class RunStats:
    layers: dict[str, LayerStats] = field(default_factory=dict)
    accept_lengths: list[int] = field(default_factory=list)  # one entry per decode step
    tree_sizes: list[int] = field(default_factory=list)      # drafted nodes verified per step
    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_seconds: float = 0.0     # whole generation, prefill included
    prefill_seconds: float = 0.0
    cached_tokens: int = 0        # prompt tokens restored from the prefix cache (engine/decode/prefix.py)
    draft_seconds: float = 0.0        # asking the layers and building the tree
    forward_seconds: float = 0.0      # the target's verification forwards (after prefill)
    bookkeeping_seconds: float = 0.0  # acceptance, KV cache crop, statistics, layer updates
    grammar_seconds: float = 0.0      # under a grammar: masking rows, cutting drafts (engine/text/constrain.py)
    grammar_rows: int = 0             # ... rows masked
    governed_steps: int = 0           # steps the governor left undrafted (engine/decode/governor.py)

    def layer(self, name: str) -> LayerStats:
        if name not in self.layers:
            self.layers[name] = LayerStats(name)
        return self.layers[name]

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 0.0

    @property
    def draft_tokens(self) -> dict:
        """Drafted tokens the target verified (every step's tree past its root), those it accepted
        and those it did not (wasted: verified for nothing, the price of speculation)."""
        verified = sum(self.tree_sizes)
        accepted = sum(s.accepted for s in self.layers.values())
        return {"verified": verified, "accepted": accepted, "wasted": verified - accepted}

    @property
    def overhead_share(self) -> float:
        """Share of the decode steps' time spent outside the target's forward pass."""
        steps = self.draft_seconds + self.forward_seconds + self.bookkeeping_seconds
        return (self.draft_seconds + self.bookkeeping_seconds) / steps if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "mean_accepted_tokens": self.mean_accepted, "tokens_per_second": self.tokens_per_second,
            "wall_seconds": self.wall_seconds, "prefill_seconds": self.prefill_seconds,
            "mean_tree_size": self.mean_tree_size, "draft_tokens": self.draft_tokens, "draft_seconds": self.draft_seconds,
            "forward_seconds": self.forward_seconds, "bookkeeping_seconds": self.bookkeeping_seconds,
            "overhead_share": self.overhead_share,
            "grammar_seconds": self.grammar_seconds, "grammar_rows": self.grammar_rows,
            "governed_steps": self.governed_steps,
            "accept_lengths": self.accept_lengths, "tree_sizes": self.tree_sizes,
            "layers": {k: v.to_dict() for k, v in self.layers.items()},
        }

"""A hierarchy of draft models (Hierarchical Speculative Decoding) on top of the database level.

Levels, cheapest first: level 0 is the database hierarchy (hdcli.drafting: one chain of point
masses per call), or nothing (`--no-db`: the smallest model then drafts on its own, one token per
forward); then the draft models, smallest first; the target verifies last (hdcli.engine.decode).

A model level, asked for a batch of T tokens after a context, repeats: ask the level below for a
batch (at most T - held - 1 tokens), verify it in one forward of its own model over its own KV
cache, keep the accepted prefix plus its own correction or bonus token; it returns the first T
tokens once it holds at least T. Lower levels always draft from the newest context (the
history plus what this level holds), so after a rejection they re-draft from the correction.

Losslessness. Each level verifies with the rule that makes its output exactly its own
distribution p_i: greedy, argmax matching; sampling, the point-mass rule for a database batch
(verify.sample_point_masses) and min(1, p_i/q) with the residual max(0, p_i - q) for a model
batch (verify.sample_with_draft). A level's batch is therefore a sample of p_i, and it hands up
p_i's rows as the draft distribution q of each token, so the level above, and finally the
target, verify with the standard rule: the output has exactly the target's distribution.

Invariant of a level's cache: it holds the K/V of `seq` (every token of it). A call first keeps
the longest common prefix of `seq` and the new context (at least one context token is re-fed,
so the forward yields the prediction after the context), then feeds the rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..drafting import Hierarchy
from ..engine.decode.draft import Draft, Drafter
from ..engine.model.target import as_target
from ..engine.decode.verify import Sampling, sample_point_masses, sample_with_draft, target_probs


@dataclass
class LevelStats:
    name: str
    calls: int = 0          # batches asked of this level
    proposed: int = 0       # tokens it handed to the level above
    accepted: int = 0       # ... that the level above kept
    forwards: int = 0       # its own model forwards
    seconds: float = 0.0    # time inside this level, lower levels excluded

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "calls": self.calls, "proposed": self.proposed,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "forwards": self.forwards, "seconds": self.seconds}


class NoDraft:
    """The empty level under the smallest model with --no-db: it drafts nothing, so that model
    produces one token per forward (autoregressive drafting)."""
    name = "none"

    def __init__(self):
        self.stats = LevelStats("none")

    def reset(self, tokens):
        pass

    def extend(self, tokens):
        pass

    def batch(self, context, max_len, gen):
        return [], None


class DbLevel:
    """The database hierarchy as the bottom level: its best chain, as point masses (q None)."""

    def __init__(self, hierarchy: Hierarchy):
        self.hier = hierarchy
        self.name = "db"
        self.stats = LevelStats("db")

    def reset(self, tokens):
        self.hier.reset(tokens)

    def extend(self, tokens):
        self.hier.extend(tokens)

    def batch(self, context, max_len, gen):
        t0 = time.perf_counter()
        self.stats.calls += 1
        drafts = self.hier.propose(context, max_len) if max_len > 0 else []
        self.stats.seconds += time.perf_counter() - t0
        return (list(drafts[0].tokens) if drafts else []), None


class ModelLevel:
    def __init__(self, name: str, model, T: int, below, sampling: Sampling):
        if T < 1:
            raise ValueError("a level's batch size T must be >= 1")
        self.name, self.model, self.T, self.below, self.s = name, as_target(model), T, below, sampling
        self.stats = LevelStats(name)
        self.device = self.model.device
        self.reset([])

    def reset(self, tokens):
        self.cache = self.model.new_cache()
        self.seq: list[int] = []
        self.below.reset(tokens)

    def extend(self, tokens):
        self.below.extend(tokens)

    def _logits(self, context: list[int], draft: list[int]) -> torch.Tensor:
        """Rows: the prediction after context, then after each draft token (cache: context+draft)."""
        n = 0
        limit = min(len(self.seq), len(context) - 1)
        while n < limit and self.seq[n] == context[n]:
            n += 1
        remove = self.cache.get_seq_length() - n
        if remove > 0:
            self.cache.crop(-remove)
        feed = context[n:] + draft
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        logits = self.model.forward(ids, self.cache)
        self.seq = context + draft
        self.stats.forwards += 1
        return logits[len(context) - n - 1:].float()

    @torch.inference_mode()
    def batch(self, context: list[int], max_len: int, gen) -> tuple[list[int], list | None]:
        """Up to min(T, max_len) tokens continuing context, and the distribution of each (None
        when greedy)."""
        want = min(self.T, max_len)
        self.stats.calls += 1
        buf: list[int] = []
        rows: list = []
        while len(buf) < want:
            draft, q = self.below.batch(context + buf, want - len(buf) - 1, gen)
            t0 = time.perf_counter()
            logits = self._logits(context + buf, draft)
            if self.s.greedy:
                targets = logits.float().argmax(-1).tolist()   # fp32: see verify.accept_tree
                n = 0
                while n < len(draft) and draft[n] == targets[n]:
                    n += 1
                new = draft[:n] + [targets[n]]
            else:
                probs = target_probs(logits, self.s)
                new = []
                for i, x in enumerate(draft):
                    if q is None:
                        tok, won = sample_point_masses(probs[i], (x,), gen)
                        ok = won is not None
                    else:
                        tok, ok = sample_with_draft(probs[i], x, q[i], gen)
                    new.append(tok)
                    if not ok:
                        break
                else:
                    new.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen)))
                n = len(new) - 1
                rows += [probs[i] for i in range(len(new))]
            self.below.stats.proposed += len(draft)
            self.below.stats.accepted += n
            # keep the cache on context + buf + the accepted draft tokens (the new last token is
            # fed by the next call, like the target's own token in the decode loop)
            keep = len(context) + len(buf) + n
            self.seq = self.seq[:keep]
            remove = self.cache.get_seq_length() - keep
            if remove > 0:
                self.cache.crop(-remove)
            buf += new
            self.stats.seconds += time.perf_counter() - t0
        return buf[:want], (rows[:want] if not self.s.greedy else None)


class ModelStack(Drafter):
    """The drafter of `hd generate --draft-models`: the top model level's batch as one chain.

    levels: draft models smallest first as (name, model, T); base: a Hierarchy (database level)
    or None (--no-db)."""

    def __init__(self, levels: Sequence[tuple[str, object, int]], base: Hierarchy | None,
                 sampling: Sampling, seed: int = 0):
        if not levels:
            raise ValueError("a model stack needs at least one draft model")
        below = DbLevel(base) if base is not None else NoDraft()
        self.all_levels = [below]
        for name, model, T in levels:
            below = ModelLevel(name, model, T, below, sampling)
            self.all_levels.append(below)
        self.top = below
        self.seed, self.requests = seed, 0
        self.gen = torch.Generator(device=self.top.device)
        self.target_stats = LevelStats("target")

    def reset(self, tokens):
        self.gen.manual_seed(self.seed + self.requests)
        self.requests += 1
        self.top.reset(tokens)

    def extend(self, tokens):
        self.top.extend(tokens)

    def propose(self, history, max_len=None, stats=None) -> list[Draft]:
        max_len = self.top.T if max_len is None else max_len
        if max_len <= 0:
            return []
        tokens, rows = self.top.batch(list(history), max_len, self.gen)
        if stats is not None:
            stats.layer(self.top.name).record_query([tokens] if tokens else [])
        if not tokens:
            return []
        q = torch.stack(rows) if rows is not None else None
        return [Draft(tuple(tokens), self.top.name, q=q)]

    def rate(self, layer, depth=1, first_child=True) -> float:
        return 1.0  # a stack's batch size is planned (hd plan), not capped per step

    def observe(self, tested, accepted) -> None:
        pass

    def record_target(self, proposed: int, accepted: int) -> None:
        self.top.stats.proposed += proposed
        self.top.stats.accepted += accepted

    def level_stats(self) -> list[dict]:
        return [lv.stats.to_dict() for lv in self.all_levels]

"""The model layer: what the target itself wrote before, matched on long suffixes.

A model DB (hd build-model-db) keeps the target's answers whole. They go into one suffix tree
(arctic-inference's, the structure of SuffixDecoding) held in memory for the life of the process;
each step the longest suffix of the history (up to `depth` tokens) that occurs in those answers
is matched, and the tree of what followed it, weighted by how often, is drafted. A long match
seen once is strong evidence: the target's greedy answer to a similar request continues the way
it did before, so a single observation of a 20-token match drafts with probability 1, where the
n-gram tables (keys of at most 4 tokens) discount it (stats.StatsLayer). On unseen questions the
two draft within noise of each other from the same answers (benchmarks/tuning/hierarchy_replay.py,
docs/benchmarks.md "The hierarchy, layer by layer"); the index learns in memory, with no DB write.

The index also grows with every answer generated in this process (each layer adds its request's
tokens as they are accepted), so what one request taught is drafted for the next, as
SuffixDecoding's global tree does; `--learn` also writes finished answers into the DB file
(db.modeldb.learn) so they are there after a restart.

Without a model DB the layer drafts from this process's answers alone (`process_answers`: an
index that starts empty), SuffixDecoding's global tree: a server, an API user or a bench run
learns from what the target wrote for earlier requests (hd serve keeps them per scope,
serve/tenants.py); a single `hd generate` has none and the layer drafts nothing. Replayed on the
tuning set it raised hd's mean accepted tokens 6% (docs/benchmarks.md, "The model layer learns
without a DB").

Where arctic-inference is not installed, or the DB keeps no answers (built by an older hd), the
layer is the n-gram table of the same DB (stats.StatsLayer), as before; without a DB and without
arctic-inference there is no model layer.

Parameters (AnswerIndex)
  depth            longest suffix matched (SuffixDecoding's max_tree_depth)
  min_token_prob   a drafted token's estimated probability (count of the continuation / count of
                   the match) at least this, along the whole path
  max_spec_factor  at most factor * match length tokens drafted: a short match drafts little
  max_answers      answers kept; beyond it the oldest are dropped first (FIFO, the library's);
                   an index of a process's answers alone keeps MEMORY_ANSWERS
Invariants
  the index holds every answer of the DB (in file order) followed by the answers of this process;
  each ModelLayer appends its request's accepted tokens to one answer of its own, which is
  closed (stays in the index, takes no more tokens) when the layer is garbage collected.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Sequence

from .registry import LayerSpec, register
from .stats import StatsLayer
from .suffix import tree_paths

# Answers an index without a DB keeps, the oldest dropped first, so that a long-running server's
# memory stays bounded: the suffix tree takes ~300 bytes a token (1,000 answers of 256 random
# tokens: 78 MB), so the process's own index keeps MEMORY_ANSWERS, each of hd serve's scopes
# (up to 256 of them, serve/tenants.py) SCOPE_ANSWERS
MEMORY_ANSWERS = 1000
SCOPE_ANSWERS = 64


def available() -> bool:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
        return True
    except ImportError:
        return False


class AnswerIndex:
    """The target's answers in one suffix tree (arctic-inference's SuffixDecodingCache, whose
    global tree holds the responses of its requests; one request with an empty prompt is kept
    open to ask it)."""

    def __init__(self, answers=(), depth: int = 24, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, max_answers: int = 1 << 20):
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.depth, self.min_token_prob, self.max_spec_factor = depth, min_token_prob, max_spec_factor
        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=max_answers)
        self._ids = itertools.count()
        for a in answers:
            self.add(a)
        self._query = self.open()

    def open(self):
        """A new answer, empty: append to it with append(id, tokens)."""
        rid = next(self._ids)
        self.cache.start_request(rid, [])
        return rid

    def append(self, rid, tokens: Sequence[int]) -> None:
        if tokens and rid in self.cache.active_requests:
            self.cache.add_active_response(rid, [int(t) for t in tokens])

    def close(self, rid) -> None:
        if rid in self.cache.active_requests:
            self.cache.stop_request(rid)

    def add(self, tokens: Sequence[int]) -> None:
        rid = self.open()
        self.append(rid, list(tokens))
        self.close(rid)

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int) -> list[list[int]]:
        if max_len <= 0 or not history:
            return []
        d = self.cache.speculate(self._query, [int(t) for t in history[-self.depth:]],
                                 max_spec_tokens=max_len, max_spec_factor=self.max_spec_factor,
                                 max_spec_offset=0.0, min_token_prob=self.min_token_prob,
                                 use_tree_spec=True)
        return tree_paths(d.token_ids, d.parents)[:max_candidates]


_PROCESS: list = []


def new_answers(store=None) -> AnswerIndex:
    """A new index of a model DB's answers, or without one an empty index of MEMORY_ANSWERS."""
    return AnswerIndex(store.sequences()) if store is not None else AnswerIndex(max_answers=MEMORY_ANSWERS)


def process_answers() -> AnswerIndex:
    """This process's own answers, where no model DB is given (made on first use): what the
    model layer drafts from and grows."""
    if not _PROCESS:
        _PROCESS.append(new_answers())
    return _PROCESS[0]


def index_for(store) -> AnswerIndex:
    """The one AnswerIndex of an open model DB's shared answers (built on first use, kept on the
    Store object; a tenant's answers are never in it, see ScopedAnswers)."""
    index = getattr(store, "answer_index", None)
    if index is None:
        index = AnswerIndex(store.sequences())
        store.answer_index = index
    return index


class ScopedAnswers:
    """One tenant's view of the answers (hd serve --learn-scope key|user): the DB's shared answers
    (`base`, read here, never grown) and the answers of this tenant alone (`own`: those learned for
    it before, then what its requests generate). A request opens and grows its answer in `own`, so
    what one tenant generated is never drafted for another (docs/serve.md, "Tenants")."""

    def __init__(self, base: AnswerIndex, own: AnswerIndex):
        self.base, self.own = base, own

    def open(self):
        return self.own.open()

    def append(self, rid, tokens: Sequence[int]) -> None:
        self.own.append(rid, tokens)

    def close(self, rid) -> None:
        self.own.close(rid)

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int) -> list[list[int]]:
        """The tenant's own matches first (the most specific), then the shared ones."""
        paths = self.own.candidates(history, max_len, max_candidates)
        if len(paths) < max_candidates:
            paths += [p for p in self.base.candidates(history, max_len, max_candidates) if p not in paths]
        return paths[:max_candidates]


class ModelLayer:
    """Drafts from an AnswerIndex (or a tenant's ScopedAnswers) and adds its request's answer to it."""

    name = "model"

    def __init__(self, index: AnswerIndex):
        self.index = index
        self.answer = None

    def reset(self, tokens: Sequence[int]) -> None:
        if self.answer is not None:
            self.index.close(self.answer)
        self.answer = self.index.open()
        weakref.finalize(self, self.index.close, self.answer)

    def extend(self, tokens: Sequence[int]) -> None:
        if self.answer is not None:
            self.index.append(self.answer, tokens)

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        return self.index.candidates(history, max_len, max_candidates)


def uses_answers(store) -> bool:
    """Whether the model layer of this DB drafts from its answers (else from its n-gram table)."""
    return store is not None and store.sequence_count > 0 and available()


def drafts_answers(store) -> bool:
    """Whether the model layer drafts from answers: a model DB's (uses_answers) or, without a DB,
    this process's (where arctic-inference is installed)."""
    return uses_answers(store) if store is not None else available()


def _model_layers(s) -> list:
    if s.model_db is None:   # this process's answers alone (none where arctic-inference is missing)
        return [ModelLayer(s.answer_index or process_answers())] if available() else []
    if uses_answers(s.model_db):
        return [ModelLayer(s.answer_index or index_for(s.model_db))]
    return [StatsLayer(s.model_db, name="model", min_prob=s.min_prob, min_expected=s.min_expected)]


register(LayerSpec(
    name="model", rank=20, prior=(0.1, 0.4, 0.4, 0.6), style="cyan", short="mdl",
    help="model layer only (the target's own earlier answers, matched on long suffixes: the model DB's "
         "where given, and this process's)",
    build=_model_layers, in_default=lambda s: True))

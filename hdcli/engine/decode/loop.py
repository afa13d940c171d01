"""The decode loop: draft, verify every drafted token in one target forward, accept, crop, repeat.

Each step the hierarchy proposes candidates; they are merged into a token tree rooted at the
last history token and capped by cost (hdcli/engine/decode/tree.py); one forward over the tree gives the
target's prediction after every node; the acceptance rule (hdcli/engine/decode/verify.py) walks the tree.

KV-cache invariant: at the top of each step the cache holds every history token except the
last one (`last`, the tree's root), which is fed as the first input of the step together with
the tree. After the forward the cache holds history + every tree node; keep_path moves the
accepted path's entries next to `last` and drops the rest, so a rejected token or branch never
stays in the cache. The target's own next token becomes `last` for the next step.

One step reads top to bottom in `speculative_steps` (propose: draft, build and cap the tree;
forward; accept: verify, commit to the cache, update the layers), over several streams whose trees
share one forward (`hd serve`'s every turn) or over one (`speculative_step`, `hd generate`).

With no drafter this is plain autoregressive decoding with the same model and cache (the `ar`
baseline every speedup is measured against).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from ..kernels import invariant
from ..model.target import TargetModel, as_target
from .draft import Draft, Drafter, clamped
from .prefix import prefill_pieces
from .request import Request
from .stats import RunStats
from ..text.constrain import FORCED_RATE
from ..text.prompts import stop_checker
from .costs import CostCurve
from .prediction import Prediction
from . import batch
from .governor import Governor
from .tree import Tree, build_tree, cap_jointly, keep_path, node_estimates, reached
from .verify import (accept_chain_q, accept_tree, logprobs_of, processed, sampling_key, top_probs,
                     top_tokens)

# on_tokens(tokens, layers): called after each step with the new tokens and, per token, the name
# of the layer that drafted it (None for the target's own token).
TokenCallback = Callable[[list[int], list[str | None]], None]


@dataclass
class Generation:
    tokens: list[int]            # new tokens, EOS included when it ended the generation
    layers: list[str | None]     # per token: the drafting layer, or None for the target's own
    stop_reason: str             # "eos" | "length" | "stop"
    stats: RunStats = field(default_factory=RunStats)
    # per token, where asked (logprobs=k): its log-probability and the k best (token, log-probability)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prediction_usage: dict | None = None   # with a predicted output: Stream.prediction_usage()


class Decoder:
    """Speculative decoding of one sequence with a target model and a drafting hierarchy.

    model: a TargetModel (engine/model/target.py), or a transformers model (wrapped here in its
    adapter). cost: the target's forward-cost curve (hdcli.engine.decode.costs) that caps each
    step's draft tree; None sends every drafted node (up to max_nodes)."""

    def __init__(self, model: TargetModel, eos_ids: Sequence[int] = (), drafter: Drafter | None = None,
                 cost: CostCurve | None = None, max_nodes: int = 63, prefix=None, tokenizer=None):
        self.model = model = as_target(model)
        self.tokenizer = tokenizer   # where given, a request's stop strings end its output
        self.prefix = prefix   # engine/decode/prefix.PrefixCache (hd serve), or None
        self.eos_ids = set(int(e) for e in eos_ids)
        self.drafter = drafter
        self.cost, self.max_nodes = cost, max_nodes
        if model.invariant and max_nodes + 1 > invariant.MAX_ROWS:
            raise ValueError(f"the M-invariant forward verifies at most {invariant.MAX_ROWS - 1} nodes a step")
        self.device = model.device
        self.vocab_size = int(model.config.vocab_size)   # the embedding's rows: drafts never name an id past them

    def _prefill(self, ids: Sequence[int], cache, scope: str = "") -> int:
        """Fill the cache with ids. No logits are needed (the last prompt token is fed with the
        first step): the model's prefill (hd's own forward computes the keys and values only,
        transformers' its head on one row, target.TransformersForward). Every prefill of plain,
        speculative and served decoding goes through here. With a prefix cache, the longest prefix of ids that
        `scope` stored is restored and the rest computed (engine/decode/prefix.py). Returns how many
        tokens came from the prefix cache.

        In the M-invariant mode every prefill is split-invariant, in causal pieces of at most
        invariant.MAX_ROWS rows (prefix.prefill_pieces), cache or not: so `hd generate`, `hd serve`
        with and without its prefix cache write the same keys for a prompt on any machine (one
        forward of all a prompt's rows takes SDPA where the fused attention is off, and Linear
        widths the mode never calibrated), at a small price on a long prefill."""
        if self.prefix is not None:
            return self.prefix.prefill(self.model, ids, cache, scope)
        if self.model.invariant:
            prefill_pieces(self.model, ids, cache)
        else:
            self.model.prefill(torch.tensor([list(ids)], dtype=torch.long, device=self.device), cache)
        return 0

    @torch.inference_mode()
    def generate(self, request: Request | Sequence[int], on_tokens: TokenCallback | None = None,
                 **fields) -> Generation:
        """Decode one request (engine/decode/request.py: prompt, max_new_tokens, sampling, seed
        and choice, stop, logprobs, grammar, prediction), or prompt ids with those fields by name.
        on_tokens hears each step's new tokens. Sampled output is keyed by (seed, choice index,
        output position): the same seed gives the same tokens with or without drafts
        (verify.coupled_choice)."""
        s = self.stream(request, on_tokens=on_tokens, **fields)
        while not s.done:
            speculative_step(self.model, s)
        return s.result()

    @torch.inference_mode()
    def stream(self, request: Request | Sequence[int], *, on_tokens: TokenCallback | None = None,
               drafter: Drafter | None | str = "own", **fields) -> "Stream":
        """A generation to be stepped by the caller (generate() steps one; a server steps many and
        verifies their trees in one forward, hdcli/engine/decode/batch.py). The prompt is prefilled here.
        request: as generate takes it. drafter: this one's own ("own"), or another (one per
        concurrent stream: drafters keep per-generation state)."""
        request = Request.of(request, **fields)
        stop_check = None if self.tokenizer is None else stop_checker(self.tokenizer, request.stop)
        return Stream(self, request, stop_check, on_tokens, self.drafter if isinstance(drafter, str) else drafter)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ (or where the shorter ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Stream:
    """One generation between steps: its cache, history, drafter and output.

    Each step is propose() (draft, then plan: merge the candidates into a tree capped by cost and
    by max_nodes), a forward over the tree (speculative_steps runs it, shared with other streams
    where the model batches: batch.forward_many), then accept(logits) (verify, keep_path,
    advance). Rows of a forward depend only on their own path in the M-invariant mode, so a
    stream's tokens are the same whatever is verified beside it."""

    @torch.inference_mode()
    def __init__(self, decoder: Decoder, request: Request, stop_check=None,
                 on_tokens: TokenCallback | None = None, drafter: Drafter | None = None):
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not request.speculation.drafts:   # the request's own: plain decoding
            drafter = None
        self.decoder, self.drafter, self.request = decoder, drafter, request
        self.max_new_tokens, self.sampling = request.max_new_tokens, request.sampling
        self.stop_check, self.on_tokens = stop_check, on_tokens
        sampling, seed, prompt_ids = request.sampling, request.seed, request.prompt_ids
        # sampling: the output position's uniform under this key chooses the target's token
        # (verify.coupled_choice); a generator only for an unseeded draft model's chain, verified
        # with its q (min(1, p/q): more often kept than a point mass, but not seed-coupled)
        self.key = sampling_key(seed, request.choice) if not sampling.greedy else 0
        self.gen = None
        if not sampling.greedy and seed is None:
            self.gen = torch.Generator(device=decoder.device)
            self.gen.manual_seed(torch.seed())
        self.stats = RunStats(prompt_tokens=len(prompt_ids))
        self.t_start = time.perf_counter()
        self.cache = decoder.model.new_cache()
        self.history = [int(t) for t in prompt_ids]
        self.scope = request.scope
        if len(self.history) > 1:
            self.stats.cached_tokens = decoder._prefill(self.history[:-1], self.cache, request.scope)
        self.stats.prefill_seconds = time.perf_counter() - self.t_start
        if drafter is not None:
            drafter.reset(self.history)
        self.trees_ok = self.cache.supports_trees()
        self.out: list[int] = []
        self.out_layers: list[str | None] = []
        self.logprobs = request.logprobs
        self.out_logprobs: list | None = [] if request.logprobs is not None else None
        self.stop_reason = "length"
        self.done = False
        self.tree: Tree | None = None
        self._q_rows = None
        self._t_propose = self._t_drafted = 0.0
        self.estimates: list[float] = [1.0]   # per node of an uncapped proposal (scheduler joint cap)
        # the top of the hierarchy, per request: the grammar (its mask on every row; its forced
        # tokens drafted first) and the predicted output. Plain decoding (no drafter, no
        # prediction) drafts nothing: the grammar only masks.
        self.grammar = request.grammar.start() if request.grammar is not None else None
        self.prediction = Prediction(request.prediction) if request.prediction else None
        self.speculates = request.speculation.drafts and (drafter is not None or self.prediction is not None)
        # whether drafting pays, judged on this request's own clock (engine/decode/governor.py)
        self.governor = Governor() if self.speculates and request.speculation.governed else None
        self.drafting = self.speculates   # whether this step drafts (the governor's call)

    def propose(self, max_nodes: int | None = None, capped: bool = True) -> Tree:
        """Draft at most the room left and build this step's tree (root token: history[-1]);
        max_nodes caps it below the decoder's (a scheduler sharing one forward's rows). capped
        False: the tree is not cut by cost here (a scheduler cuts several streams' trees together,
        tree.cap_jointly, then calls restrict); `estimates` then holds its nodes' estimates."""
        return self.plan(self.draft(max_nodes), max_nodes, capped)

    def _cap(self, max_nodes: int | None) -> int:
        """Most drafted nodes this step: the decoder's, the caller's and the request's own cap."""
        cap = self.decoder.max_nodes if max_nodes is None else min(max_nodes, self.decoder.max_nodes)
        own = self.request.speculation.max_draft
        return cap if own is None else min(cap, own)

    def draft(self, max_nodes: int | None = None) -> list[Draft]:
        """The step's candidates, best first, within the room left (_drafts)."""
        assert not self.done and self.tree is None, "accept() the last step first"
        self._t_propose = time.perf_counter()
        room = self.max_new_tokens - len(self.out) - 1
        self.drafting = self.speculates and (self.governor is None or self.governor.drafts())
        drafts = self._drafts(room) if self.drafting and self._cap(max_nodes) > 0 else []
        self._q_rows = drafts[0].q if drafts else None
        return drafts

    def plan(self, drafts: list[Draft], max_nodes: int | None = None, capped: bool = True) -> Tree:
        """The candidates merged into this step's tree and capped by cost and max_nodes (propose)."""
        cap = self._cap(max_nodes)
        rate = self._rate if self.grammar is not None or self.prediction is not None else (
            self.drafter.rate if self.drafter else None)
        if self._q_rows is not None:  # a draft model's sampled chain: verified with its distribution
            tree = build_tree(drafts[:1], None, None, cap)
        else:
            tree = build_tree(drafts, rate, self.decoder.cost if capped else None, cap, self.trees_ok)
        if not capped:   # for the caller's joint cap; a capped tree's were used in build_tree
            if self._q_rows is not None:   # a draft model's chain: sent whole (its rows of q go with it)
                self.estimates = [1.0] * (tree.size() + 1)
            else:
                self.estimates = node_estimates(tree, rate) if rate and tree.size() else [1.0]
        self.stats.draft_seconds += time.perf_counter() - self._t_propose
        self._t_drafted = time.perf_counter()
        self.tree = tree
        return tree

    def _drafts(self, room: int) -> list[Draft]:
        """The step's candidates, best first: the grammar's forced tokens, then the prediction's
        and the drafter's candidates continuing after them in the same tree. Each is cut to the
        room left, before an id outside the vocabulary and, under a grammar, before the first token
        it forbids (never verified). Under a grammar a draft model's sampled chain is verified as
        point masses (its q dropped): the point-mass rule is exact given the drafted tokens, so a
        cut that depends on them keeps it exact, which the min(1, p/q) rule would not be."""
        if not self.speculates:
            return []
        vocab = self.decoder.vocab_size
        lead = tuple(self.grammar.forced(room)) if self.grammar is not None else ()
        rest = room - len(lead)
        drafts = [Draft(lead, "grammar")] if lead else []
        if self.prediction is not None and rest > 0:
            got = self.prediction.peek(self.out, lead, rest) if lead else self.prediction.propose(rest)
            if got:
                drafts.append(Draft(lead + tuple(got), "prediction"))
        if self.drafter is not None and rest > 0:
            history = self.history + list(lead) if lead else self.history
            for d in clamped(self.drafter.propose(history, rest, self.stats), rest, vocab):
                drafts.append(Draft(lead + d.tokens, d.layer, d.q if self.grammar is None else None,
                                    None if lead or d.p is None else d.p))
        drafts = clamped(drafts, room, vocab)
        if self.grammar is None:
            return drafts
        out = []
        for d in drafts:
            n = self.grammar.valid_prefix(d.tokens)
            if n:
                out.append(d if n == len(d.tokens) else Draft(d.tokens[:n], d.layer, p=None if d.p is None else d.p[:n]))
        return out

    def _rate(self, layer: str | None, depth: int = 1, first_child: bool = True) -> float:
        """Per-token acceptance estimates (tree.node_estimates) with the request's own layers."""
        if layer == "grammar":
            return FORCED_RATE
        if layer == "prediction":
            return self.prediction.rate()
        return self.drafter.rate(layer, depth, first_child) if self.drafter is not None else 0.0

    def prediction_usage(self) -> dict | None:
        """OpenAI's counts for a predicted output: accepted = output tokens the prediction drafted
        and the target kept; rejected = the prediction's other tokens. None without a prediction."""
        if self.prediction is None:
            return None
        kept = self.stats.layers["prediction"].accepted if "prediction" in self.stats.layers else 0
        return {"accepted_prediction_tokens": kept,
                "rejected_prediction_tokens": max(0, len(self.prediction.tokens) - kept)}

    def restrict(self, keep: Sequence[int]) -> Tree:
        """Verify only these nodes of the proposed tree (closed under parent, root included)."""
        if len(keep) < len(self.tree.tokens):
            self.tree = self.tree.subtree(keep)
        return self.tree

    @torch.inference_mode()
    def accept(self, logits: torch.Tensor) -> list[int]:
        """Take the forward's logits [nodes, V] over the proposed tree (its nodes now in the cache):
        keep what the target accepts, crop the rest (verify, keep_path, advance). Returns the new
        tokens."""
        v = self.verify(logits)
        keep_path(self.cache, len(self.history) - 1, v.path)   # the root and the accepted path only
        return self.advance(v)

    def verify(self, logits: torch.Tensor) -> "Verified":
        """The acceptance rule (engine/decode/verify.py) over the proposed tree's logits [nodes, V].

        Greedy keeps the longest path from the root whose every token is the target's argmax after
        its parent, then adds the target's argmax after it. Sampling walks the same way with the
        target's sampled token at each node (the inverse CDF at its output position's uniform,
        verify.coupled_choice): a child x is kept with probability p(x), and seeded output is plain
        decoding's token for token. An unseeded draft model's chain (x drawn from q) is kept with
        probability min(1, p(x)/q(x)), else the token is drawn from norm(max(0, p - q)). Either way
        the output has the target's distribution. Penalties and biases process every row first,
        each with its own path's counts (verify.processed), so all of this holds for the processed
        distribution."""
        tree, drafter = self.tree, self.drafter
        self.tree = None
        t0 = time.perf_counter()
        self.stats.forward_seconds += t0 - self._t_drafted
        logits = processed(logits, self.sampling, self.out, tree.parents, tree.tokens)
        greedy = self.sampling.greedy
        # each row masked with its own path's grammar state; greedy decoding without
        # log-probabilities needs only each row's masked argmax (GrammarState.greedy_targets)
        lazy_mask = self.grammar is not None and greedy and self.out_logprobs is None
        if self.grammar is not None and not lazy_mask:
            logits = self.grammar.masked(logits, tree.children, tree.tokens)
        records = drafter is not None and drafter.records
        # each node's best tokens, computed once: greedy acceptance takes the first, layers that
        # recycle the target's predictions take as many as they keep
        top = top_tokens(logits, drafter.record_k if records else 1) if greedy or records else None
        if lazy_mask:
            targets = self.grammar.greedy_targets(logits, tree.children, tree.tokens, [t[0] for t in top])
            top = [row if row[0] == t else [t] + [x for x in row if x != t][:len(row) - 1]
                   for row, t in zip(top, targets)]
        if self._q_rows is not None and self.gen is not None:
            n, nxt = accept_chain_q(logits, tree.tokens[1:], self._q_rows, self.sampling, self.gen)
            path = list(range(1, n + 1))
        else:
            path, nxt = accept_tree(logits, tree, self.sampling, self.key, len(self.out),
                                    targets=[t[0] for t in top] if greedy else None)
        # under sampling the recorded tokens come with their probabilities: a recycled draft is then
        # priced by what the target gave it (tree.node_estimates), the acceptance it will meet
        probs = top_probs(logits, top, self.sampling) if records and not greedy else None
        return Verified(tree, path, nxt, logits, top if records else None, t0, probs)

    def advance(self, v: "Verified") -> list[int]:
        """After the cache holds the accepted path (keep_path): the drafting layers learn from the
        step, and the new tokens (the path, then the target's own) join the output, cut at an
        end-of-sequence token or a stop string. Returns the tokens added to the output."""
        tree, path, stats = v.tree, v.path, self.stats
        self._update_layers(v)
        stats.tree_sizes.append(tree.size())
        new = [tree.tokens[i] for i in path] + [v.nxt]
        new_layers = [tree.layers[i] for i in path] + [None]
        for i, t in enumerate(new):
            if t in self.decoder.eos_ids:
                new, new_layers, self.stop_reason = new[:i + 1], new_layers[:i + 1], "eos"
                break
        stats.accept_lengths.append(len(new))
        if self.out_logprobs is not None:   # row 0 predicted the first new token, each kept node the next
            self.out_logprobs.extend(logprobs_of(v.logits, ([0] + path)[:len(new)], new, self.logprobs))
        self.history.extend(new)
        out = self.out
        before = len(out)
        out.extend(new)
        self.out_layers.extend(new_layers)
        if self.grammar is not None:
            self.grammar.advance(new)
            stats.grammar_seconds, stats.grammar_rows = self.grammar.seconds, self.grammar.rows
        if self.prediction is not None:
            self.prediction.extend(out, len(new))
        stats.bookkeeping_seconds += time.perf_counter() - v.t0
        self._stop_or_go(before, new)
        return out[before:]

    def _stop_or_go(self, before: int, new: list[int]) -> None:
        """A stop string cuts the output; on_tokens hears the new output; the stream ends, or the
        drafter hears the new tokens."""
        out = self.out
        if self.stop_check is not None:
            cut = self.stop_check(out)
            if cut is not None:
                del out[cut:], self.out_layers[cut:]
                if self.out_logprobs is not None:
                    del self.out_logprobs[cut:]
                self.stop_reason = "stop"
        if self.on_tokens is not None and len(out) > before:
            self.on_tokens(out[before:], self.out_layers[before:])
        if self.stop_reason != "length":
            self.done = True
        else:
            if self.drafter is not None:
                self.drafter.extend(new)
            self.done = len(out) >= self.max_new_tokens

    def stop(self, reason: str = "cancelled") -> None:
        """End the generation where it is (a client went away)."""
        self.stop_reason, self.done, self.tree = reason, True, None

    def result(self) -> Generation:
        self.stats.new_tokens = len(self.out)
        self.stats.wall_seconds = time.perf_counter() - self.t_start
        return Generation(tokens=self.out, layers=self.out_layers, stop_reason=self.stop_reason,
                          stats=self.stats, logprobs=self.out_logprobs,
                          prediction_usage=self.prediction_usage())

    def _update_layers(self, v: "Verified") -> None:
        """What the step teaches the drafting layers: the target's predictions at every node (to
        layers that recycle them), per-layer counts of what was sent, kept and which candidate won
        (feeds `adaptive`), and the proposed and accepted sizes."""
        tree, path, stats, drafter = v.tree, v.path, self.stats, self.drafter
        if v.top is not None:
            drafter.record(self.history[-2:-1], [self.history[-1]] + tree.tokens[1:], tree.parents, v.top,
                           stats, v.top_probs)
        if not tree.size():
            return
        for name in tree.layers[1:]:
            stats.layer(name).drafted += 1
        for i in path:
            stats.layer(tree.layers[i]).accepted += 1
        tested, accepted = reached(tree, path)
        if path:
            stats.layer(tree.layers[path[-1]]).won += 1
        if drafter is None:   # a prediction alone
            return
        drafter.observe(tested, accepted)
        drafter.record_target(tree.size(), len(path))


class Verified(NamedTuple):
    """What the acceptance rule decided over one step's tree (Stream.verify)."""
    tree: Tree
    path: list[int]                # accepted nodes, root excluded, in order
    nxt: int                       # the target's own token after the path
    logits: torch.Tensor           # the processed (penalised, masked) logits the rule read
    top: list | None               # each node's best tokens, for a drafter that records them; else None
    t0: float                      # when verification began (bookkeeping time)
    top_probs: list | None = None  # under sampling, the probabilities of `top` (verify.top_probs)


# on_fault(i, exc, shared): stream i's step raised exc and ends there (speculative_steps);
# shared: how many other streams' rows were in the forward that failed with it (0: its own step)
FaultHandler = Callable[[int, Exception, int], None]


def _raise(i: int, exc: Exception, shared: int) -> None:
    raise exc


def speculative_step(model: TargetModel, s: Stream) -> list[int]:
    """One step of speculative decoding of one stream (`hd generate`): speculative_steps over a
    batch of one, a fault raised. Returns the tokens added to the output."""
    return speculative_steps(model, [s])[0]


@torch.inference_mode()
def speculative_steps(model: TargetModel, streams: Sequence[Stream], on_fault: FaultHandler | None = None,
                      times: dict | None = None) -> list[list[int] | None]:
    """One step of speculative decoding of several streams on one model, top to bottom, their
    trees verified in one forward where the model batches them (batch.forward_many): each turn of
    `hd serve`'s decode loop (hdcli/serve/scheduler.py); `hd generate` steps a batch of one.
    Returns per stream the tokens added to its output, None where its step failed.

    Faults stay with their stream: an exception while stream i drafts, runs its forward alone or
    accepts ends its step only, told to on_fault(i, exc, 0) (None: raised). A failed forward shared
    by k streams may have written into any of their caches: each of them is told (shared k - 1).
    times: the seconds spent drafting, in the forward and accepting are added to its "draft",
    "forward" and "accept" entries."""
    fault = on_fault or _raise
    t0 = time.perf_counter()
    live = _propose(model, streams, fault)       # propose: each stream's tree, capped by cost
    t1 = time.perf_counter()
    rows = _forward(model, streams, live, fault)  # forward: every node of every tree verified at once
    t2 = time.perf_counter()
    new: list[list[int] | None] = [None] * len(streams)
    for i, logits in zip(live, rows):
        if logits is not None:
            try:   # accept: the target's rule walks the tree, only the accepted path stays cached,
                new[i] = streams[i].accept(logits)   # the output, stops and drafting layers move on
            except Exception as exc:  # noqa: BLE001 - this stream's fault (docstring)
                fault(i, exc, 0)
    # each governed stream hears its step; timed only where the step was its own alone
    alone = time.perf_counter() - t0 if len(streams) == 1 else None
    for i in live:
        s = streams[i]
        if s.governor is not None and new[i] is not None:
            s.governor.observe(s.drafting, len(new[i]), alone)
            s.stats.governed_steps = s.governor.plain_steps
    if times is not None:
        times["draft"] += t1 - t0
        times["forward"] += t2 - t1
        times["accept"] += time.perf_counter() - t2
    return new


def _propose(model: TargetModel, streams: Sequence[Stream], fault: FaultHandler) -> list[int]:
    """Each stream's tree for this step (in stream.tree); returns the indices of the streams that
    have one. Several streams sharing one forward: the nodes worth its cost are chosen over all
    their trees together (tree.cap_jointly, by the streams' decoder's cost curve)."""
    cost = streams[0].decoder.cost if streams else None
    joint = batch.can_batch(model) and len(streams) > 1 and cost is not None
    live = []
    for i, s in enumerate(streams):
        try:   # Stream.propose already cuts drafts before an id outside the vocabulary
            if joint:
                s.propose(invariant.MAX_ROWS - len(streams), capped=False)
            else:
                s.propose()
            live.append(i)
        except Exception as exc:  # noqa: BLE001 - this stream's fault (speculative_steps)
            fault(i, exc, 0)
    if joint and live:
        try:
            keep = cap_jointly([streams[i].tree for i in live], [streams[i].estimates for i in live],
                               cost, invariant.MAX_ROWS)
            for i, k in zip(live, keep):
                streams[i].restrict(k)
        except Exception as exc:  # noqa: BLE001 - no cache touched yet; but whose fault is unknown
            for i in live:
                fault(i, exc, 0)
            return []
    return live


def _forward(model: TargetModel, streams: Sequence[Stream], live: Sequence[int], fault: FaultHandler) -> list:
    """The logits over each live stream's tree (each cache grows by its tree), None for one whose
    forward failed (fault heard it); one forward for all where the model batches."""
    items = [(streams[i].tree, streams[i].history[-1], streams[i].cache) for i in live]
    if len(items) > 1 and batch.can_batch(model):
        try:
            return batch.forward_many(model, items)
        except Exception as exc:  # noqa: BLE001 - any of their caches may hold part of it
            for i in live:
                fault(i, exc, len(items) - 1)
            return [None] * len(items)
    out = []
    for i, item in zip(live, items):   # a forward each (what forward_many does for this model)
        try:
            out.append(batch.forward_many(model, [item])[0])
        except Exception as exc:  # noqa: BLE001 - this stream's fault
            fault(i, exc, 0)
            out.append(None)
    return out

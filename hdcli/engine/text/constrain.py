"""Grammar constraints: structured output (JSON, JSON Schema, regex, Lark, GBNF), exact under
speculation.

The grammar engine is llguidance (pinned in pyproject.toml): chosen over xgrammar for a light
install (one abi3 wheel, no torch/triton pulled in) and a mask cheap beside a forward at the
bundled 49k vocabulary (benchmarks/grammar_engines.py, docs/structured.md). Nothing outside this module
imports it.

How a grammar constrains a generation (engine/decode/loop.py):
  * Mask: every verified row of a forward is masked with the matcher state of *that row's own
    tree path* (the output so far, then the row's ancestors in the tree): tokens the grammar
    forbids there get -inf, elementwise, as plain decoding under the same grammar masks its one
    row. So greedy output equals plain decoding under the grammar token for token, and sampling
    draws from the masked distribution (`GrammarState.masked`).
  * Cut: drafted tokens the grammar forbids are cut from every candidate before the tree is built,
    so they are never verified (`GrammarState.valid_prefix`).
  * Grammar layer: where the grammar forces text (JSON punctuation, a strict schema's keys, the
    rest of a fixed string), its tokens are drafted first and the other layers continue after
    them in the same tree (`GrammarState.forced`).
  * End: once the grammar is complete the mask allows only the model's end-of-sequence ids, so the
    output ends with stop_reason "eos"; a grammar that cannot finish within max_tokens ends with
    "length".

Invariant: the matcher only ever consumes tokens a mask allowed or the cut kept, so it never enters
llguidance's error state for a token it forbids; a state that would is a bug, raised as RuntimeError.

Limits: llguidance gives up on a grammar that exceeds its resource limits (lexer fuel, items in a
parser row: `LLParserLimits`), and its lexer is built lazily, shared by a matcher and its deep
copies, with a fuel budget reset at each mask: whether it gives up can depend on what was explored
before (drafts, forced text), so near its limits drafting could decide an answer. Hence: compile()
and check() refuse a grammar that hits a limit on its first steps (`_engine_limit`: its first mask,
then the text it forces, a token at a time, as decoding meets them; every JSON object schema with
many properties alone, `_crowded_objects`), so that neither path starts; and a matcher that gives up
while generating is a GrammarError on whichever path meets it, never a silently ended answer.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...errors import HdError

KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf")
# a forced token is the only one the grammar allows, or the canonical tokenization of forced text:
# kept with about this chance (the estimate that caps the tree by cost, engine/decode/tree.py)
FORCED_RATE = 0.95
FORCED_BYTES = 256            # forced text drafted at most (a step drafts far fewer tokens)
MAX_SOURCE_BYTES = 1 << 20    # a grammar or schema over 1 MiB is refused before compiling
PROBE_TOKENS = 16             # forced tokens consumed at compile time to find the engine's limits
# an object schema with more properties is compiled alone at check time to see whether its row of
# keys fits the parser (llguidance's max_items_in_row, 2000: ~500 optional properties)
CROWDED_OBJECT = 64
# JSON keeps llguidance's free whitespace between tokens: forcing one line (whitespace_flexible
# false) forces more text for the grammar layer to draft, but moved the bundled model off the
# pretty-printed JSON it was trained on, into loops (measured: an array repeating one item until
# max_tokens). A schema may ask for it in llguidance's "x-guidance" key: {"whitespace_flexible": false}.


class GrammarError(HdError):
    """A grammar or schema that cannot be used; the message names no field (callers add it)."""


# id(hf tokenizer) -> (it, its LLTokenizer or the GrammarError building one gave). A failure is kept
# too: once prepare(lm) has run, compile() never touches lm.tokenizer (hd serve compiles without the
# lock its decode loop takes to use the tokenizer)
_tokenizers: dict[int, tuple[object, object]] = {}
_lock = threading.Lock()


def _ll_tokenizer(lm):
    """llguidance's view of the model's tokenizer (slow to build, so kept per tokenizer): its
    vocabulary padded to the logits' width, and every end-of-sequence id of the model as EOS."""
    import llguidance.hf
    key = id(lm.tokenizer)
    with _lock:
        got = _tokenizers.get(key)
        if got is None or got[0] is not lm.tokenizer:
            try:
                llt = llguidance.hf.from_tokenizer(lm.tokenizer, n_vocab=int(lm.model.config.vocab_size),
                                                   eos_token=sorted(lm.eos_ids) or None)
            except (ValueError, TypeError) as exc:
                llt = GrammarError(f"this model's tokenizer cannot be used with a grammar: {exc}")
            got = _tokenizers[key] = (lm.tokenizer, llt)
    if isinstance(got[1], GrammarError):
        raise GrammarError(str(got[1]))
    return got[1]


_bytes_tokenizer = None


def _byte_tokenizer():
    """llguidance's byte-level tokenizer (a token per byte): the grammar's limits checked before a
    model's tokenizer is at hand (check)."""
    global _bytes_tokenizer
    if _bytes_tokenizer is None:
        from llguidance import LLTokenizer
        _bytes_tokenizer = LLTokenizer("byte")
    return _bytes_tokenizer


def prepare(lm) -> bool:
    """Build lm's grammar tokenizer ahead of the first grammar (hd serve at start); False where
    the tokenizer cannot take grammars (each request with one is then refused, naming why)."""
    try:
        _ll_tokenizer(lm)
        return True
    except GrammarError:
        return False


def _grammar_text(kind: str, source) -> str:
    """llguidance's grammar for one of KINDS."""
    from llguidance import LLMatcher
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if source is None or (isinstance(source, str) and not source.strip()):
        raise GrammarError("the grammar is empty")
    if isinstance(source, str) and len(source.encode("utf-8", "replace")) > MAX_SOURCE_BYTES:
        raise GrammarError(f"the grammar is over {MAX_SOURCE_BYTES} bytes")
    if kind == "json_schema":
        source = _schema(source)
        try:
            return LLMatcher.grammar_from_json_schema(source)
        except ValueError as exc:
            raise GrammarError(f"the schema is not usable: {exc}") from None
    if not isinstance(source, str):
        raise GrammarError(f"a {kind} grammar is text")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "gbnf":
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            source = gbnf_to_lark(source)
        except Exception as exc:  # noqa: BLE001 - the converter's own parse errors
            raise GrammarError(f"the GBNF grammar does not parse: {exc}") from None
    return LLMatcher.grammar_from_lark(source)


def _schema(source) -> dict:
    """A JSON schema given as text or already parsed, as a dict."""
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except ValueError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        except RecursionError:   # Python's parser recurses once a level (about 1000 of them)
            raise GrammarError("the schema is nested too deeply to parse: send a flatter schema") from None
    if not isinstance(source, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    return source


def _engine_limit(tokenizer, text: str, matcher=None) -> str | None:
    """The grammar engine's message where it gives up on the grammar's first steps, else None: its
    first mask, then the text it forces (computed on a deep copy, as the grammar layer drafts it)
    consumed a token at a time (at most PROBE_TOKENS) with a mask after each, as decoding meets it.
    matcher: one of `text` whose first mask is computed already (compile's)."""
    from llguidance import LLMatcher
    m = matcher if matcher is not None else LLMatcher(tokenizer, text, log_level=0)
    if matcher is None:
        m.compute_bitmask()
    if not m.is_error():
        for token in m.deep_copy().compute_ff_tokens()[:PROBE_TOKENS]:
            if not m.consume_token(token):
                break
            m.compute_bitmask()
            if m.is_error():
                break
    return _gave_up(m)


def _gave_up(m) -> str | None:
    """The first line of the matcher's error where the engine gave up on the grammar; None where it
    has not, or where its grammar has no continuation (llguidance's "NoExtension..." error: an
    empty language, which compile calls "admits no output")."""
    if not m.is_error():
        return None
    message = _engine_message(m.get_error())
    return None if message.startswith("NoExtension") else message


def _crowded_objects(schema: dict):
    """(JSON pointer, object schema) of every object in the schema with over CROWDED_OBJECT
    properties, walked without recursion (a schema may nest as deeply as the JSON parser took)."""
    stack = [("", schema)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > CROWDED_OBJECT:
                yield where or "/", node
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((f"{where}/{key}", value))


def _check_objects(schema: dict) -> None:
    """Each crowded object of the schema (_crowded_objects) compiled alone, its properties' values
    left free, and opened: a row of keys over the parser's limit is refused naming where it is."""
    from llguidance import LLMatcher
    for where, node in _crowded_objects(schema):
        props = node["properties"]
        alone = {"type": "object", "properties": {k: {} for k in props},
                 "required": [k for k in node.get("required", []) if isinstance(k, str) and k in props]}
        if isinstance(node.get("additionalProperties"), bool):
            alone["additionalProperties"] = node["additionalProperties"]
        try:
            text = LLMatcher.grammar_from_json_schema(alone)
        except ValueError:
            continue   # the whole schema's compile says what is wrong
        tok = _byte_tokenizer()
        m = LLMatcher(tok, text, log_level=0)
        m.compute_bitmask()
        if m.consume_tokens(tok.tokenize_bytes(b"{")):
            m.compute_bitmask()
        if m.is_error():
            optional = len(props) - len(alone["required"])
            engine = _engine_message(m.get_error()).split("; consider")[0]   # its advice is for grammar writers
            raise GrammarError(f"the object at {where} has {len(props)} properties ({optional} optional), more "
                               f"than the grammar engine can hold ({engine}): make more of them required, or "
                               "split the object")


def _engine_message(message: str) -> str:
    """The first line of a matcher's error (the rest is its parser state and statistics)."""
    return next((s.strip() for s in str(message).splitlines() if s.strip()), "the grammar engine gave up")


def _refuse_limits(tokenizer, kind: str, source, text: str, matcher=None) -> None:
    if kind == "json_schema":
        _check_objects(_schema(source))
    problem = _engine_limit(tokenizer, text, matcher)
    if problem:
        raise GrammarError(f"the grammar is beyond the grammar engine's limits ({problem}): "
                           "simplify it (smaller repetition counts, fewer alternatives)")


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled for one model's tokenizer: immutable, shared by every request using it;
    start() gives a generation its own matcher state."""
    kind: str
    text: str           # llguidance's grammar
    tokenizer: object   # llguidance.LLTokenizer
    vocab: int          # the logits' width

    eos_ids: tuple[int, ...] = ()

    def start(self) -> "GrammarState":
        return GrammarState(self)


def check(kind: str, source=None) -> None:
    """What compile() would refuse in the grammar itself, found without a model or tokenizer
    (hd generate checks its grammar before loading the model): GrammarError, else None."""
    from llguidance import LLMatcher
    text = _grammar_text(kind, source)
    problem = LLMatcher.validate_grammar(text)
    if problem:
        raise GrammarError(_one_line(problem))
    _refuse_limits(_byte_tokenizer(), kind, source, text)


def compile(lm, kind: str, source=None) -> Grammar:  # noqa: A001 - the module's verb
    """A Grammar of `kind` (KINDS) for lm's tokenizer, or GrammarError saying what is wrong: the
    engine's own message for a schema or grammar it refuses, "admits nothing" for one whose
    language is empty, "beyond the grammar engine's limits" for one it gives up on (module header).
    After prepare(lm) it does not touch lm.tokenizer: callers need no lock for it."""
    from llguidance import LLMatcher
    text = _grammar_text(kind, source)
    llt = _ll_tokenizer(lm)
    problem = LLMatcher.validate_grammar(text, llt)
    if problem:
        raise GrammarError(_one_line(problem))
    g = Grammar(kind, text, llt, int(lm.model.config.vocab_size), tuple(sorted(lm.eos_ids)))
    state = g.start()
    if state.matcher.is_error():
        raise GrammarError(_one_line(state.matcher.get_error()))
    m, allowed = state.matcher, state.allowed_now()   # the state is settled by its first mask
    if _gave_up(m) is None and not m.is_accepting() and (m.is_stopped() or not allowed.any()):
        raise GrammarError("the grammar admits no output at all (no string of it can be completed)")
    _refuse_limits(llt, kind, source, text, m)
    return g


def _one_line(message: str) -> str:
    lines = [s.strip() for s in str(message).splitlines() if s.strip()]
    return "; ".join(lines[:3]) or "the grammar is not valid"


class GrammarState:
    """One generation's place in its grammar (an llguidance matcher), advanced by the decode loop
    by the tokens it outputs and never by drafts: trees are explored with consume + rollback."""

    def __init__(self, grammar: Grammar):
        from llguidance import LLMatcher
        self.grammar = grammar
        self.eos = frozenset(grammar.eos_ids)
        self.matcher = LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.words = (grammar.vocab + 31) // 32
        self.seconds = 0.0   # time spent masking and cutting (RunStats.grammar_seconds)
        self.forcing = True  # the grammar layer drafts forced text (see forced)
        self.rows = 0        # rows masked

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)

    def _check(self) -> None:
        """A matcher in llguidance's error state here gave up on the grammar (its limits: the
        tokens it took were all allowed, module invariant). Its mask would then allow only the end
        of sequence, a silently ended answer: a GrammarError instead, on any path (module header)."""
        if self.matcher.is_error():
            why = _gave_up(self.matcher) or "it allows no token here"
            raise GrammarError(f"the grammar engine gave up on this grammar: {why}; simplify the grammar")

    def allowed_now(self) -> np.ndarray:
        """bool [vocab]: what the grammar allows as the next token."""
        bm = np.zeros((1, self.words), dtype=np.int32)
        self._fill(bm, 0)
        return _unpack(bm, self.grammar.vocab)[0]

    def forced(self, max_len: int) -> list[int]:
        """Tokens the grammar forces next (the grammar layer's draft): the canonical tokenization
        of the text it forces (at most FORCED_BYTES), less its last token, which the model may
        merge with what follows ('"' then ':' written as '":'). A draft like any other: verified.
        Computed on a copy of the matcher (cheap for a JSON schema): for a grammar that forces
        text without end (start: "x" start) the computation exhausts the parser's item limit and
        leaves its matcher in the error state for good; this generation then drafts no forced text."""
        if max_len <= 0 or not self.forcing or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        probe = self.matcher.deep_copy()
        text = probe.compute_ff_bytes()[:FORCED_BYTES]
        self._check()   # the copy shares the matcher's lexer: its limits too
        if probe.is_error():
            self.forcing, text = False, b""
        tokens = self.grammar.tokenizer.tokenize_bytes(text)[:-1][:max_len] if text else []
        tokens = tokens[:self.matcher.validate_tokens(tokens)] if tokens else []
        self.seconds += time.perf_counter() - t0
        return list(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of tokens, from the current state, the grammar allows in a row (an
        end-of-sequence id counts where the grammar is complete: llguidance's validation does not
        take it, its mask does)."""
        if not tokens:
            return 0
        t0 = time.perf_counter()
        m = self.matcher
        n = m.validate_tokens(list(tokens))
        if n < len(tokens):
            self._check()
        if n < len(tokens) and tokens[n] in self.eos:
            head = [int(t) for t in tokens[:n]]
            if not head or m.consume_tokens(head):
                complete = m.is_accepting()
                if head:
                    m.rollback(len(head))
                n += complete
        self.seconds += time.perf_counter() - t0
        return n

    def _consume(self, token: int, what: str) -> None:
        """Move the matcher on by a token a mask or the cut allowed: a token it does not allow is a
        bug here (RuntimeError); one it allows but cannot take hit the engine's limits (a grammar
        that nests deeper with every token, such as start: "x" start): GrammarError, one line."""
        if not self.allows(token):
            raise RuntimeError(f"grammar state lost: {what} token {token} is not allowed on its path")
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar engine gave up at {what} token {token}: "
                               f"{_engine_message(self.matcher.get_error())}; simplify the grammar")

    def allows(self, token: int) -> bool:
        """Whether the grammar allows token next (a couple of microseconds, no mask)."""
        if token in self.eos:
            ok = self.matcher.is_accepting()
        else:
            ok = self.matcher.validate_tokens([token]) == 1
        if not ok:
            self._check()
        return ok

    def _walk(self, children: Sequence[Sequence[int]], tokens: Sequence[int]):
        """Every node of a tree (root 0 first), depth first, yielded with the matcher in the state
        after the node's path: its token is consumed before it is yielded and rolled back after
        its subtree. A drafted end-of-sequence id and what follows it are not visited: the
        generation ends there, so those rows are never the output's."""
        stack = [(0, False)]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.matcher.rollback(1)
                continue
            if node:
                if tokens[node] in self.eos:
                    continue
                self._consume(int(tokens[node]), "drafted")
                stack.append((node, True))
            yield node
            stack.extend((c, False) for c in reversed(children[node]))

    def greedy_targets(self, logits: torch.Tensor, children: Sequence[Sequence[int]], tokens: Sequence[int],
                       best: Sequence[int]) -> list[int]:
        """Per row of a tree (its children and tokens), the argmax of the row masked by its own
        path's grammar state: best[i] (the unmasked argmax, the lowest index among equal maxima)
        where the grammar allows it, since no allowed token then scores higher nor ties it at a
        lower index; else the masked row's argmax. Equal to masking every row (`masked`) then
        taking argmax, at a few microseconds a row instead of a mask's tens: greedy decoding
        without log-probabilities."""
        t0 = time.perf_counter()
        targets = list(best)
        for node in self._walk(children, tokens):
            if not self.allows(targets[node]):
                targets[node] = self._masked_argmax(logits[node])
        self.seconds += time.perf_counter() - t0
        self.rows += len(tokens)
        return targets

    def _masked_argmax(self, row: torch.Tensor) -> int:
        bm = np.zeros((1, self.words), dtype=np.int32)
        self._fill(bm, 0)
        self._check()
        x = row.float().cpu().numpy()
        allowed = _unpack(bm, self.grammar.vocab)[0][:x.shape[0]]
        ids = np.flatnonzero(allowed)
        return int(ids[x[ids].argmax()])   # the first of equal maxima: ids ascend

    def masked(self, logits: torch.Tensor, children: Sequence[Sequence[int]], tokens: Sequence[int]) -> torch.Tensor:
        """logits [nodes, V] of a tree (row 0: the root) with what each row's own path forbids set
        to -inf (`_walk`; the rows after a drafted end-of-sequence id stay whole). A new tensor, fp32."""
        t0 = time.perf_counter()
        n = len(tokens)
        bitmask = np.full((n, self.words), -1, dtype=np.int32)   # -1: every token allowed
        for node in self._walk(children, tokens):
            self._fill(bitmask, node)
            self._check()
        allowed = _unpack(bitmask, self.grammar.vocab)[:, :logits.shape[-1]]
        if logits.device.type == "cpu":
            out = logits.float().clone()
            rows = out.numpy()
            for i in range(n):
                _mask_row(rows[i], allowed[i])
        else:
            out = logits.float().masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
        self.seconds += time.perf_counter() - t0
        self.rows += n
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """The decode loop output these tokens (each one a mask allowed)."""
        t0 = time.perf_counter()
        for t in tokens:
            self._check()   # an errored matcher is stopped too: never taken for a finished grammar
            if self.matcher.is_stopped():
                break   # an end-of-sequence id after a complete grammar: nothing more to follow
            self._consume(int(t), "output")
        self.seconds += time.perf_counter() - t0


def _mask_row(row: np.ndarray, allowed: np.ndarray) -> None:
    """row[~allowed] = -inf in place, touching only the smaller side: a grammar state allows a
    handful of tokens (JSON punctuation, a key) or nearly all (inside a string), and these index
    writes cost a tenth of a whole-row boolean op at a 49k vocabulary."""
    ids = np.flatnonzero(allowed)
    if 2 * len(ids) < len(row):
        kept = row[ids]
        row.fill(-np.inf)
        row[ids] = kept
    else:
        row[np.flatnonzero(~allowed)] = -np.inf


def _unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [rows, vocab] from llguidance's bitmask (bit j of word w: token 32 w + j)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)

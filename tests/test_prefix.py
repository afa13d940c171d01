"""The prefix cache (hdcli/engine/decode/prefix.py) and what it rests on.

  * Split-invariant prefill: a prompt's keys and values filled in causal pieces of at most
    invariant.MAX_ROWS rows are torch.equal whatever the split, on the bundled model (bf16, GGUF
    int8 kernels, M-invariant; with the fused attention and with the torch ops' one) and on a tiny
    Gemma 3 past its sliding window; a generation's final cache, verified in token trees, equals
    the prefill of its history. Negative controls: a cache from another token at one position, and
    the whole-prompt SDPA prefill (fused attention off), differ.
  * PrefixCache: a generation after a restored prefix equals the one without, token for token
    (greedy), reusing the length expected; scopes do not see each other's entries; LRU by bytes;
    a prefix shared by two entries is stored once.
  * hd serve: a two-turn chat gives the same answers with the cache as without, and its usage
    shows the cached prompt tokens.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hdcli.engine.kernels import fused, invariant
from hdcli.engine.model import kvcache
from hdcli.engine.decode import prefix
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.tree import tree_forward
from hdcli.engine.decode import calibrate

from conftest import require_bundled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_check import Oracle  # noqa: E402

SPLITS = (1, 5, 63, 64, 65, 100, 299)


def same(a, b, n=None) -> bool:
    """Are the first n rows (all: None) of two caches' keys and values torch.equal in every layer?"""
    return all(torch.equal(x.keys[:, :, :n], y.keys[:, :, :n]) and torch.equal(x.values[:, :, :n], y.values[:, :, :n])
               for x, y in zip(a.layers, b.layers))


def pieces(model, ids, start_with=None):
    c = model.new_cache()
    if start_with:   # ids[:start_with] in one piece first, as a restored prefix would begin
        prefix.prefill_pieces(model, ids[:start_with], c)
    prefix.prefill_pieces(model, ids, c, start_with or 0)
    return c


@pytest.fixture(scope="module")
def bundled():
    """The bundled model as `auto` takes it on an AVX512-VNNI CPU: bf16, GGUF int8 kernels."""
    require_bundled()
    from hdcli import api
    from hdcli.engine.kernels import quants
    if not quants.int8_available():
        pytest.skip("hd's int8-activation GEMM needs AVX512-VNNI or AVX2")
    lm = api.load_model("smollm2-135m", dtype="bf16", device="cpu", kernels="gguf-int8", quiet=True)
    assert lm.invariant and prefix.why_not(lm.model) is None
    return lm


def corpus_ids(lm, n: int) -> list[int]:
    rng = random.Random(0)
    words = ("the cat sat on a mat while seven engineers argued about caches , prefixes and "
             "rounding errors in the attention of a small language model .").split()
    text = " ".join(rng.choice(words) for _ in range(2 * n))
    return lm.tokenizer(text)["input_ids"][:n]


@pytest.mark.bundled
@pytest.mark.parametrize("attention", ["fused", "torch"])
def test_prefill_in_pieces_is_split_invariant(bundled, attention):
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    m = bundled.model
    ids = corpus_ids(bundled, 300)
    assert len(ids) == 300
    with invariant.pinned(attention), torch.inference_mode():
        ref = pieces(m, ids)
        for cut in SPLITS:
            assert same(ref, pieces(m, ids, cut)), cut
        # negative control: one other token at position 50 changes rows 50.. and only those
        other = list(ids)
        other[50] = (other[50] + 1) % m.config.vocab_size
        c = pieces(m, other)
        assert same(ref, c, 50) and not same(ref, c)
        whole = m.new_cache()
        m.prefill(torch.tensor([ids]), whole)   # hd generate's prefill: one forward of 299 rows
        if attention == "fused":
            assert same(ref, whole)             # the fused attention takes any width the same way
        else:
            assert not same(ref, whole)         # causal SDPA: why the prefix cache prefills in pieces


@pytest.mark.bundled
def test_a_generations_cache_equals_the_prefill_of_its_history(bundled):
    """Token trees verified with an oracle drafter (corrupted, branching), rows moved by keep_path:
    at the end the cache holds history[:-1] as a prefill of it writes it."""
    m = bundled.model
    ids = corpus_ids(bundled, 150)
    plain = Decoder(m, bundled.eos_ids).generate(ids, max_new_tokens=40)
    oracle = Oracle(plain.tokens, len(ids), k=8, corrupt=0.25, branches=3, vocab=m.config.vocab_size, seed=1)
    dec = Decoder(m, bundled.eos_ids, drafter=oracle, prefix=prefix.PrefixCache(0))
    s = dec.stream(ids, max_new_tokens=40)
    with torch.inference_mode():
        while not s.done:
            s.accept(tree_forward(m, s.propose(), s.history[-1], s.cache))
        assert s.out == plain.tokens and max(s.stats.accept_lengths) > 1
        h = s.history[:-1]
        assert s.cache.get_seq_length() >= len(h)
        assert same(pieces(m, h), s.cache, len(h))


@pytest.mark.parametrize("attention", ["torch", "fused"])
def test_gemma3_sliding_window_prefill_is_split_invariant(attention, tmp_path, monkeypatch):
    """A tiny Gemma 3 (a sliding-window layer of 8, then a full one), bf16, M-invariant: pieces
    split anywhere, past the window, give the same cache."""
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    from test_invariant import build
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with invariant.pinned(attention):
        m = build("gemma3", torch.bfloat16, "torch")
        calibrate.enable(m)
        assert prefix.why_not(m) is None
        rng = random.Random(2)
        ids = [rng.randrange(3, 64) for _ in range(150)]
        with torch.inference_mode():
            ref = pieces(m, ids)
            for cut in (1, 7, 8, 9, 64, 100, 149):
                assert same(ref, pieces(m, ids, cut)), cut
        calibrate.disable(m)
        assert prefix.why_not(m) is not None


@pytest.mark.bundled
def test_a_restored_prefix_gives_the_same_generation(bundled):
    """A chat's second turn (prompt + answer + a new question) restores what the first turn
    stored and decodes the same tokens as without the cache; a repeated prompt restores all but
    its last token."""
    m, eos = bundled.model, bundled.eos_ids
    pc = prefix.PrefixCache(256 << 20)
    cached = Decoder(m, eos, prefix=pc)
    uncached = Decoder(m, eos, prefix=prefix.PrefixCache(0))   # the same prefill path, nothing kept
    plain = Decoder(m, eos)
    p1 = corpus_ids(bundled, 120)

    def run(dec, ids, scope=""):
        s = dec.stream(ids, max_new_tokens=30, scope=scope)
        with torch.inference_mode():
            while not s.done:
                s.accept(tree_forward(m, s.propose(), s.history[-1], s.cache))
        if dec.prefix is not None:   # as the server does at the end of a request
            dec.prefix.store(scope, s.history[:-1], s.cache)
        return s

    first = run(cached, p1)
    assert first.stats.cached_tokens == 0 and first.out == run(uncached, p1).out
    p2 = p1 + first.out + corpus_ids(bundled, 20)
    second = run(cached, p2)
    assert second.stats.cached_tokens == len(p1) + len(first.out) - 1
    assert second.out == run(uncached, p2).out
    if fused.enabled():   # the whole-prompt prefill of hd generate takes the same path there
        assert second.out == run(plain, p2).out
    again = run(cached, p2)
    assert again.stats.cached_tokens == len(p2) - 1 and again.out == second.out
    # another scope sees none of it
    assert run(cached, p2, scope="b").stats.cached_tokens == 0
    assert pc.summary()["hits"] == 2 and pc.summary()["hit_tokens"] == second.stats.cached_tokens + len(p2) - 1


# ---------------------------------------------------------------- PrefixCache alone

H, D = 2, 4
FP32 = SimpleNamespace(dtype=torch.float32)


def cache_of(tokens, layers: int = 2):
    """A kvcache.Cache whose rows are a function of their token and position only (as a model's
    would be of their prefix): equal prefixes, equal rows."""
    c = kvcache.Cache(layers)
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    for i, layer in enumerate(c.layers):
        k = (t[None, None, :, None] * 10 + pos[None, None, :, None] + i).expand(1, H, len(tokens), D).contiguous()
        layer.append(k, -k)
    return c


def entry_bytes(n: int, layers: int = 2) -> int:
    return n * 8 + layers * 2 * H * n * D * 4


def restored(pc, scope, ids):
    c = kvcache.Cache(2)
    n = pc.restore(FP32, scope, ids, c)
    if n:
        assert same(c, cache_of(ids[:n]))
    return n


def test_scopes_do_not_share_entries():
    pc = prefix.PrefixCache(1 << 20, min_tokens=4)
    a = list(range(3, 40))
    pc.store("a", a, cache_of(a))
    assert restored(pc, "b", a) == 0 and restored(pc, "", a) == 0
    assert restored(pc, "a", a + [7, 8]) == len(a)
    assert restored(pc, "a", a[:20] + [99] * 5) == 20          # a prefix of an entry
    assert restored(pc, "a", a[:3] + [99] * 5) == 0            # shorter than min_tokens
    pc.store("b", a, cache_of(a))
    assert restored(pc, "b", a) == len(a)


def test_lru_by_bytes_and_shared_prefixes():
    n = 50
    pc = prefix.PrefixCache(2 * entry_bytes(n) + 10, min_tokens=4)
    a, b, c = ([t] * n for t in (3, 4, 5))
    pc.store("", a, cache_of(a))
    pc.store("", b, cache_of(b))
    assert pc.bytes == 2 * entry_bytes(n) and pc.entries() == 2
    assert restored(pc, "", a) == n          # a is now the more recent
    pc.store("", c, cache_of(c))             # over the bound: b, the least recently used, goes
    assert restored(pc, "", b) == 0 and restored(pc, "", a) == n and restored(pc, "", c) == n
    assert pc.bytes <= pc.max_bytes and pc.summary()["evicted_tokens"] == n
    # two entries sharing 40 tokens hold them once; the longer covers a stored prefix of it
    pc = prefix.PrefixCache(1 << 20, min_tokens=4)
    base = list(range(3, 43))
    x, y = base + [50] * 10, base + [60] * 10
    pc.store("", x, cache_of(x))
    pc.store("", y, cache_of(y))
    assert pc.bytes == entry_bytes(60) and pc.entries() == 2
    assert restored(pc, "", x) == 50 and restored(pc, "", y) == 50 and restored(pc, "", base + [70]) == 40
    pc.store("", x + [1, 2], cache_of(x + [1, 2]))
    assert pc.entries() == 2 and pc.bytes == entry_bytes(62)
    # an entry larger than the whole bound is not kept
    small = prefix.PrefixCache(entry_bytes(10), min_tokens=4)
    small.store("", x, cache_of(x))
    assert small.bytes == 0 and small.entries() == 0


def test_only_what_is_not_stored_yet_is_copied():
    pc = prefix.PrefixCache(1 << 20, min_tokens=4)
    a = list(range(3, 33))
    pc.store("", a[:20], cache_of(a[:20]))
    pc.store("", a, cache_of(a))
    assert pc.summary()["stored_tokens"] == 30 and pc.entries() == 1
    pc.store("", a[:10], cache_of(a[:10]))   # covered: nothing new
    assert pc.summary()["stored_tokens"] == 30 and pc.bytes == entry_bytes(30)


# ---------------------------------------------------------------- hd serve

def test_served_two_turn_chat_equals_uncached(serve_model_dir):
    pytest.importorskip("openai")
    from test_serve import Running, config
    model_dir = serve_model_dir
    system = " ".join(["the cat sat on the mat and then it was a very good day"] * 3)
    answers = {}
    for mb in (0, 64):
        r = Running(config(model_dir), prefix_cache_mb=mb)
        try:
            assert r.server.scheduler.batched and (r.server.prefix is not None) == (mb > 0)
            c, name = r.client(), r.server.name
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}]
            one = c.chat.completions.create(model=name, messages=msgs, max_tokens=20, temperature=0)
            msgs += [{"role": "assistant", "content": one.choices[0].message.content},
                     {"role": "user", "content": "one two three"}]
            two = c.chat.completions.create(model=name, messages=msgs, max_tokens=20, temperature=0)
            answers[mb] = (one.choices[0].message.content, two.choices[0].message.content)
            cached = [u.prompt_tokens_details.cached_tokens for u in (one.usage, two.usage)]
            assert cached == [u.model_extra["hd"]["cached_prompt_tokens"] for u in (one.usage, two.usage)]
            if mb:
                assert cached[0] == 0 and cached[1] > one.usage.prompt_tokens
                assert r.server.summary()["prefix_cache"]["hits"] == 1
            else:
                assert cached == [0, 0] and r.server.summary()["prefix_cache"] is None
        finally:
            r.stop()
    assert answers[0] == answers[64]

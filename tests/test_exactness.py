"""Greedy speculative output must equal plain greedy decoding token for token (fp32)."""
from __future__ import annotations

import random

import pytest
import torch

from hdcli import api
from hdcli.engine.decode.draft import Drafter
from hdcli.engine.decode.loop import Decoder, first_difference
from hdcli.drafting import ContextDB, Hierarchy

from conftest import FakeLayer, tiny_gemma3, tiny_llama


class ScriptedLayer(FakeLayer):
    """Drafts the true continuation (read from a reference output) with random corruptions, so
    every step mixes accepted and rejected tokens at random depths."""
    name = "scripted"

    def __init__(self, prompt_len, reference, corrupt=0.3, vocab=50, seed=0):
        self.prompt_len, self.ref, self.corrupt, self.vocab = prompt_len, reference, corrupt, vocab
        self.rng = random.Random(seed)

    def candidates(self, history, max_len, max_candidates):
        pos = len(history) - self.prompt_len
        true = self.ref[pos:pos + max_len]
        return [[t if self.rng.random() > self.corrupt else self.rng.randrange(self.vocab)
                 for t in true]] if true else []


class RandomLayer(FakeLayer):
    """Drafts random tokens: almost everything is rejected."""
    name = "random"

    def __init__(self, vocab, seed=0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def candidates(self, history, max_len, max_candidates):
        return [[self.rng.randrange(self.vocab) for _ in range(max_len)]]


# a tiny llama and a tiny Gemma 3 (sliding-window layers), for the drafting paths added later
TINY_MODELS = [lambda: tiny_llama(vocab_size=50, seed=1, scale=4.0),
               lambda: tiny_gemma3(vocab_size=50, seed=2, scale=4.0)]

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 10, 11, 10, 11, 10], [1] + list(range(5, 40)), [1, 7]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=50, seed=1, scale=4.0)


def plain(model, prompt, n):
    return Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=n).tokens


def test_plain_decoding_equals_transformers_generate(model):
    for prompt in PROMPTS:
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                             min_new_tokens=40, pad_token_id=0)[0, len(prompt):].tolist()
        assert plain(model, prompt, 40) == ref


@pytest.mark.parametrize("draft_len", [1, 3, 10])
@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3)])
def test_context_db_greedy_equals_plain(model, draft_len, min_n, max_n):
    accepted = drafted = 0
    for prompt in PROMPTS:
        ref = plain(model, prompt, 60)
        drafter = Hierarchy([ContextDB(min_n, max_n)], draft_len=draft_len)
        g = Decoder(model, (), drafter).generate(prompt, max_new_tokens=60)
        assert g.tokens == ref
        accepted += g.stats.layers["context"].accepted
        drafted += g.stats.layers["context"].drafted
    assert 0 < accepted < drafted  # both paths (accept and reject) were exercised


@pytest.mark.parametrize("kw", [{"match_factor": 1.0}, {"match_factor": 3.0, "tag_matches": True},
                                {"tag_matches": True}])
def test_match_length_drafts_equal_plain(model, kw):
    """The context DB's match-length rules (draft length, tags priced apart by the tracker)."""
    accepted = drafted = 0
    for prompt in PROMPTS:
        ref = plain(model, prompt, 60)
        drafter = Hierarchy([ContextDB(1, 3, **kw)], policy="fill-tracked", max_candidates=3)
        g = Decoder(model, (), drafter).generate(prompt, max_new_tokens=60)
        assert g.tokens == ref
        layers = [v for k, v in g.stats.layers.items() if k.startswith("context")]
        accepted += sum(v.accepted for v in layers)
        drafted += sum(v.drafted for v in layers)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("corrupt", [0.0, 0.2, 0.6])
def test_partial_acceptance_keeps_cache_exact(model, corrupt):
    """Rejected tokens at random depths: any rejected entry left in the KV cache changes what
    follows, so this fails if cropping keeps a rejected token or drops an accepted one."""
    for seed, prompt in enumerate(PROMPTS):
        ref = plain(model, prompt, 50)
        layer = ScriptedLayer(len(prompt), ref, corrupt=corrupt, seed=seed)
        g = Decoder(model, (), Hierarchy([layer], draft_len=7)).generate(prompt, max_new_tokens=50)
        assert g.tokens == ref
        if corrupt == 0.0:
            assert g.stats.steps < len(ref) / 3


def test_random_drafts_are_all_rejected_and_output_unchanged(model):
    prompt = PROMPTS[0]
    ref = plain(model, prompt, 40)
    g = Decoder(model, (), Hierarchy([RandomLayer(50)], draft_len=8)).generate(prompt, max_new_tokens=40)
    assert g.tokens == ref


def test_eos_inside_accepted_draft_stops_there(model):
    prompt = PROMPTS[1]
    ref = plain(model, prompt, 30)
    eos = ref[12]  # pretend a token in the middle of the output is EOS
    expected = ref[:ref.index(eos) + 1]
    layer = ScriptedLayer(len(prompt), ref, corrupt=0.0)
    for drafter in (None, Hierarchy([layer], draft_len=10)):
        g = Decoder(model, (eos,), drafter).generate(prompt, max_new_tokens=30)
        assert g.tokens == expected and g.stop_reason == "eos"


def test_tiny_model_through_api(tiny_lm):
    for prompt in ["the cat sat on the mat and the cat sat on the", "one two three four one two",
                   "hello world"]:
        ref = api.generate(tiny_lm, prompt, max_new_tokens=40, drafter=None)
        got = api.generate(tiny_lm, prompt, max_new_tokens=40)
        assert got.tokens == ref.tokens and got.text == ref.text


@pytest.mark.bundled
def test_bundled_model_greedy_equals_plain(bundled_lm):
    prompts = [
        "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
        "Fix the bug in this code and show the whole function:\n\ndef add(a, b):\n    return a - b\n",
        "Summarise in one sentence: The meeting moved from Monday to Tuesday because the room was "
        "booked. The meeting will now be on Tuesday at 10 am in room 4.",
    ]
    hits = 0
    for p in prompts:
        ref = api.generate(bundled_lm, p, max_new_tokens=48, drafter=None)
        got = api.generate(bundled_lm, p, max_new_tokens=48)
        assert got.tokens == ref.tokens, first_difference(got.tokens, ref.tokens)
        hits += got.stats.layers["context"].accepted
    assert hits > 0


def test_sliding_window_model_greedy_equals_plain_past_the_window():
    """Gemma 3 style caches (sliding-window layers) stay exact through chains and trees once the
    context is longer than the window."""
    model = tiny_gemma3(vocab_size=50, seed=0, scale=4.0)
    for prompt in PROMPTS[:3]:
        ref = plain(model, prompt, 60)
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                            min_new_tokens=60, pad_token_id=0)[0, len(prompt):].tolist()
        assert ref == hf
        layer = ScriptedLayer(len(prompt), ref, corrupt=0.3)
        g = Decoder(model, (), Hierarchy([layer, ContextDB(1, 3)], policy="fill", draft_len=6,
                                         max_candidates=4)).generate(prompt, max_new_tokens=60)
        assert g.tokens == ref
        assert max(g.stats.tree_sizes) > 1


@pytest.mark.parametrize("make", TINY_MODELS, ids=["llama", "gemma3"])
def test_suffix_decoding_drafts_equal_plain_greedy(make):
    """SuffixDecoding's trees (the real arctic-inference library), verified whole by hd's tree
    verifier, give plain greedy output; its global tree carries responses across requests."""
    from hdcli.drafting.suffix import SuffixDrafter, new_cache, tree_paths
    m = make()
    cache = new_cache()
    drafted = 0
    for p in PROMPTS * 2:  # the second round drafts from the first round's responses too
        ref = Decoder(m, ()).generate(p, max_new_tokens=40).tokens
        g = Decoder(m, (), SuffixDrafter(cache)).generate(p, max_new_tokens=40)
        assert g.tokens == ref
        drafted += g.stats.layers["suffix"].drafted if "suffix" in g.stats.layers else 0
    assert drafted > 0
    assert sorted(tree_paths([5, 6, 7, 8], [-1, 0, -1, 0])) == [[5, 6], [5, 8], [7]]


@pytest.mark.parametrize("make", TINY_MODELS, ids=["llama", "gemma3"])
def test_recycled_predictions_equal_plain_greedy(make):
    """The recycle layer drafts the target's own earlier predictions (one table shared across
    requests, as a benchmark run shares it); trees of them with the context DB stay exact."""
    from hdcli.drafting import RecycledLayer, RecycledTable
    m = make()
    table = RecycledTable()
    drafted = accepted = next_drafted = 0
    for p in PROMPTS * 2:
        ref = Decoder(m, ()).generate(p, max_new_tokens=40).tokens
        for layers in ([RecycledLayer(table, next_next=True)], [ContextDB(1, 3), RecycledLayer(table)]):
            g = Decoder(m, (), Hierarchy(layers, policy="fill", max_candidates=4)).generate(p, max_new_tokens=40)
            assert g.tokens == ref
            st = g.stats.layers.get("recycle")
            drafted += st.drafted if st else 0
            accepted += st.accepted if st else 0
            st = g.stats.layers.get("recycle:next")   # the token after next (LogitSpec)
            next_drafted += st.drafted if st else 0
    assert drafted > 0 and accepted > 0 and next_drafted > 0
    assert table.bigram and table.unigram


def test_a_tenants_scoped_answers_draft_and_equal_plain_greedy():
    """hd serve --learn-scope key|user: a request drafts from the DB's shared answers and its own
    scope's (drafting.model.ScopedAnswers) and grows only its own; greedy output is plain decoding's,
    and what one scope generated is never proposed to another."""
    from hdcli.drafting.model import AnswerIndex, ModelLayer, ScopedAnswers, available
    if not available():
        pytest.skip("arctic-inference is not installed")
    m = tiny_llama(vocab_size=50, seed=1, scale=4.0)
    refs = {tuple(p): plain(m, p, 40) for p in PROMPTS}
    base = AnswerIndex([refs[tuple(PROMPTS[0])]])          # the built DB's answers: shared
    a, b = ScopedAnswers(base, AnswerIndex()), ScopedAnswers(base, AnswerIndex())
    accepted = 0
    for p in PROMPTS * 2:    # scope a asks everything twice: the second round drafts from its own answers
        g = Decoder(m, (), Hierarchy([ModelLayer(a)], draft_len=8)).generate(p, max_new_tokens=40)
        assert g.tokens == refs[tuple(p)]
        accepted += g.stats.layers["model"].accepted if "model" in g.stats.layers else 0
    assert accepted > 0
    p = PROMPTS[1]   # scope b never asked it: a's answer to it is not proposed to b
    seen = p + refs[tuple(p)][:3]
    assert a.candidates(seen, 8, 4) and not b.own.candidates(seen, 8, 4)
    # and the shared answers are still the DB's alone: b proposes what the DB did
    assert b.candidates(seen, 8, 4) == AnswerIndex([refs[tuple(PROMPTS[0])]]).candidates(seen, 8, 4)
    g = Decoder(m, (), Hierarchy([ModelLayer(b)], draft_len=8)).generate(p, max_new_tokens=40)
    assert g.tokens == refs[tuple(p)]


# --- a drafter that drafts past max_len ----------------------------------------------------------

class Oracle(Drafter):
    """A custom Drafter (engine/decode/draft.py) that ignores max_len: it proposes the next 12 tokens of
    the reference output, whatever room is left."""

    def __init__(self, prompt_len: int, ref: list[int]):
        self.prompt_len, self.ref = prompt_len, ref

    def reset(self, tokens):
        pass

    def extend(self, tokens):
        pass

    def propose(self, history, max_len, stats=None):
        from hdcli.engine.decode.draft import Draft
        done = len(history) - self.prompt_len
        return [Draft(tuple(self.ref[done:done + 12]), "oracle")] if done < len(self.ref) else []

    def rate(self, layer, depth=1, first_child=True):
        return 0.9

    def observe(self, tested, accepted):
        pass


class OracleLayer(Oracle):
    """The same as a drafting layer (drafting/hierarchy.Layer) inside the hierarchy."""
    name = "oracle"

    def candidates(self, history, max_len, max_candidates):
        done = len(history) - self.prompt_len
        return [self.ref[done:done + 12]]


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("kind", ["drafter", "layer"])
def test_drafts_past_max_len_never_lengthen_the_output(n, kind):
    """A custom Drafter (or layer) returning more tokens than max_len made the output longer than
    -n (every drafted token was accepted, plus the target's own)."""
    from conftest import tiny_llama
    from hdcli.drafting.hierarchy import Hierarchy
    from hdcli.engine.decode.loop import Decoder
    model = tiny_llama(vocab_size=50, seed=1, scale=4.0)
    prompt = [1, 5, 6, 7, 8, 9]
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=20).tokens
    drafter = Oracle(len(prompt), ref) if kind == "drafter" else Hierarchy([OracleLayer(len(prompt), ref)], draft_len=16)
    g = Decoder(model, (), drafter).generate(prompt, max_new_tokens=n)
    assert g.tokens == ref[:n]
    s = Decoder(model, (), drafter).stream(prompt, max_new_tokens=n)   # the steps hd serve takes
    tree = s.propose()
    assert tree.size() <= n - 1


class OutOfVocabulary(Oracle):
    """A drafter of another model: its drafts hold ids past this model's embedding."""

    def propose(self, history, max_len, stats=None):
        from hdcli.engine.decode.draft import Draft
        done = len(history) - self.prompt_len
        right = tuple(self.ref[done:done + 3])
        return [Draft(right + (50, 7), "oracle"), Draft((10**9,) + right, "oracle")] if done < len(self.ref) else []


def test_drafted_ids_outside_the_vocabulary_never_reach_the_embedding():
    """A drafter naming ids past the embedding (a damaged DB, a drafter of another tokenizer) made
    the verification forward raise IndexError; now each draft is cut before its first such id and
    the output is plain greedy decoding's (control: uncut, the forward raises)."""
    from conftest import tiny_llama
    from hdcli.engine.decode.loop import Decoder
    from hdcli.engine.decode.draft import Draft, clamped
    model = tiny_llama(vocab_size=50, seed=1, scale=4.0)
    prompt = [1, 5, 6, 7, 8, 9]
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=12).tokens
    g = Decoder(model, (), OutOfVocabulary(len(prompt), ref)).generate(prompt, max_new_tokens=12)
    assert g.tokens == ref and g.stats.layer("oracle").accepted > 0   # the cut drafts still paid
    assert [d.tokens for d in clamped([Draft((3, 50, 4), "x")], 8, vocab=50)] == [(3,)]
    import torch
    with pytest.raises(IndexError):
        model(torch.tensor([[3, 50]]))


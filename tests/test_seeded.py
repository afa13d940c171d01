"""Seeded sampling is coupled to the output position (engine/decode/verify.py: coupled_choice):
the same seed gives plain sampled decoding's tokens, token for token, whatever drafted them, what
was verified beside them, and which choice of a request they are. And the cheap chooser has
exactly the distribution of the full one (target_probs), under every truncation.

Controls: randomness keyed by the step (the draws a generation has made) instead of the output
position breaks the equality; a truncation that drops one token too many breaks the distribution.

Cost: the module runs on one thread (test_sampling.single_thread: a 64-wide model and single rows
only lose to a second thread's start-up, and on a loaded machine each op waits for the other
thread, a forward or a chooser call 10-30x slower, measured); it changes no token."""
from __future__ import annotations

import random

import numpy as np

import pytest
import torch
from scipy.stats import chisquare

from hdcli import drafting
from hdcli.drafting import AnswerIndex, ModelLayer, ContextDB, Hierarchy, RecycledLayer, RecycledTable
from hdcli.engine.decode import loop, verify
from hdcli.engine.decode.draft import Draft, Drafter
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.request import Request
from hdcli.engine.decode.verify import Sampling, coupled_choice, position_uniform, sampling_key, target_probs
from hdcli.engine.model.target import as_target

from conftest import owned_copy, step_together, tiny_llama
from test_sampling import single_thread

V = 40
PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5], [2, 9, 3, 9, 3, 9, 3, 9, 3], [1] + list(range(5, 25))]
SAMPLINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=8, top_p=0.9),
             Sampling(temperature=0.8, top_p=0.8, frequency_penalty=0.5, logit_bias=((4, 2.0),))]


class RandomTree(Drafter):
    """Several random candidates a step, sharing first tokens: real trees, kept or not by chance."""
    name = "tree"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def reset(self, tokens):
        pass

    def extend(self, tokens):
        pass

    def propose(self, history, max_len, stats=None):
        first = [self.rng.randrange(V) for _ in range(3)]
        return [Draft(tuple(first[:1 + i % 3] + [self.rng.randrange(V) for _ in range(max_len)])[:max_len],
                      "tree") for i in range(4)]

    def rate(self, layer, depth=1, first_child=True):
        return 0.5

    def observe(self, tested, accepted):
        pass


class Oracle(RandomTree):
    """Drafts the reference output (plain decoding's, same seed), one token in four corrupted,
    beside random siblings: many drafts are kept, on later branches too."""
    name = "oracle"

    def __init__(self, prompt_len, ref, seed=0):
        super().__init__(seed)
        self.prompt_len, self.ref = prompt_len, ref

    def propose(self, history, max_len, stats=None):
        true = self.ref[len(history) - self.prompt_len:][:min(max_len, 4)]
        true = [t if self.rng.random() > 0.25 else self.rng.randrange(V) for t in true]
        cands = [Draft(tuple(true[:i] + [self.rng.randrange(V)] + true[i + 1:]), "oracle")
                 for i in range(min(2, len(true)))]
        return [Draft(tuple(true), "oracle")] + cands if true else []


class SampledChain(RandomTree):
    """A draft model's chain: tokens with the distribution q they were drawn from (hsd/stack.py)."""

    def propose(self, history, max_len, stats=None):
        q = torch.softmax(torch.randn(max_len, V, generator=torch.Generator().manual_seed(self.rng.randrange(99))), -1)
        toks = tuple(int(torch.multinomial(q[i], 1)) for i in range(max_len))
        return [Draft(toks, "model", q)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The whole module on one thread, the model's load and its M-invariant calibration included
    (the mode's records are kept per thread count)."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama in the M-invariant mode: every verified row is its one-token forward's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HD_CACHE_DIR", str(tmp_path_factory.mktemp("hdcache")))
    m = owned_copy(tiny_llama(vocab_size=V, seed=5, hidden=64, scale=2.0), tmp_path_factory.mktemp("seeded"),
                   invariant="on").model
    yield m
    mp.undo()


def drafters(prompt, ref):
    out = {"oracle-tree": Oracle(len(prompt), ref),"context": Hierarchy([ContextDB(1, 3)], draft_len=5),
           "tree": RandomTree(len(prompt)),
           "hierarchy-tree": Hierarchy([ContextDB(1, 3), ContextDB(2, 4)], policy="adaptive", draft_len=5,
                                       max_candidates=4),
           "draft-model chain": SampledChain(len(prompt))}
    if drafting.model.available():
        out["model DB"] = Hierarchy([ModelLayer(AnswerIndex([prompt + prompt[1:]]))], draft_len=5)
    return out


@pytest.mark.parametrize("s", SAMPLINGS, ids=["t1", "t0.7-k8-p0.9", "t0.8-p0.8-penalties"])
def test_seeded_speculation_is_plain_seeded_sampling_token_for_token(model, s):
    kept = 0
    for prompt in PROMPTS:
        for seed in (0, 7):
            ref = Decoder(model, ()).generate(prompt, max_new_tokens=24, sampling=s, seed=seed).tokens
            for name, drafter in drafters(prompt, ref).items():
                g = Decoder(model, (), drafter).generate(prompt, max_new_tokens=24, sampling=s, seed=seed)
                assert g.tokens == ref, (name, prompt, seed)
                kept += sum(ls.accepted for ls in g.stats.layers.values())
            pred = Decoder(model, ()).generate(prompt, max_new_tokens=24, sampling=s, seed=seed, prediction=ref[:10] + [3, 3] + ref[12:])
            assert pred.tokens == ref
    assert kept > 100   # drafts were really kept, not only rejected


class CountingRecycled(RecycledLayer):
    """The recycle layer, counting the drafts it priced by recorded probabilities."""

    def __init__(self, table):
        super().__init__(table)
        self.priced_drafts = 0

    def candidates(self, history, max_len, max_candidates=1):
        got = super().candidates(history, max_len, max_candidates)
        self.priced_drafts += sum(isinstance(d, Draft) and d.p is not None for d in got)
        return got


@pytest.mark.parametrize("s", SAMPLINGS + [Sampling()], ids=["t1", "t0.7-k8-p0.9", "t0.8-p0.8-penalties", "greedy"])
def test_priced_recycle_trees_keep_plain_output(model, s):
    """Trees the recycle layer grows from the target's sampled rows (several children where it was
    unsure, priced by their probabilities) leave seeded sampled output plain decoding's token for
    token, and greedy output too (the table warmed by sampled answers first)."""
    table = RecycledTable(top_k=3)
    for prompt in PROMPTS:   # warm: sampled records, so greedy streams meet priced drafts too
        Decoder(model, (), Hierarchy([RecycledLayer(table)])).generate(prompt, max_new_tokens=24, sampling=SAMPLINGS[0], seed=1)
    priced = kept = 0
    for prompt in PROMPTS:
        for seed in (0, 7, 9):
            ref = Decoder(model, ()).generate(prompt, max_new_tokens=24, sampling=s, seed=seed).tokens
            layer = CountingRecycled(table)
            g = Decoder(model, (), Hierarchy([ContextDB(1, 3), layer], draft_len=5, max_candidates=4)).generate(
                prompt, max_new_tokens=24, sampling=s, seed=seed)
            assert g.tokens == ref, (prompt, seed)
            priced += layer.priced_drafts
            kept += g.stats.layers["recycle"].accepted if "recycle" in g.stats.layers else 0
    assert priced > 10 and kept > 10   # priced trees were drafted (greedy records overwrite some) and kept


def test_seeded_choices_differ_and_repeat(model):
    s = Sampling(temperature=1.0)
    prompt = PROMPTS[0]
    a = [Decoder(model, ()).generate(prompt, max_new_tokens=16, sampling=s, seed=3, choice=c).tokens for c in range(3)]
    b = [Decoder(model, (), RandomTree()).generate(prompt, max_new_tokens=16, sampling=s, seed=3, choice=c).tokens for c in range(3)]
    assert a == b and len({tuple(x) for x in a}) == 3
    assert Decoder(model, ()).generate(prompt, max_new_tokens=16, sampling=s, seed=4).tokens != a[0]


def test_seeded_stream_beside_another_in_one_forward(model):
    """hd serve's path: the seeded stream's tokens are its plain ones, whatever shares the forward."""
    s = Sampling(temperature=1.0, top_p=0.9)
    ref = Decoder(model, ()).generate(PROMPTS[0], max_new_tokens=20, sampling=s, seed=11).tokens
    a = Decoder(model, (), RandomTree(1)).stream(Request(PROMPTS[0], 20, s, seed=11))
    b = Decoder(model, (), Hierarchy([ContextDB(1, 3)], draft_len=4)).stream(
        Request(PROMPTS[2], 30, Sampling(temperature=0.9), seed=5))
    while not a.done:
        step_together(as_target(model), [a, b])
    assert a.result().tokens == ref


def test_noise_keyed_by_step_breaks_the_equality(model, monkeypatch):
    """The control: draws keyed by how many steps ran (what a non-coupled sampler consumes) give
    speculation other tokens than plain decoding with the same seed."""
    s = Sampling(temperature=1.0)
    steps = {"n": 0}
    real = verify.accept_tree

    def keyed_by_step(logits, tree, s, key=0, position=0, targets=None):
        steps["n"] += 1
        return real(logits, tree, s, key, steps["n"], targets)

    monkeypatch.setattr(loop, "accept_tree", keyed_by_step)
    differ = 0
    for seed in range(4):
        steps["n"] = 0
        ref = Decoder(model, ()).generate(PROMPTS[0], max_new_tokens=24, sampling=s, seed=seed).tokens
        steps["n"] = 0
        got = Decoder(model, (), Oracle(len(PROMPTS[0]), ref)).generate(PROMPTS[0], max_new_tokens=24, sampling=s, seed=seed).tokens
        differ += got != ref
    assert differ > 0


# --- the cheap chooser against the full distribution ----------------------------------------------

def exact_law(row: torch.Tensor, s: Sampling, grid: int = 20000) -> torch.Tensor:
    """coupled_choice's distribution, read off a fine grid of u (it is the inverse CDF at u): every
    grid point a call, counted in a list (a tensor's += was a fifth of the cost) and in inference
    mode as the decode loop calls it (no autograd bookkeeping a torch op)."""
    counts = [0] * row.shape[-1]
    with torch.inference_mode():
        for j in range(grid):
            counts[coupled_choice(row, s, (j + 0.5) / grid)] += 1
    return torch.tensor(counts, dtype=torch.float32) / grid


ROWS = {"peaked": torch.cat([torch.tensor([9.0, 8.5, 8.0, 7.0]), torch.randn(396, generator=torch.Generator().manual_seed(0))]),
        "flat": torch.randn(400, generator=torch.Generator().manual_seed(1)) * 0.3,   # top-p grows its search
        "ties": torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 0.0] * 50)}
CHOOSERS = [Sampling(temperature=0.7), Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=1.3, top_p=0.5),
            Sampling(temperature=0.7, top_k=5), Sampling(temperature=1.0, top_k=50, top_p=0.8)]


@pytest.mark.parametrize("row", list(ROWS), ids=list(ROWS))
@pytest.mark.parametrize("s", CHOOSERS, ids=["t0.7", "p0.9", "t1.3-p0.5", "k5", "k50-p0.8"])
def test_cheap_chooser_has_the_full_distribution(row, s):
    x = ROWS[row]
    want = target_probs(x[None], s)[0]
    got = exact_law(x, s)
    if row == "ties" and (s.top_k or s.top_p < 1):
        # which of equal tokens a truncation keeps is the sort's choice (in both): compare the mass
        # per distinct logit value instead
        for value in x.unique():
            at = x == value
            assert abs(float(got[at].sum() - want[at].sum())) < 2e-3
        return
    assert float((got - want).abs().max()) < 2e-3
    assert got[want == 0].sum() == 0   # never a token the truncation drops


def test_a_wrong_truncation_is_caught(monkeypatch):
    """The control: a nucleus one token short (3 of the peaked row's 4) moves the law past the
    tolerance above."""
    x, s = ROWS["peaked"], Sampling(temperature=1.0, top_p=0.9)
    real = verify._ranked
    monkeypatch.setattr(verify, "_ranked", lambda z, k, p: tuple(t[:3] if t is not None and t.dim() else t
                                                                   for t in real(z, k, p)))
    got, want = exact_law(x, s, 4000), target_probs(x[None], s)[0]
    assert float((got - want).abs().max()) > 2e-3


def test_position_uniforms_are_uniform_and_keyed():
    """The counter-based draws: uniform over keys and positions (chi-square on 20 bins), and a
    function of (seed, choice, position) only."""
    us = [position_uniform(sampling_key(seed), pos) for seed in range(500) for pos in range(20)]
    counts = [0] * 20
    for u in us:
        counts[int(u * 20)] += 1
    assert chisquare(counts).pvalue > 1e-3
    assert position_uniform(sampling_key(5, 1), 3) == position_uniform(sampling_key(5, 1), 3)
    assert len({position_uniform(sampling_key(5, c), 3) for c in range(4)}) == 4
    assert sampling_key(None) != sampling_key(None)


# --- the compiled draw (csrc/qmm.cpp's draw: coupled_choice without top-k or top-p on the CPU) ----

def _expn(x: np.ndarray) -> np.ndarray:
    """qmm.cpp's expn in numpy float32, operation for operation (each rounded, no FMA)."""
    f = np.float32
    magic = f(12582912.0)
    with np.errstate(over="ignore", invalid="ignore"):   # -inf scores: garbage, masked below
        t = x * f(1.44269504088896341) + magic
        kf = t - magic
        r = x - kf * f(0.693145751953125)
        r = r - kf * f(1.428606765330187045e-06)
        q = np.full_like(x, f(1.0) / f(5040.0))
        for c in (f(1.0) / f(720.0), f(1.0) / f(120.0), f(1.0) / f(24.0), f(1.0) / f(6.0), f(0.5), f(1.0), f(1.0)):
            q = q * r + c
        k = t.view(np.uint32) - magic.view(np.uint32)
        scale = ((k + np.uint32(127)) << np.uint32(23)).astype(np.uint32).view(np.float32)
        out = q * scale
    return np.where(x < f(-87.0), f(0.0), out).astype(np.float32)


def _reference_draw(row: torch.Tensor, temperature: float, u: float) -> int:
    """The draw as its comment in qmm.cpp states it, in numpy: z = x (1/T), w = expn(z - max z),
    the CDF by lanes of eight (lane i % 8, then i), each lane's sums in fp64 in order."""
    x = row.float().numpy()
    inv = np.float32(1.0) / np.float32(temperature)
    w = _expn(x * inv - np.float32(x.max()) * inv)
    lanes = [np.add.accumulate(w[lane::8].astype(np.float64)) for lane in range(8)]
    base = [0.0]
    for c in lanes:
        base.append(base[-1] + (float(c[-1]) if len(c) else 0.0))
    t = u * base[8]
    lane = next(i for i in range(8) if base[i + 1] > t or i == 7)
    slot = int(np.argmax(base[lane] + lanes[lane] > t))
    return slot * 8 + lane


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_draw_is_its_stated_arithmetic(dtype):
    """qmm.cpp's draw gives the token its stated order and arithmetic give, for every u of a grid
    (numpy reimplements it): rows whose length is and is not whole vectors of 8 (the scalar tail
    and the vector loop agree), peaked and flat rows, masked (-inf) tokens. The negative control:
    the CDF in token order instead of by lanes draws other tokens for some u, so the comparison
    sees an order. A row with a NaN is left to the torch ops (-1)."""
    from hdcli.engine.kernels import quants
    quants.GEMM.load()
    module = quants.GEMM.compiled
    if module is None:
        pytest.skip(f"csrc/qmm.cpp does not build here ({quants.failure()})")
    g = torch.Generator().manual_seed(3)
    caught = False
    for V in (1, 5, 13, 400, 4099, 49152):
        for scale in (0.3, 4.0):
            row = (torch.randn(V, generator=g) * scale).to(dtype)
            if V > 20:
                row[::7] = float("-inf")
            for T in (0.7, 1.3):
                for j in range(40):
                    u = (j + 0.37) / 40
                    got = module.draw(row, T, u)
                    assert got == _reference_draw(row, T, u), (V, scale, T, u)
                    assert row[got] > float("-inf")
                    if V > 20:
                        w = torch.softmax(row.float() / T, -1).double().cumsum(-1)
                        caught |= got != int(torch.searchsorted(w, torch.tensor([u * float(w[-1])], dtype=torch.float64), right=True)[0])
    assert caught, "the token-order CDF drew the same tokens everywhere: the comparison would not see the order"
    for name, row in ROWS.items():   # its law, read off a fine grid of u, is the target's
        grid = 20000
        counts = torch.zeros(row.shape[-1])
        for j in range(grid):
            counts[module.draw(row.to(dtype), 0.7, (j + 0.5) / grid)] += 1
        want = target_probs(row.to(dtype)[None].float(), Sampling(temperature=0.7))[0]
        assert float((counts / grid - want).abs().max()) < 2e-4, name
    bad = torch.randn(64, generator=g).to(dtype)
    bad[10] = float("nan")
    assert module.draw(bad, 0.7, 0.5) == -1


def test_compiled_probabilities_of_recorded_tokens_are_the_softmax():
    """top_probs (what a sampled step tells the recycle layer) through qmm.cpp's probs_of is the
    softmax of the row / T at the named tokens, to its exp's precision: bf16 and fp32 rows, lengths
    off whole vectors, masked tokens (probability 0). The negative control: at another
    temperature the same comparison fails."""
    from hdcli.engine.decode import verify
    from hdcli.engine.kernels import quants
    quants.GEMM.load()
    module = quants.GEMM.compiled
    if module is None:
        pytest.skip(f"csrc/qmm.cpp does not build here ({quants.failure()})")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        for V in (3, 13, 49152):
            x = (torch.randn(4, V, generator=g) * 3).to(dtype)
            x[1, 0] = float("-inf")
            ids = torch.tensor([[0, V - 1]] * 4)
            want = torch.softmax(x.float() / 0.7, -1).gather(1, ids)
            got = module.probs_of(x, ids, 0.7)
            assert torch.allclose(got, want, rtol=1e-5, atol=0), (dtype, V)
            assert got[1, 0] == 0
            assert not torch.allclose(module.probs_of(x, ids, 0.9), want, rtol=1e-5, atol=0)
            assert verify.top_probs(x, ids.tolist(), Sampling(temperature=0.7)) == got.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_without_a_distribution_draws_greedys_token(dtype):
    """coupled_choice on a row holding a NaN, +inf (inf - inf) or only -inf (no distribution to draw from),
    gives the token greedy decoding takes there (numpy's argmax: the first NaN, else the lowest
    index of the max) at every u, through every path: the compiled draw (which leaves such a row
    to the torch ops), top-k, top-p. Before, the cumulative sum's NaN sent the search past the end
    (token V, outside the vocabulary) or top-p kept no token (an IndexError). A finite row still draws
    by u (the control: across u it gives more than one token)."""
    from hdcli.engine.decode import verify
    g = torch.Generator().manual_seed(11)
    V = 4099
    nan = (torch.randn(V, generator=g) * 3).to(dtype)
    nan[[2000, 77]] = float("nan")
    inf = (torch.randn(V, generator=g) * 3).to(dtype)
    inf[[3001, 1234]] = float("inf")
    finite = (torch.randn(V, generator=g) * 0.1).to(dtype)
    for s in (Sampling(temperature=0.7), Sampling(temperature=0.7, top_k=50), Sampling(temperature=0.7, top_p=0.9)):
        for row, want in ((nan, 77), (inf, 1234), (torch.full((V,), float("-inf"), dtype=dtype), 0)):
            assert {verify.coupled_choice(row, s, (j + 0.5) / 9) for j in range(9)} == {want}, (s, want)
        assert len({verify.coupled_choice(finite, s, (j + 0.5) / 9) for j in range(9)}) > 1, s

"""The sampling path must have exactly the target's distribution.

Each test draws N samples with a fixed seed and runs Pearson's chi-square test against the exact
distribution computed from the model's logits, rejecting at alpha = 1e-3: with a correct rule a
run fails with probability 0.1% per test (and, the seed being fixed, either always or never).
A broken rule (accept with 1.3 p(x), or halve p(x) on rejection instead of zeroing it)
moves the distribution by far more than these sample sizes resolve; both were checked to fail
(again with the decode loop's coupled rule: accept_tree walking each node by sample_point_masses
with either break, every sampled test here and test_tree's failed, p < 1e-5; unbroken, all passed).

Cost: the N generations are a few thousand forwards of a 16-wide model, so they run on hd's own
forward (conftest.owned_copy: about a third cheaper a forward than transformers' here, the same
weights, fp32) and on one thread (`one_thread`: ops this small only lose to a second thread's
start-up, and on a loaded machine each op waits for the other thread: a forward 20-30x slower,
measured). Neither changes what is drawn or compared.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from scipy.stats import chisquare

from hdcli.engine.decode.loop import Decoder
from hdcli.drafting import ContextDB, Hierarchy
from hdcli.engine.decode.verify import Sampling, processed, sample_point_masses, target_probs
from hdcli.engine.model.target import as_target

from conftest import FixedCandidates, owned_copy, step_together, tiny_llama

ALPHA = 1e-3
V = 8


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square p-value, pooling outcomes whose expected count is below 5."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    total = sum(probs.values())  # 1 up to float rounding, which scipy's check would trip on
    for k, p in probs.items():
        p = p / total
        if p * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += p * n
    assert sum(counts.get(k, 0) for k in counts if k not in probs) == 0, "impossible outcome drawn"
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    return chisquare(obs, exp).pvalue


@torch.inference_mode()
def exact_two_token_distribution(model, prompt, s: Sampling) -> dict:
    """P(first two tokens), the logits processed as plain decoding processes them (penalties count
    the generated tokens: none for the first, t1 for the second)."""
    probs = {}
    p1 = target_probs(processed(as_target(model).forward(torch.tensor([prompt]))[-1:], s, []), s)[0]
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        p2 = target_probs(processed(as_target(model).forward(torch.tensor([prompt + [t1]]))[-1:], s, [t1]), s)[0]
        for t2 in range(V):
            if p2[t2] > 0:
                probs[(t1, t2)] = float(p1[t1] * p2[t2])
    return probs


@contextlib.contextmanager
def single_thread():
    """torch on one intra-op thread for the block, the count restored after (see the header)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The whole module on one thread, the models' loads included (the M-invariant mode's records
    are kept per thread count)."""
    with single_thread():
        yield


def sampling_llama(folder):
    """The target of the distribution tests (here, test_tree, test_stack): the tiny llama on hd's
    own forward, fp32 (the header)."""
    return owned_copy(tiny_llama(vocab_size=V, seed=3, hidden=16, scale=3.0), folder).model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sampling_llama(tmp_path_factory.mktemp("sampling-llama-16"))


# the third goes through logits processors: a drafted second token is verified on a row penalised
# for the first (its path), which the test was checked to fail without (path counts left out)
SAMPLINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9),
             Sampling(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias=((2, 1.0),))]


@pytest.mark.parametrize("s", SAMPLINGS, ids=["t1", "t0.7-k5-p0.9", "t1-penalties-bias"])
@pytest.mark.parametrize("layer", ["fixed", "context", "model", "recycle"])
def test_first_two_tokens_follow_target_distribution(model, s, layer):
    prompt = [1, 3, 4, 3, 4, 3]
    probs = exact_two_token_distribution(model, prompt, s)
    # draft the most likely pair so acceptance and rejection both happen often
    best = max(probs, key=probs.get)
    if layer == "model":  # the model DB's answer index, holding an answer that continues the prompt
        # with the best pair, and learning every sampled answer as it goes; the default policy
        from hdcli.drafting.model import AnswerIndex, ModelLayer, available
        if not available():
            pytest.skip("arctic-inference is not installed")
        drafter = Hierarchy([ModelLayer(AnswerIndex([prompt + list(best)]))], policy="fill-tracked",
                            draft_len=2)
    elif layer == "recycle":   # the target's own sampled rows, recycled as trees priced by their
        # probabilities (several first tokens: the prompt's bigram is recorded by the first answer)
        from hdcli.drafting import RecycledLayer, RecycledTable
        table = RecycledTable(top_k=3)
        drafter = Hierarchy([RecycledLayer(table)], policy="fill-tracked", draft_len=2, max_candidates=4)
    else:
        drafter = Hierarchy([FixedCandidates("fixed", [best]) if layer == "fixed" else ContextDB(1, 3)], draft_len=2)
    dec = Decoder(model, (), drafter)
    n, counts, accepted = 3000, {}, 0
    for seed in range(n):
        g = dec.generate(prompt, max_new_tokens=3, sampling=s, seed=seed)
        key = tuple(g.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(ls.accepted for ls in g.stats.layers.values())
    assert accepted > n / 10  # the drafts were really accepted, often
    if layer == "recycle":    # ... from trees grown on recorded probabilities
        assert table.bigram[tuple(prompt[-2:])][1] is not None
    assert chi2_pvalue(counts, probs, n) > ALPHA


def test_point_masses_with_several_candidates():
    """The rule with several candidates at one position (repeats included), alone."""
    p = torch.tensor([0.05, 0.3, 0.25, 0.1, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    for cands in [(1,), (2, 4), (1, 2, 1, 5), (0, 3)]:
        counts = {}
        for _ in range(n):
            tok, _ = sample_point_masses(p, cands, gen)
            counts[tok] = counts.get(tok, 0) + 1
        assert chi2_pvalue(counts, {i: float(x) for i, x in enumerate(p)}, n) > ALPHA


def test_greedy_sampling_settings():
    assert Sampling().greedy and not Sampling(temperature=0.5).greedy
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)
    probs = target_probs(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), Sampling(temperature=1.0, top_k=2))
    assert probs[0, :2].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    probs = target_probs(torch.tensor([[0.0, 0.0, 5.0, 5.0]]), Sampling(temperature=1.0, top_p=0.5))
    assert probs[0, :2].sum() == 0  # the two top tokens already make 0.5


@pytest.fixture(scope="module")
def invariant_model(tmp_path_factory):
    """A tiny llama in the M-invariant mode, where streams share one forward (batch.py); hidden 64
    as in tests/test_invariant.py (at 16 the fp32 GEMMs' rows are not M-invariant: the mode refuses)."""
    from hdcli.engine.decode import batch
    mp = pytest.MonkeyPatch()
    mp.setenv("HD_CACHE_DIR", str(tmp_path_factory.mktemp("hdcache")))
    m = owned_copy(tiny_llama(vocab_size=V, seed=3, hidden=64, scale=3.0), tmp_path_factory.mktemp("sampling-llama"),
                   invariant="on").model
    assert batch.can_batch(m)
    yield m
    mp.undo()


def test_sampling_through_a_shared_forward_follows_target_distribution(invariant_model):
    """hd serve's path: a sampled stream verified in one forward with another stream (greedy,
    drafting a chain of its own) keeps exactly the target's distribution. Checked to fail when
    the forward hands the sampled stream the other stream's rows."""
    model = invariant_model
    s = Sampling(temperature=1.0)
    prompt, other = [1, 3, 4, 3, 4, 3], [2, 5, 6, 2, 5, 6, 2]
    probs = exact_two_token_distribution(model, prompt, s)
    best = max(probs, key=probs.get)
    sampled = Decoder(model, (), Hierarchy([FixedCandidates("fixed", [best])], draft_len=2))
    greedy = Decoder(model, (), Hierarchy([ContextDB(1, 3)], draft_len=3))
    n, counts, accepted = 2000, {}, 0
    for seed in range(n):
        a = sampled.stream(prompt, max_new_tokens=3, sampling=s, seed=seed)
        b = greedy.stream(other, max_new_tokens=4)
        while not a.done:
            step_together(as_target(model), [a, b])
        g = a.result()
        counts[tuple(g.tokens[:2])] = counts.get(tuple(g.tokens[:2]), 0) + 1
        accepted += sum(ls.accepted for ls in g.stats.layers.values())
    assert accepted > n / 10
    assert chi2_pvalue(counts, probs, n) > ALPHA

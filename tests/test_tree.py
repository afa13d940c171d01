"""Tree verification: the tree mask, the KV cache after a tree, greedy exactness of every policy,
and the sampling distribution with several candidates per position (all fp32)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from hdcli.engine.decode import costs
from hdcli.engine.decode.loop import Decoder
from hdcli.drafting import AcceptanceTracker, ContextDB, Hierarchy
from hdcli.engine.decode.tree import (Tree,
                                      build_tree,
                                      cap_by_cost,
                                      cap_jointly,
                                      keep_path,
                                      node_estimates,
                                      tree_forward)
from hdcli.engine.decode.verify import Sampling
from hdcli.engine.model.target import as_target

from conftest import FixedCandidates, tiny_gemma3, tiny_llama
from test_exactness import ScriptedLayer
from test_sampling import chi2_pvalue, exact_two_token_distribution, sampling_llama, single_thread

V = 50


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    """A plain causal model and one with a sliding-window layer (window 8: the prompts below run
    past it), whose tree masks and cache entries differ from full attention's."""
    if request.param == "gemma3":
        return as_target(tiny_gemma3(vocab_size=V, seed=1, scale=4.0))
    return as_target(tiny_llama(vocab_size=V, seed=1, scale=4.0))


def plain(model, prompt, n):
    return Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=n).tokens


def random_tree(rng, n_cands=6, max_len=5):
    t = Tree()
    for _ in range(n_cands):
        base = rng.choice([[], [3], [3, 4], [7]])  # shared prefixes make branches
        t.add_candidate(base + [rng.randrange(V) for _ in range(rng.randrange(1, max_len))], "x")
    return t


@torch.inference_mode()
def prefilled(model, prompt, recording=True):
    """The cache after prompt[:-1]; recording: as the decoder makes it (sliding-window layers keep
    their past until cropped), else transformers' default."""
    cache = model.new_cache() if recording else DynamicCache(config=model.config)
    model.forward(torch.tensor([prompt[:-1]]), cache)
    return cache


@torch.inference_mode()
def test_tree_mask_logits_equal_each_path_run_alone(model):
    rng = random.Random(0)
    prompt = [1] + [rng.randrange(V) for _ in range(20)]
    for _ in range(5):
        t = random_tree(rng)
        assert not t.is_chain()
        logits = tree_forward(model, t, prompt[-1], prefilled(model, prompt))
        for node in range(1, len(t.tokens)):
            path = [t.tokens[i] for i in t.path(node)]
            alone = model.forward(torch.tensor([[prompt[-1]] + path]), prefilled(model, prompt))[-1]
            torch.testing.assert_close(logits[node], alone, atol=1e-4, rtol=1e-4)
        # the root's row is the prediction after the history itself
        alone = model.forward(torch.tensor([prompt]))[-1]
        torch.testing.assert_close(logits[0], alone, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_keep_path_leaves_exactly_the_path_in_the_cache(model):
    rng = random.Random(1)
    prompt = [1] + [rng.randrange(V) for _ in range(12)]
    t = random_tree(rng, n_cands=5)
    last_leaf = max(i for i in range(1, len(t.tokens)) if not t.children[i])
    path = t.path(last_leaf)
    assert path != list(range(1, len(path) + 1))  # a later branch: entries must move
    cache = prefilled(model, prompt)
    past = cache.get_seq_length()
    tree_forward(model, t, prompt[-1], cache)
    keep_path(cache, past, path)
    ref = prefilled(model, prompt + [t.tokens[i] for i in path] + [0], recording=False)
    assert cache.get_seq_length() == ref.get_seq_length()
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


class BranchyLayer(ScriptedLayer):
    """Proposes several candidates per step: the true continuation (read from a reference
    output, sometimes corrupted) placed at a random rank among wrong ones that share its first
    tokens, so the accepted path is often a later branch whose KV entries have to move."""

    def __init__(self, name, prompt_len, reference, seed=0, corrupt=0.2):
        super().__init__(prompt_len, reference, corrupt=corrupt, vocab=V, seed=seed)
        self.name = name

    def candidates(self, history, max_len, max_candidates):
        got = super().candidates(history, max_len, 1)
        if not got:
            return []
        true = got[0]
        cands = []
        for _ in range(max_candidates - 1):
            cut = self.rng.randrange(len(true))
            cands.append(true[:cut] + [self.rng.randrange(V) for _ in range(len(true) - cut)])
        cands.insert(self.rng.randrange(max_candidates), true)
        return cands


@pytest.mark.parametrize("policy", Hierarchy.POLICIES)
def test_greedy_tree_equals_plain_for_every_policy(model, policy):
    moved = 0
    for seed, prompt in enumerate([[1, 5, 6, 7, 8, 9], [1, 10, 11, 10, 11, 10, 11], [1] + list(range(5, 30))]):
        ref = plain(model, prompt, 60)
        layers = [BranchyLayer("a", len(prompt), ref, seed), ContextDB(1, 3),
                  BranchyLayer("b", len(prompt), ref, seed + 10, corrupt=0.5)]
        dec = Decoder(model, (), Hierarchy(layers, policy=policy, draft_len=6, max_candidates=4))
        g = dec.generate(prompt, max_new_tokens=60)
        assert g.tokens == ref
        assert max(g.stats.tree_sizes) > 6  # real trees, not chains
        moved += sum(ls.won for ls in g.stats.layers.values())
    assert moved > 0


def test_a_kept_rejected_branch_breaks_the_greedy_test(model, monkeypatch):
    """The test above fails when keep_path keeps tree order instead of moving the path: the
    cache then holds rejected branches' entries at the accepted tokens' places."""
    prompt = [1, 5, 6, 7, 8, 9]
    ref = plain(model, prompt, 60)

    def run():
        layers = [BranchyLayer("a", len(prompt), ref, 0)]
        return Decoder(model, (), Hierarchy(layers, draft_len=6, max_candidates=4)).generate(
            prompt, max_new_tokens=60).tokens

    assert run() == ref

    def broken(cache, past, path):
        remove = cache.get_seq_length() - (past + 1 + len(path))
        if remove:
            cache.crop(-remove)
    monkeypatch.setattr("hdcli.engine.decode.loop.keep_path", broken)
    assert run() != ref


def test_cost_cap_keeps_likely_nodes_and_drops_what_does_not_pay():
    t = Tree()
    t.add_candidate([1, 2, 3, 4], "good")
    t.add_candidate([5, 6], "bad")
    rates = {"good": 0.9, "bad": 0.05}
    est = node_estimates(t, lambda layer, depth, first: rates[layer])
    assert est[1] == pytest.approx(0.9) and est[5] == pytest.approx(0.1 * 0.05)
    free = cap_by_cost(t, est, costs.flat(1.0))  # a free forward: keep every node
    assert free.size() == 6
    steep = costs.CostCurve({1: 1.0, 2: 1.6, 4: 1.7, 8: 1.9, 64: 6.0})
    kept = cap_by_cost(t, est, steep)
    assert kept.tokens[1:] == [1, 2, 3, 4]  # the unlikely branch is not worth its cost
    low = {"good": 0.2, "bad": 0.05}
    hopeless = cap_by_cost(t, node_estimates(t, lambda layer, depth, first: low[layer]), steep)
    assert hopeless.size() == 0  # plain decoding is cheaper than this draft


def test_branch_cost_keeps_the_best_chain_where_branches_do_not_pay():
    """Two likely candidates: a forward that prices rows only keeps both; one whose trees pay a
    branch cost per row (the M-invariant tree attention) keeps the likelier chain, even though
    the ranking of all nodes branches at its second node."""
    t = Tree()
    t.add_candidate([1, 2, 3], "a")
    t.add_candidate([4, 5, 6], "b")
    est = node_estimates(t, lambda layer, depth, first: {"a": 0.6, "b": 0.9}[layer])
    rows_only = costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0})
    assert cap_by_cost(t, est, rows_only).size() == 6
    branchy_cost = costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}, branch=0.3)
    kept = cap_by_cost(t, est, branchy_cost)
    assert kept.is_chain() and kept.tokens[1:] == [1, 2, 3]
    assert branchy_cost.forward(4, 1, 4) == pytest.approx(branchy_cost(4) + 1.2)


def test_joint_cap_prices_streams():
    """Streams in one forward: the stream term is part of the forward's fixed cost, so where each
    further stream costs more (measured), a drafted row adds relatively less and more are kept;
    where streams are priced as rows only, the rows look dear against a forward too cheap."""
    trees, ests = [], []
    for s in range(4):
        t = Tree()
        t.add_candidate([1 + s, 2, 3, 4], "a")
        trees.append(t)
        ests.append(node_estimates(t, lambda layer, depth, first: 0.5))
    rows = {1: 1.0, 4: 1.1, 8: 1.4, 16: 2.0, 64: 6.0}
    cheap = cap_jointly(trees, ests, costs.CostCurve(rows, stream=0.0), 64)
    dear = cap_jointly(trees, ests, costs.CostCurve(rows, stream=0.6), 64)
    assert 4 <= sum(map(len, cheap)) < sum(map(len, dear))
    assert all(k[0] == 0 for k in dear)


def test_measured_extras(model):
    """measure_extras times a tree against a chain and (where the model batches) streams against
    rows: non-negative, and a forward each (1.0) where streams are not batched."""
    branch, stream = costs.measure_extras(model, context=16, rounds=1)
    assert branch >= 0.0 and stream == 1.0   # this fixture's model is not in the M-invariant mode


def test_measured_cost_curve_is_monotone(model):
    curve = costs.measure(model, context=16, repeats=1, widths=(1, 4, 16))
    assert curve(1) == 1.0 and curve(4) <= curve(16) and curve(10) <= curve(16)
    assert curve(32) >= curve(16)


def test_adaptive_tracker_follows_acceptance_and_recovers():
    tr = AcceptanceTracker({"a": 0.5, "b": 0.5})
    for _ in range(20):
        tr.update({("a", 1): 4, ("b", 1): 4}, {("a", 1): 4, ("b", 1): 0})
    assert tr.rate("a", 1) > 0.9 and tr.rate("b", 1) < 0.1
    for _ in range(60):  # b no longer drafted: it drifts back towards its prior
        tr.update({("a", 1): 4}, {("a", 1): 4})
    assert tr.rate("b", 1) > 0.4


def test_adaptive_gives_every_matching_layer_a_slot():
    h = Hierarchy([FixedCandidates("a", [[1], [2], [3]]), FixedCandidates("b", [[4], [5]])], policy="adaptive",
                  max_candidates=3)
    h.reset([0])
    h.observe({("a", 1): 10, ("b", 1): 10}, {("a", 1): 10, ("b", 1): 0})
    got = h.propose([0], 4)
    assert [d.layer for d in got] == ["a", "a", "b"]  # best layer first, b keeps one slot
    fill = Hierarchy(h.layers, policy="fill", max_candidates=4).propose([0], 4)
    assert [d.tokens for d in fill] == [(1,), (2,), (3,), (4,)]
    first = Hierarchy(h.layers, policy="first-hit", max_candidates=4).propose([0], 4)
    assert [d.layer for d in first] == ["a", "a", "a"]


@pytest.fixture(scope="module")
def sampling_model(tmp_path_factory):
    """test_sampling's target (V 8, hidden 16), on hd's own forward as there (test_sampling's header)."""
    return sampling_llama(tmp_path_factory.mktemp("tree-sampling-llama"))


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["t1", "t0.7-k5-p0.9"])
def test_sampling_through_a_tree_follows_target_distribution(sampling_model, s):
    m = sampling_model
    prompt = [1, 3, 4, 3, 4, 3]
    probs = exact_two_token_distribution(m, prompt, s)
    ranked = sorted(probs, key=probs.get, reverse=True)
    # several first tokens, some with two second tokens: the point-mass rule at both depths
    cands = [list(ranked[0]), [ranked[0][0], ranked[1][1]], list(ranked[2]), list(ranked[3])]
    dec = Decoder(m, (), Hierarchy([FixedCandidates("tree", cands)], draft_len=2, max_candidates=4))
    n, counts, later_branch = 3000, {}, 0
    with single_thread():   # a 16-wide model (test_sampling's header)
        for seed in range(n):
            g = dec.generate(prompt, max_new_tokens=3, sampling=s, seed=seed)
            key = tuple(g.tokens[:2])
            counts[key] = counts.get(key, 0) + 1
            acc = g.stats.layers["tree"].accepted
            later_branch += (acc >= 1 and key[0] != cands[0][0]) or (acc >= 2 and key[1] != cands[0][1])
    assert later_branch > n / 20  # children after the first really won, at either depth
    assert chi2_pvalue(counts, probs, n) > 1e-3


def test_drafting_defaults_follow_the_measured_verification_cost(tiny_lm, monkeypatch):
    """Cheap verification (bf16, or fp32 on packed kernels) unlocks unigram keys and ungated DB
    drafts; a costly one (fp32 on torch's kernels, 1.6x at 8 tokens) keeps the stricter defaults."""
    from hdcli import api
    for cost8, cheap in ((1.6, False), (1.23, True)):
        monkeypatch.setattr(costs, "curve_for", lambda lm, c=cost8: costs.CostCurve({1: 1.0, 8: c}))
        assert api.cheap_verification(tiny_lm) is cheap
        context = api.make_drafter(["context"], cheap_verify=cheap).layers[0]
        assert context.min_n == (1 if cheap else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_tokens_first_is_argmax_even_on_ties_and_logits_stay(dtype):
    """The decoder's one top-k per step: the first is exactly argmax's (lowest index among equal
    maxima: greedy acceptance depends on it), the next the best of the rest, and the logits are
    not touched (an fp32 tensor converts to itself: masking it in place would corrupt them)."""
    from hdcli.engine.decode.verify import top_tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g).to(dtype)
    x[1, 700] = x[1, 20] = 9.0          # a tie for the best: 20 first
    x[2, 5] = 9.0
    x[2, 6] = 8.0                       # best 5, second 6
    before = x.clone()
    top = top_tokens(x, 2)
    assert [t[0] for t in top] == x.float().argmax(-1).tolist()
    assert top[1] == [20, 700] and top[2] == [5, 6]
    for row, (a, b) in zip(x.float(), top):
        assert a != b and row[b] == row.scatter(0, torch.tensor([a]), float("-inf")).max()
    assert torch.equal(x, before)
    assert top_tokens(x, 1) == [[t[0]] for t in top]


def test_compiled_top_indices_are_numpys_argmaxes():
    """csrc/qmm.cpp's top_indices (top_tokens where the GEMM is loaded) gives numpy_top's indices
    exactly: bf16 and fp32, ties (bf16 rounds many scores together), rows masked to a few numbers
    (a grammar's), rows of -inf alone (k past the numbers left: numpy's lowest -inf index), NaNs,
    row lengths that are not whole vector blocks. The negative control: torch.topk, which does not
    order ties by index, is caught by the same comparison."""
    from hdcli.engine.decode.verify import numpy_top
    from hdcli.engine.kernels import quants
    module = quants.gemm_module()
    if module is None:
        pytest.skip(f"the compiled GEMM does not load here ({quants.failure()})")
    g = torch.Generator().manual_seed(1)
    caught = False
    for dtype in (torch.bfloat16, torch.float32):
        for V in (1, 3, 8, 13, 1000, 49152):
            x = (torch.randn(9, V, generator=g) * 3).round().to(dtype)   # many equal scores
            if V > 5:
                x[1, :] = float("-inf")
                x[1, [4, V - 1]] = torch.tensor([2.0, 2.0], dtype=dtype)    # two numbers left, then -inf
                x[2, :] = float("-inf")                                      # nothing but -inf
                x[3, V // 2] = float("nan")
                x[4, [1, V - 2]] = float("nan")
                x[5, 0] = float("-inf")
                x[6, :] = x[6, 0]                                            # every score equal
            for k in sorted({1, 2, 3, min(V, 5)}):
                if k > V:
                    continue
                want = numpy_top(x, k)
                assert module.top_indices(x, k).tolist() == want, (dtype, V, k)
                if k > 1 and V > 5:
                    caught |= torch.topk(x.float().nan_to_num(nan=float("inf")), k).indices.tolist() != want
    assert caught, "torch.topk agreed with numpy everywhere: the comparison would not see a misordered tie"


def test_one_stream_cap_is_the_joint_cap_of_one_stream():
    """cap_by_cost's one-stream path (the decode loop's) keeps exactly what cap_jointly keeps for
    one tree, over random trees, estimates and cost curves (ties included: estimates are coarse)."""
    import random
    from hdcli.engine.decode.tree import _cap_one
    rng = random.Random(0)
    curves = [costs.flat(1.0), costs.CostCurve({1: 1.0, 2: 1.02, 4: 1.12, 8: 1.48, 16: 2.3, 64: 7.3}),
              costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}, branch=0.3), lambda w: 1.0 + 0.2 * (w - 1)]
    differ = 0
    for trial in range(300):
        t = Tree()
        for c in range(rng.randint(1, 5)):
            t.add_candidate([rng.randint(0, 4) for _ in range(rng.randint(1, 6))], rng.choice("abc"))
        rates = {k: rng.choice([0.05, 0.3, 0.5, 0.9]) for k in "abc"}
        est = node_estimates(t, lambda layer, depth, first: rates[layer] if first else rates[layer] / 2)
        for cost in curves:
            m = rng.randint(1, 12)
            one, joint = _cap_one(t, est, cost, m), cap_jointly([t], [est], cost, m + 1)[0]
            assert one == joint
            differ += len(one) != len(t.tokens)
    assert differ > 100  # the caps did cut trees: the comparison was not vacuous


def test_fill_tracked_cuts_by_this_answers_acceptance_and_fill_by_priors():
    """fill-tracked proposes as fill does (same slots, same order) but rates nodes, and so cuts
    trees, by what the layers' drafts were accepted at in this answer; fill keeps its priors."""
    layers = [FixedCandidates("a", [[1, 2, 3], [4]]), FixedCandidates("b", [[5, 6]])]
    fill = Hierarchy(layers, policy="fill", max_candidates=3, priors={"a": 0.5, "b": 0.5})
    tracked = Hierarchy(layers, policy="fill-tracked", max_candidates=3, priors={"a": 0.5, "b": 0.5})
    assert fill.propose([0], 4) == tracked.propose([0], 4)
    for h in (fill, tracked):
        for _ in range(20):
            h.observe({("a", 1): 4, ("a", 2): 4, ("a", 3): 4, ("b", 0): 4},
                      {("a", 1): 4, ("a", 2): 4, ("a", 3): 4, ("b", 0): 0})
    assert fill.rate("a", 1) == fill.rate("b", 1, False) == 0.5
    assert tracked.rate("a", 1) > 0.9 and tracked.rate("b", 1, False) < 0.1
    steep = costs.CostCurve({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0, 64: 8.0})
    kept_tracked = build_tree(tracked.propose([0], 4), tracked.rate, steep)
    kept_fill = build_tree(fill.propose([0], 4), fill.rate, steep)
    assert kept_tracked.tokens[1:4] == [1, 2, 3] and 5 not in kept_tracked.tokens
    assert kept_fill.tokens != kept_tracked.tokens


def test_known_probabilities_price_nodes_exactly():
    """A node whose probability the drafter knew (Draft.p: recycle under sampling) is accepted with
    it once its parent is; siblings are disjoint draws, so a later one gets at most what the earlier
    left. Control: with the probabilities dropped the same tree is priced by the layer rate."""
    from hdcli.engine.decode.draft import Draft
    drafts = [Draft((1, 2), "recycle", p=(0.6, 0.5)), Draft((3,), "recycle", p=(0.3,)),
              Draft((4,), "recycle", p=(0.5,)), Draft((5, 6), "context")]
    t = Tree()
    for d in drafts:
        t.add_candidate(d.tokens, d.layer, d.p)
    est = node_estimates(t, lambda layer, depth, first: 0.25)
    by_token = dict(zip(t.tokens[1:], est[1:]))
    assert by_token[1] == pytest.approx(0.6) and by_token[2] == pytest.approx(0.3)
    assert by_token[3] == pytest.approx(0.3)
    assert by_token[4] == pytest.approx(0.1)          # 1 - 0.6 - 0.3 left, not 0.5
    assert by_token[5] == 0.0 and by_token[6] == 0.0  # nothing left for a rate-priced sibling
    plain = Tree()
    for d in drafts:
        plain.add_candidate(d.tokens, d.layer)
    assert node_estimates(plain, lambda layer, depth, first: 0.25)[1] == pytest.approx(0.25)
    assert plain.subtree([0, 1, 2]).probs == [None, None, None]
    assert t.subtree([0, 1, 2]).probs == [None, 0.6, 0.5]   # kept through a cap


def test_recycled_tree_grows_best_first_from_bigram_records():
    """Under sampling the recycle layer grows the likeliest paths of its bigram records, several
    children where the target was unsure, each token with its recorded probability; a unigram
    match (another context) is walked unpriced, as when greedy."""
    from hdcli.drafting import RecycledLayer, RecycledTable
    table = RecycledTable(top_k=2)
    # the forward after 7 -> 8 predicted 10 (0.5) or 11 (0.45); after 8 -> 10: 12 (0.9); 8 -> 11: 13 (0.2)
    table.record([7], [8, 10, 11], [-1, 0, 0], [[10, 11], [12, 14], [13, 15]],
                 [[0.5, 0.45], [0.9, 0.05], [0.2, 0.1]])
    layer = RecycledLayer(table, tree_nodes=4, min_path_prob=0.02)
    got = layer.candidates([7, 8], max_len=3, max_candidates=4)
    paths = {d.tokens: d.p for d in got}
    assert paths == {(10, 12): (0.5, 0.9), (11, 13): (0.45, 0.2)}   # 4 nodes: 10, 12, 11, 13 (0.45*0.2 > 0.45*0.1)
    assert layer.priced
    assert [list(c) for c in layer.candidates([9, 8], 3, 4)] == [[10, 12], [11, 13]]  # unigram: the walk
    table.record([7], [8], [-1], [[10, 11]])   # a greedy record: no probabilities
    assert not layer.priced and all(not hasattr(c, "p") for c in layer.candidates([7, 8], 3, 4))


def test_recycled_next_best_tokens_start_candidates_for_the_token_after_next():
    """LogitSpec: the last history token is the best of the row recorded before it; that row's
    next-best tokens start candidates for the token after it, walked on through the table and
    tagged 'recycle:next'. Controls: no such candidate when the last token is not that row's best
    (another path was taken), when sampled (probabilities recorded), or when switched off."""
    from hdcli.drafting import RecycledLayer, RecycledTable
    table = RecycledTable(top_k=2)
    # after 6 -> 7 the target predicted 8 (best) or 9; after 8 -> 9 it predicted 5
    table.record([6], [7, 9], [-1, -1], [[8, 9], [5, 4]])
    table.record([8], [9], [-1], [[5, 4]])
    layer = RecycledLayer(table, next_next=True)
    got = layer.candidates([6, 7, 8], max_len=3, max_candidates=4)
    nxt = [d for d in got if getattr(d, "layer", None) == "recycle:next"]
    assert [d.tokens for d in nxt] == [(9, 5)] == [tuple(d.tokens) for d in got]  # 9, then (8, 9) -> 5
    table.record([7], [8], [-1], [[3, 9]])     # 8 seen as input: its own walk comes first, 9 is not repeated
    got = layer.candidates([6, 7, 8], 3, 4)
    assert [list(c) for c in got] == [[3], [9, 5]]   # both recycle's own: 9 already starts one
    assert layer.candidates([6, 7, 8], 3, 1) == [[3]]   # no slot left for it
    assert not [d for d in layer.candidates([6, 7, 3], 3, 4) if getattr(d, "layer", "") == "recycle:next"]
    assert not [d for d in RecycledLayer(table).candidates([6, 7, 8], 3, 4)   # off by default
                if getattr(d, "layer", "") == "recycle:next"]
    table.record([6], [7], [-1], [[8, 9]], [[0.6, 0.3]])   # a sampled record: no LogitSpec guess
    assert not [d for d in layer.candidates([6, 7, 8], 3, 4) if getattr(d, "layer", "") == "recycle:next"]


def test_recycled_probabilities_are_calibrated_on_what_the_output_did():
    """Recorded probabilities come from another context: the layer scales them by how often its
    proposed nodes were what the output then held (every node whose parent the output followed).
    Control: where the output follows the drafts, the calibration rises instead."""
    from hdcli.drafting import RecycledLayer, RecycledTable
    table = RecycledTable(top_k=2)
    table.record([7], [8, 10], [-1, 0], [[10, 11], [12, 14]], [[0.9, 0.05], [0.9, 0.05]])
    missed, followed = RecycledLayer(table), RecycledLayer(table)
    for _ in range(10):
        assert missed.candidates([7, 8], 2, 4)[0].p[0] == pytest.approx(min(1.0, 0.9 * missed.calibration))
        missed.extend([13, 13])        # neither 10 nor 11: 0.95 predicted, nothing kept
        followed.candidates([7, 8], 2, 4)
        followed.extend([10, 12])      # 10 (0.9) then 12 (0.9): kept
    assert missed.calibration < 0.25 and followed.calibration > 1.0
    assert missed.candidates([7, 8], 2, 4)[0].p[0] < 0.25

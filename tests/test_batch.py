"""Several generations verified in one forward (hdcli/engine/decode/batch.py): each stream's logits are
torch.equal to its forward alone, and greedy streams stepped together give plain decoding's
tokens, whatever else runs beside them (other prompts, trees, streams ending or joining).

That these can fail: `test_without_row_padding_batched_rows_differ` removes the mode's Linear
row padding and shows a batched row that differs from its forward alone."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine.decode import batch
from hdcli.engine.kernels import invariant
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.tree import tree_forward
from hdcli.engine.decode import calibrate

from conftest import step_together
from test_invariant import V, branchy, build, chain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_check import Oracle  # noqa: E402

# (dtype, kernels, attention): the torch ops' attention shares one GEMM among streams of chains;
# the fused one (engine/kernels/fused.py) takes each stream on its own cache
CASES = [(torch.float32, "torch", "torch"), (torch.bfloat16, "onednn", "torch"), (torch.bfloat16, "gguf", "torch"),
         (torch.bfloat16, "gguf", "fused")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[1]}-{c[2]}")
def model(request, tmp_path_factory):
    from hdcli.engine.kernels import fused
    dtype, kern, attention = request.param
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    mp = pytest.MonkeyPatch()
    mp.setenv("HD_CACHE_DIR", str(tmp_path_factory.mktemp("hdcache")))
    with invariant.pinned(attention):
        m = build("llama", dtype, kern)
        calibrate.enable(m)
        assert batch.can_batch(m)
        yield m
    mp.undo()


def prefilled(model, prefix):
    cache = model.new_cache()
    model.forward(torch.tensor([prefix[:-1]]), cache)
    return cache


def test_forward_many_rows_equal_each_forward_alone(model):
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, V) for _ in range(n)] for n in (5, 40, 75, 33)]
    trees = [chain([]), branchy(rng, 9), chain([rng.randrange(3, V) for _ in range(7)]), branchy(rng, 20)]
    alone = [tree_forward(model, t, p[-1], prefilled(model, p)) for t, p in zip(trees, prefixes)]
    caches = [prefilled(model, p) for p in prefixes]
    together = batch.forward_many(model, [(t, p[-1], c) for t, p, c in zip(trees, prefixes, caches)])
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    assert [c.get_seq_length() for c in caches] == [len(p) - 1 + len(t.tokens) for p, t in zip(prefixes, trees)]


def test_cost_of_streams_is_measured_where_streams_batch(model):
    """costs.measure_extras runs 4 streams through one batched forward here (not a forward
    each): finite, non-negative terms."""
    from hdcli.engine.decode import costs
    branch, stream = costs.measure_extras(model, context=40, rounds=1)
    assert 0.0 <= branch < 50 and 0.0 <= stream < 50 and stream != 1.0


def test_groups_stay_within_the_calibrated_width():
    assert batch.groups([30, 30, 10, 64, 1]) == [[0, 1], [2], [3], [4]]
    assert all(sum([30, 30, 10, 64, 1][i] for i in g) <= invariant.MAX_ROWS
               for g in batch.groups([30, 30, 10, 64, 1]))


def test_streams_stepped_together_equal_plain_decoding(model):
    """Four greedy streams with branchy drafts of their own, of different lengths, one joining
    after the others started: every stream's tokens are plain decoding's."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, V) for _ in range(n)] for n in (12, 50, 30, 70)]
    lengths = [40, 25, 60, 35]
    plain = Decoder(model, eos_ids=())
    refs = [plain.generate(p, max_new_tokens=n).tokens for p, n in zip(prompts, lengths)]
    streams = []
    for i, (p, n, ref) in enumerate(zip(prompts[:3], lengths, refs)):
        oracle = Oracle(ref, len(p), k=6, corrupt=0.3, branches=3, vocab=V, seed=i)
        streams.append(Decoder(model, eos_ids=(), drafter=oracle).stream(p, max_new_tokens=n))
    steps = 0
    while any(not s.done for s in streams):
        if steps == 5:  # a fourth request arrives mid-way
            oracle = Oracle(refs[3], len(prompts[3]), k=6, corrupt=0.3, branches=3, vocab=V, seed=3)
            streams.append(Decoder(model, eos_ids=(), drafter=oracle).stream(prompts[3], max_new_tokens=lengths[3]))
        step_together(model, streams, max_nodes=invariant.MAX_ROWS // sum(not s.done for s in streams) - 1)
        steps += 1
    assert [s.result().tokens for s in streams] == refs
    assert max(max(s.stats.tree_sizes) for s in streams) > 4   # trees were sent, not plain steps


def test_without_row_padding_batched_rows_differ(tmp_path, monkeypatch):
    """fp32 with torch's kernels: a one-row Linear call is a GEMV, a wider one a GEMM. With the
    mode's row padding removed, two one-token forwards batched give a row unlike the forward alone."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    m = build("llama", torch.float32, "torch")
    calibrate.enable(m)
    for lin in m.linears():
        lin.min_rows = 1
    rng = random.Random(2)
    differ = 0
    for trial in range(6):
        prefixes = [[rng.randrange(3, V) for _ in range(20 + 7 * j)] for j in range(2)]
        alone = [tree_forward(m, chain([]), p[-1], prefilled(m, p)) for p in prefixes]
        together = batch.forward_many(m, [(chain([]), p[-1], prefilled(m, p)) for p in prefixes])
        differ += sum(not torch.equal(a, b) for a, b in zip(alone, together))
    assert differ > 0

"""Logits processors (penalties, logit_bias) and log-probabilities under speculation.

Every verified row is processed with its own path's counts (verify.processed) and its
log-probabilities are computed one row at a time (verify.logprobs_of): greedy output, logprobs
and top logprobs equal plain decoding's exactly (==, not approximately), in the M-invariant mode.
"""
from __future__ import annotations

import pytest
import torch

from hdcli import api
from hdcli.config import sampling_fields
from hdcli.engine.decode.loop import Decoder, first_difference
from hdcli.engine.decode.tree import Tree, tree_forward
from hdcli.engine.decode.verify import Sampling, logprobs_of, processed

PROMPTS = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list, then call it on [1, 2, 3].",
]
PENALISED = Sampling(frequency_penalty=0.8, presence_penalty=0.4, logit_bias=((13, 2.0), (198, -1.5)))


def test_processed_rows_equal_one_row_processing():
    """A tree's row i, processed in one call, is torch.equal to row i processed alone with the
    counts of its own path; leaving the path out (negative control) changes it."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, dtype=torch.bfloat16)
    # root -> 1 -> 2, root -> 3 -> 4; tokens 7, 7, 9, 11 below a root
    parents, tokens = [-1, 0, 1, 0, 3], [-1, 7, 7, 9, 11]
    generated = [7, 3, 3]
    s = Sampling(frequency_penalty=0.7, presence_penalty=0.3, logit_bias=((9, 5.0), (60, 1.0)))
    together = processed(logits, s, generated, parents, tokens)
    paths = {0: [], 1: [7], 2: [7, 7], 3: [9], 4: [9, 11]}
    for i, path in paths.items():
        alone = processed(logits[i:i + 1], s, generated + path)
        assert torch.equal(together[i:i + 1], alone)
    assert not torch.equal(together[2:3], processed(logits[2:3], s, generated))   # the control
    assert processed(logits, Sampling(), generated, parents, tokens) is logits   # nothing to do
    with pytest.raises(ValueError, match="frequency_penalty"):
        Sampling(frequency_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias"):
        Sampling(logit_bias=((3, 101.0),))


def forced_plain_logprobs(lm, prompt_ids, tokens, s: Sampling, top: int):
    """Plain decoding's numbers for a given output: one-token forwards, each row processed with
    the tokens generated before it, log-probabilities of the token that came."""
    dec = Decoder(lm.model, lm.eos_ids)
    cache = lm.model.new_cache()
    dec._prefill(prompt_ids[:-1], cache)
    last, out, rows = prompt_ids[-1], [], []
    with torch.inference_mode():
        for t in tokens:
            row = processed(tree_forward(lm.model, Tree(), last, cache), s, out)
            rows += logprobs_of(row, [0], [t], top)
            out.append(t)
            last = t
    return rows


@pytest.mark.bundled
def test_penalties_and_logprobs_exact_under_speculation(bundled_lm):
    lm = bundled_lm
    assert lm.invariant, "the bundled model runs in the M-invariant mode"
    changed = drafted = 0
    for prompt in PROMPTS:
        ref = api.generate(lm, prompt, max_new_tokens=24, drafter=None, **sampling_fields(PENALISED), logprobs=3)
        got = api.generate(lm, prompt, max_new_tokens=24, **sampling_fields(PENALISED), logprobs=3)
        assert got.tokens == ref.tokens, first_difference(got.tokens, ref.tokens)
        assert got.logprobs == ref.logprobs          # every float, every alternative, exactly
        assert len(got.logprobs) == len(got.tokens)
        assert all(lp <= 0 and len(best) == 3 and best[0][1] >= lp for lp, best in got.logprobs)
        # greedy on processed rows: the chosen token is the best one
        assert all(best[0][1] == lp for lp, best in got.logprobs)
        unprocessed = api.generate(lm, prompt, max_new_tokens=24, drafter=None)
        changed += unprocessed.tokens != ref.tokens
        drafted += sum(s.accepted for s in got.stats.layers.values())
    assert changed, "the processors changed no output: the test would not see them ignored"
    assert drafted > 0, "nothing drafted was accepted: speculation was not exercised"


@pytest.mark.bundled
def test_sampled_logprobs_equal_plain_rows(bundled_lm):
    """Seeded sampling under speculation: the logprobs returned for the tokens drawn are plain
    decoding's rows for that output (forced), exactly."""
    lm = bundled_lm
    s = Sampling(temperature=0.8, top_p=0.95, frequency_penalty=0.5, logit_bias=((13, 1.0),))
    prompt = PROMPTS[0]
    got = api.generate(lm, prompt, max_new_tokens=32, **sampling_fields(s), seed=7, logprobs=2)
    ids = api.encode_prompt(lm.tokenizer, prompt)
    assert got.logprobs == forced_plain_logprobs(lm, ids, got.tokens, s, 2)
    assert sum(st.accepted for st in got.stats.layers.values()) > 0

"""Structured output and predicted outputs stay exact (issue 48).

Greedy: under a grammar (json_object, a strict JSON schema, a regex, a Lark grammar), and with a
prediction that is right, partly right or wrong, speculative output equals plain decoding under
the same grammar token for token (the bundled model, fp32, its real tokenizer). A negative control
masks every row with the root's grammar state instead of its own path's: the check catches it.
Sampling through a grammar keeps the masked distribution (chi-square, as tests/test_sampling.py).
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from hdcli import api
from hdcli.drafting import ContextDB, Hierarchy
from hdcli.engine.text import constrain
from hdcli.engine import loader
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.prediction import Prediction
from hdcli.engine.decode.verify import Sampling, target_probs
from hdcli.engine.model.target import as_target

from conftest import FixedCandidates, require_bundled, tiny_llama
from test_sampling import ALPHA, chi2_pvalue

pytestmark = pytest.mark.bundled

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
GRAMMARS = {
    "json_object": ("json_object", None),
    "json_schema": ("json_schema", PERSON),
    "regex": ("regex", r"(Yes|No)\. [A-Z][a-z ,]{5,60}\."),
    "lark": ("lark", 'start: "Answer: " NUMBER " apples"\nNUMBER: /[0-9]{1,3}/'),
}
PROMPT = [1, 4093, 314, 2361, 28, 253, 1345, 30, 198]


@pytest.fixture(scope="module")
def tiny():
    """A tiny random llama over the bundled model's tokenizer (its weights are not loaded):
    forwards of a millisecond, real tokens for the grammar. Greedy answers are grammar-valid
    nonsense, which is all exactness needs."""
    require_bundled()
    tok = loader.load_tokenizer(loader.DEFAULT_MODEL)
    model = as_target(tiny_llama(vocab_size=len(tok), seed=5, hidden=32, scale=2.0))
    return types.SimpleNamespace(model=model, tokenizer=tok, eos_ids={tok.eos_token_id}, max_context=2048)


class Echo:
    """A layer drafting a reference answer from where the output is, every third token wrong:
    steps keep and reject drafts at every depth."""
    name = "echo"

    def __init__(self, prompt_len, reference):
        self.prompt_len, self.ref = prompt_len, list(reference)

    def reset(self, tokens):
        pass

    def extend(self, tokens):
        pass

    def candidates(self, history, max_len, max_candidates):
        pos = len(history) - self.prompt_len
        got = [t if (pos + i) % 3 else t + 1 for i, t in enumerate(self.ref[pos:pos + max_len])]
        return [got] if got else []


def _decode(lm, drafter=None, grammar=None, prediction=None, n=40):
    return Decoder(lm.model, lm.eos_ids, drafter).generate(PROMPT, max_new_tokens=n, grammar=grammar, prediction=prediction)


def _hierarchy(reference):
    return Hierarchy([Echo(len(PROMPT), reference), ContextDB(1, 4)], policy="fill", max_candidates=3)


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_under_a_grammar_equals_plain_decoding_under_it(tiny, name):
    g = constrain.compile(tiny, *GRAMMARS[name])
    plain = _decode(tiny, None, g)
    hd = _decode(tiny, _hierarchy(plain.tokens), g)
    assert hd.tokens == plain.tokens
    assert g.start().valid_prefix(plain.tokens) == len(plain.tokens)   # the grammar held throughout
    if name == "json_object":   # the random model closes its object at once ("{}")
        return
    assert hd.stats.steps < len(hd.tokens)   # drafts were kept
    layers = hd.stats.layers.values()
    assert hd.stats.layers["echo"].accepted > 0 and sum(x.drafted for x in layers) > sum(x.accepted for x in layers)


def test_greedy_json_schema_answer_of_the_bundled_model(bundled_lm):
    """The real model: a strict schema's answer parses with exactly its keys, drafted or not."""
    g = api.compile_grammar(bundled_lm, "json_schema", PERSON)
    prompt = "Describe a fictional person as JSON with name, age and city."
    plain = api.generate(bundled_lm, prompt, max_new_tokens=40, drafter=None, grammar=g)
    hd = api.generate(bundled_lm, prompt, max_new_tokens=40, grammar=g, cost=lambda rows: 1 + 0.05 * rows)
    assert hd.tokens == plain.tokens and plain.stop_reason == "eos"
    assert set(json.loads(plain.text)) == set(PERSON["properties"])
    grammar = hd.stats.layers["grammar"]   # the forced keys, reported as a layer
    assert grammar.accepted > 0 and hd.stats.grammar_rows > 0 and hd.stats.grammar_seconds > 0


@pytest.mark.parametrize("how", ["right", "partly", "wrong"])
@pytest.mark.parametrize("with_hierarchy", [False, True], ids=["prediction-alone", "with-hierarchy"])
def test_a_prediction_never_changes_greedy_output(tiny, how, with_hierarchy):
    plain = _decode(tiny, n=48)
    right = plain.tokens
    prediction = {"right": right, "partly": right[:20] + [7, 8, 9] + right[20:], "wrong": list(range(100, 140))}[how]
    drafter = Hierarchy([ContextDB(1, 4)]) if with_hierarchy else None
    hd = _decode(tiny, drafter, prediction=prediction, n=48)
    assert hd.tokens == plain.tokens
    usage = hd.prediction_usage
    kept = hd.stats.layers["prediction"].accepted if "prediction" in hd.stats.layers else 0
    assert usage == {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": len(prediction) - kept}
    if how != "wrong":   # most of the answer comes from the prediction, many tokens a step
        assert kept >= len(hd.tokens) // 2 and hd.stats.mean_accepted > 2


def test_a_prediction_under_a_grammar(tiny):
    g = constrain.compile(tiny, "json_schema", PERSON)
    plain = _decode(tiny, None, g)
    guess = plain.tokens[:15] + plain.tokens[18:]
    hd = _decode(tiny, Hierarchy([ContextDB(1, 4)]), g, prediction=guess)
    assert hd.tokens == plain.tokens and hd.stats.layers["prediction"].accepted > 0


def test_masking_rows_with_the_wrong_path_is_caught(tiny, monkeypatch):
    """Negative control: every row masked with the root's grammar state (not its own path's)
    breaks the equality the tests above check, or the matcher refuses the token it was given."""
    g = constrain.compile(tiny, "json_schema", PERSON)
    plain = _decode(tiny, None, g)

    def root_state_only(self, logits, children, tokens, best):
        allowed = self.allowed_now()
        x = logits.float().numpy()
        return [b if allowed[b] else int(np.where(allowed, x[i], -np.inf).argmax()) for i, b in enumerate(best)]
    monkeypatch.setattr(constrain.GrammarState, "greedy_targets", root_state_only)
    try:
        got = _decode(tiny, _hierarchy(plain.tokens), g)
    except RuntimeError as exc:   # the broken mask let through a token the path forbids
        assert "grammar state lost" in str(exc)
        return
    assert got.tokens != plain.tokens


@torch.inference_mode()
def _two_token_distribution(lm, g, prompt, s):
    probs = {}
    state = g.start()
    logits = lm.model.forward(torch.tensor([prompt]))[-1:].float()
    p1 = target_probs(logits.masked_fill(~torch.from_numpy(state.allowed_now()), float("-inf")), s)[0]
    for t1 in torch.nonzero(p1).flatten().tolist():
        if t1 in lm.eos_ids:
            probs[(t1,)] = float(p1[t1])
            continue
        state.advance([t1])
        l2 = lm.model.forward(torch.tensor([prompt + [t1]]))[-1:].float()
        p2 = target_probs(l2.masked_fill(~torch.from_numpy(state.allowed_now()), float("-inf")), s)[0]
        for t2 in torch.nonzero(p2).flatten().tolist():
            probs[(t1, t2)] = float(p1[t1] * p2[t2])
        state.matcher.rollback(1)
    return probs


@pytest.mark.parametrize("source", ["layer", "prediction"])
def test_sampling_through_a_grammar_keeps_the_masked_distribution(tiny, source):
    """The likeliest pair drafted by a layer, or as the predicted output (its own layer)."""
    lm = tiny
    g = constrain.compile(lm, "regex", "(yes|no|maybe)")
    s = Sampling(temperature=1.0)
    prompt = [1, 42, 314, 15]
    probs = _two_token_distribution(lm, g, prompt, s)
    best = max((k for k in probs if len(k) == 2), key=probs.get)
    layer = "fixed" if source == "layer" else "prediction"
    dec = Decoder(lm.model, lm.eos_ids, Hierarchy([FixedCandidates("fixed", [best])], draft_len=2) if source == "layer" else None)
    predicted = list(best) if source == "prediction" else None
    n, counts, accepted = 600, {}, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a 32-wide model: ops this small only lose to a second thread's start-up
    try:
        for seed in range(n):
            out = dec.generate(prompt, max_new_tokens=3, sampling=s, seed=seed, grammar=g, prediction=predicted)
            key = tuple(out.tokens[:1]) if out.tokens[0] in lm.eos_ids else tuple(out.tokens[:2])
            counts[key] = counts.get(key, 0) + 1
            accepted += out.stats.layers[layer].accepted if layer in out.stats.layers else 0
    finally:
        torch.set_num_threads(threads)
    assert accepted > n / 10
    assert chi2_pvalue(counts, probs, n) > ALPHA


def test_prediction_realigns_after_a_mismatch():
    p = Prediction([10, 11, 12, 13, 14, 15, 16, 17])
    out = [10, 11]
    p.extend(out, 2)
    assert p.propose(3) == [12, 13, 14] and p.run == 2
    out += [99, 13, 14]          # a token the prediction lacks, then its text again
    p.extend(out, 3)
    assert p.propose(2) == [15, 16] and p.run == 0   # re-aligned after "13 14", the match restarts
    out += [42, 43]
    p.extend(out, 2)
    assert p.propose(4) == []    # lost: nothing in the prediction ends with "42 43"


@pytest.mark.parametrize("kind, source, says", [
    ("json_schema", '{"type": "foo"}', "Invalid type"),
    ("json_schema", "[1, 2]", "a JSON schema must be a JSON object"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "[", "regex"),
    ("lark", 'start: a\na: a "x"', "admits no output"),
    ("gbnf", "root ::= (", "GBNF"),
    ("xml", "<a/>", "unknown grammar kind"),
])
def test_a_bad_grammar_is_one_clear_error(tiny, kind, source, says):
    with pytest.raises(constrain.GrammarError) as err:
        constrain.compile(tiny, kind, source)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_grammar_that_cannot_finish_ends_at_the_length(tiny):
    g = constrain.compile(tiny, "regex", "(ab ){300}")
    res = _decode(tiny, Hierarchy([ContextDB(1, 4)]), g, n=12)
    assert res.stop_reason == "length" and len(res.tokens) == 12


def test_a_prediction_longer_than_the_context_is_refused(tiny):
    with pytest.raises(api.HdError, match="the prediction is .* tokens, more than"):
        api.generate(tiny, "Hi", max_new_tokens=4, drafter=None, prediction="word " * (tiny.max_context + 10))


def test_hd_generate_bad_grammar_files_are_one_line_and_exit_2(tmp_path):
    """Checked before the model loads: each is one line naming the flag and file, exit 2."""
    from conftest import hd_main, one_line_error
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "frobnicated"}')
    empty = tmp_path / "none.lark"
    empty.write_text('start: a\na: a "x"\n')
    unknown = tmp_path / "answer.txt"
    unknown.write_text("yes|no")
    for args, says in [(["--json-schema", str(bad_schema)], f"--json-schema {bad_schema}: Invalid type"),
                       (["--grammar", str(unknown)], "say its format with --grammar-format"),
                       (["--json-object", "--grammar", str(empty)], "pass one of --json-object, --grammar"),
                       (["--json-schema", str(tmp_path / "missing.json")], "cannot read --json-schema")]:
        proc = hd_main("generate", "-p", "Hi", "-n", "4", *args)
        assert proc.returncode == 2, proc.stderr
        assert says in one_line_error(proc)

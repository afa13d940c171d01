"""A request's own hold on drafting (engine/decode/request.Speculation; hd serve's `speculative`
body field, llama-server's flat `speculative.n_max`): off, a cap on drafted tokens a step, a
choice of the run's layers. None of it changes an output token (greedy token for token, seeded
sampling the same tokens), each does what it says (the counts in usage.hd.draft_tokens and
RunStats show it, against a control without it), and a bad field is a 400 naming it."""
from __future__ import annotations

import json

import pytest

from hdcli import api
from hdcli.engine.decode.request import Speculation
from hdcli.errors import HdError

from test_serve import Running, config, http, model_dir  # noqa: F401 - model_dir: a fixture

# a prompt the context layer drafts from (its n-grams repeat), and long enough answers to draft in
LOOPING = "one two three one two three one two three one two three one two"


@pytest.fixture(scope="module")
def served(model_dir):
    r = Running(config(model_dir).replace(max_new_tokens=48, layers=["context", "recycle"]), max_batch=4)
    yield r
    r.stop()


def complete(served, **fields):
    status, body = http("POST", served.url + "/v1/completions",
                        json.dumps({"model": served.server.name, "prompt": LOOPING, "temperature": 0,
                                    "max_tokens": 48} | fields).encode())
    return status, json.loads(body)


def tokens_and_hd(served, **fields):
    status, body = complete(served, logprobs=0, **fields)
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["hd"]


def test_served_controls_change_the_drafts_never_the_answer(served):
    text, hd = tokens_and_hd(served)
    counts = hd["draft_tokens"]
    # the control: by default this prompt drafts, some steps more than 2 tokens, and some are kept
    assert counts["accepted"] > 0 and counts["verified"] > 2 * hd["steps"] / 2
    assert counts["verified"] == counts["accepted"] + counts["wasted"]
    assert hd["steps"] < 48

    off, hd_off = tokens_and_hd(served, speculative={"enabled": False})
    assert off == text
    assert hd_off["draft_tokens"] == {"verified": 0, "accepted": 0, "wasted": 0} and hd_off["layers"] == {}

    for fields in ({"speculative": {"n_max": 2}}, {"speculative.n_max": 2}):
        capped, hd_cap = tokens_and_hd(served, **fields)
        assert capped == text
        assert 0 < hd_cap["draft_tokens"]["verified"] <= 2 * hd_cap["steps"]

    none, hd_none = tokens_and_hd(served, speculative={"n_max": 0})
    assert none == text and hd_none["draft_tokens"]["verified"] == 0


def test_a_request_chooses_its_layers(served):
    known = served.server.prepared.layers
    assert "context" in known and len(known) > 1, known
    text, hd = tokens_and_hd(served)
    assert set(hd["layers"]) - {"context"}, "the control: other layers draft by default"
    only, hd_only = tokens_and_hd(served, speculative={"layers": ["context"]})
    assert only == text
    assert set(hd_only["layers"]) == {"context"}
    empty, hd_empty = tokens_and_hd(served, speculative={"layers": []})
    assert empty == text and hd_empty["draft_tokens"]["verified"] == 0


@pytest.mark.parametrize("fields, param, words", [
    ({"speculative": {"layers": ["nope"]}}, "speculative.layers", "not one of this server's drafting layers"),
    ({"speculative": {"layers": ["context", "context"]}}, "speculative.layers", "named twice"),
    ({"speculative": {"n_max": -1}}, "speculative.n_max", "greater than or equal to 0"),
    ({"speculative": {"n_max": "4"}}, "speculative.n_max", "valid integer"),
    ({"speculative": {"enabled": "no"}}, "speculative.enabled", "valid boolean"),
    ({"speculative": {"depth": 3}}, "speculative.depth", "unknown field"),
    ({"speculative.n_max": -2}, "speculative.n_max", "greater than or equal to 0"),
    ({"speculative.n_max": 3, "speculative": {"n_max": 4}}, "speculative.n_max", "given twice"),
])
def test_a_bad_speculative_field_is_a_400_naming_it(served, fields, param, words):
    status, body = complete(served, **fields)
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_llama_servers_other_keys_are_taken_and_named_as_ignored(served):
    import urllib.request
    req = urllib.request.Request(served.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": served.server.name, "prompt": LOOPING, "max_tokens": 4,
                                                  "speculative.n_min": 2, "speculative.p_min": 0.5}).encode())
    with urllib.request.urlopen(req, timeout=60) as f:
        assert f.status == 200
        assert f.headers["X-HD-Ignored-Fields"] == "speculative.n_min, speculative.p_min"


def test_the_api_takes_a_speculation_and_counts_what_it_verified(tiny_lm):
    cfg = api.DecodingConfig(max_new_tokens=40, layers=["context"], candidates=4, policy="fill")
    plain = api.generate(tiny_lm, LOOPING, config=cfg, drafter=None)
    free = api.generate(tiny_lm, LOOPING, config=cfg)
    capped = api.generate(tiny_lm, LOOPING, config=cfg, speculation=Speculation(max_draft=1))
    off = api.generate(tiny_lm, LOOPING, config=cfg, speculation=Speculation(enabled=False))
    assert free.tokens == plain.tokens == capped.tokens == off.tokens
    assert max(free.stats.tree_sizes) > 1, "the control: uncapped, some step verifies more than one draft"
    assert max(capped.stats.tree_sizes) <= 1 and sum(capped.stats.tree_sizes) > 0
    assert off.stats.draft_tokens["verified"] == 0 and off.stats.steps == len(off.tokens)
    for r in (free, capped):
        d = r.to_dict()["stats"]["draft_tokens"]
        assert d["verified"] == sum(r.stats.tree_sizes) and d["accepted"] == sum(r.stats.accept_lengths) - r.stats.steps
        assert d["wasted"] == d["verified"] - d["accepted"]
    with pytest.raises(HdError, match="not one of this run's drafting layers"):
        api.generate(tiny_lm, LOOPING, config=cfg, speculation=Speculation(layers=("stats",)))
    with pytest.raises(ValueError, match="max_draft"):
        Speculation(max_draft=-1)


def test_sampled_output_is_the_same_with_the_drafts_off(tiny_lm):
    cfg = api.DecodingConfig(max_new_tokens=32, layers=["context"], temperature=0.8, seed=11)
    on = api.generate(tiny_lm, LOOPING, config=cfg)
    off = api.generate(tiny_lm, LOOPING, config=cfg, speculation=Speculation(enabled=False))
    capped = api.generate(tiny_lm, LOOPING, config=cfg, speculation=Speculation(max_draft=1))
    assert on.tokens == off.tokens == capped.tokens


def test_the_decoder_itself_holds_a_request_to_no_drafts(tiny_lm):
    """Below the Run: a Decoder with a drafter drafts nothing for a request that says so."""
    from hdcli.engine.decode.loop import Decoder
    from hdcli.engine.decode.request import Request
    drafter = api.make_drafter(["context"], candidates=4)
    ids = tiny_lm.tokenizer(LOOPING)["input_ids"]
    dec = Decoder(tiny_lm.model, tiny_lm.eos_ids, drafter)
    on = dec.generate(Request(ids, max_new_tokens=32))
    off = dec.generate(Request(ids, max_new_tokens=32, speculation=Speculation(enabled=False)))
    none = dec.generate(Request(ids, max_new_tokens=32, speculation=Speculation(max_draft=0)))
    assert on.tokens == off.tokens == none.tokens
    assert sum(on.stats.tree_sizes) > 0, "the control: the drafter drafts for this request"
    assert sum(off.stats.tree_sizes) == sum(none.stats.tree_sizes) == 0

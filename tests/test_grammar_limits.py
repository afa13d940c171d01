"""Reliability round five (issue 61), grammars: what a hostile user's grammar, schema or sampling
field did, and what it does now.

  * A grammar beyond the grammar engine's limits ((a{1000}){1000}, a pattern of it, a grammar
    forcing "x" without end): drafting answered "" (eos) where plain decoding raised; now refused at
    compile time (CLI: before the model loads; serve: 400 naming the field), and a matcher that
    gives up while generating is a GrammarError on both paths.
  * 500 optional properties passed the door and failed at the first token; now refused at compile
    time naming the object, and a compile no longer holds the lock other clients' streams need.
  * top_logprobs under a grammar: masked alternatives were -inf (a 500; -Infinity in streams and in
    hd generate --json); now left out.
  * A 900-deep --json-schema (a RecursionError traceback), a 5,000-digit logit_bias key (a 500),
    --grammar-format peg (never said to be unknown): one line or a 400 naming the field.

Everything runs on a tiny random llama over the bundled tokenizer (a real vocabulary for
llguidance; the word-level tokenizer of conftest cannot take grammars)."""
from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hdcli import api
from hdcli.drafting import ContextDB, Hierarchy
from hdcli.engine import loader
from hdcli.engine.decode import costs
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.verify import logprobs_of
from hdcli.engine.text import constrain

from conftest import hd_main, one_line_error, require_bundled, tiny_llama
from test_serve import Running, http

pytestmark = pytest.mark.bundled

ENDLESS = "(a{1000}){1000}"   # exhausts llguidance's lexer fuel on its first token
BEYOND = [("regex", ENDLESS),
          ("json_schema", {"type": "string", "pattern": f"^{ENDLESS}$"}),
          ("lark", 'start: "x" start')]   # forces "x" for ever: over the parser's items at once
CROWDED = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
NESTED = {"type": "object", "required": ["x"], "properties": {"x": CROWDED}}
DEEP = '{"anyOf": [' * 900 + "{}" + "]}" * 900
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require_bundled()
    path = tmp_path_factory.mktemp("tiny-real-tokenizer")
    tok = loader.load_tokenizer(loader.DEFAULT_MODEL)
    tiny_llama(vocab_size=len(tok), seed=3, hidden=32, scale=2.0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lm(folder):
    return loader.load(str(folder), dtype="fp32", device="cpu", kernels="torch", invariant="off")


@pytest.fixture(scope="module")
def served(folder):
    mp = pytest.MonkeyPatch()
    mp.setattr(costs, "curve_for", lambda lm, *a, **k: costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}))
    r = Running(api.DecodingConfig(model=str(folder), dtype="fp32", kernels="torch", invariant="off",
                                   max_new_tokens=12), max_batch=4)
    yield r
    r.stop()
    mp.undo()


def strict_json(text: str):
    """JSON as JavaScript's JSON.parse takes it: no NaN, Infinity or -Infinity."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def post(served, path="/v1/chat/completions", **body):
    status, text = http("POST", served.url + path,
                        json.dumps({"model": served.server.name, "temperature": 0, "max_tokens": 8, **body}).encode())
    return status, text


# --- a grammar beyond the engine's limits: refused, and never a silently ended answer ----------

@pytest.mark.parametrize("kind, source", BEYOND, ids=[k for k, _ in BEYOND])
def test_a_grammar_beyond_the_engines_limits_is_refused_at_compile_time(lm, kind, source):
    """Before: check and compile took them; generation then failed (plain) or ended empty (drafting)."""
    for refuse in (lambda: constrain.check(kind, source), lambda: constrain.compile(lm, kind, source)):
        with pytest.raises(constrain.GrammarError, match="beyond the grammar engine's limits") as err:
            refuse()
        assert "\n" not in str(err.value)


def test_drafting_and_plain_decoding_agree_where_the_engine_gives_up(lm):
    """The grammar compiled past the refusal (as before the fix): with drafting it answered ""
    with stop_reason eos, breaking the grammar, where plain decoding raised GrammarError. The
    forced text computed on a deep copy runs the lexer both share; the matcher then gave up and its
    mask allowed only the end of sequence. Now both paths raise the same GrammarError."""
    from llguidance import LLMatcher
    llt = constrain._ll_tokenizer(lm)
    g = constrain.Grammar("regex", LLMatcher.grammar_from_regex(ENDLESS), llt, int(lm.model.config.vocab_size),
                          tuple(sorted(lm.eos_ids)))
    prompt = [1, 4093, 314, 2361, 28]
    said = []
    for drafter in (None, Hierarchy([ContextDB(1, 4)])):
        with pytest.raises(constrain.GrammarError, match="gave up") as err:
            Decoder(lm.model, lm.eos_ids, drafter).generate(prompt, max_new_tokens=6, grammar=g)
        said.append(str(err.value))
    assert all("too many expressions" in s for s in said), said


def test_hd_generate_refuses_an_endless_regex_before_the_model_loads(tmp_path):
    grammar = tmp_path / "endless.regex"
    grammar.write_text(ENDLESS)
    line = one_line_error(hd_main("generate", "--model", tmp_path / "no-such-model", "-p", "Hi", "-n", "4",
                                  "--grammar", grammar))
    assert f"--grammar {grammar}: the grammar is beyond the grammar engine's limits" in line, line


# --- big schemas: refused at compile time, compiled off the tokenizer lock ---------------------

@pytest.mark.parametrize("schema, where", [(CROWDED, "/"), (NESTED, "/properties/x")])
def test_an_object_over_the_parsers_row_limit_is_refused_naming_it(lm, schema, where):
    """Before: compiled; the first token failed ("Current row has 2007 items; max is 2000")."""
    for refuse in (lambda: constrain.check("json_schema", schema),
                   lambda: constrain.compile(lm, "json_schema", schema)):
        with pytest.raises(constrain.GrammarError, match=f"the object at {where} has 500 properties"):
            refuse()
    ok = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}}
    constrain.compile(lm, "json_schema", ok)          # under the limit: as before
    required = dict(CROWDED, required=list(CROWDED["properties"]))
    constrain.compile(lm, "json_schema", required)    # required keys come in order: no crowded row


def schema_refused(tmp_path, text: str) -> str:
    path = tmp_path / "schema.json"
    path.write_text(text)
    line = one_line_error(hd_main("generate", "--model", tmp_path / "no-such-model", "-p", "Hi", "-n", "4",
                                  "--json-schema", path))
    assert line.startswith(f"error: --json-schema {path}: "), line
    return line


def test_hd_generate_refuses_a_big_schema_before_the_model_loads(tmp_path):
    assert "the object at /properties/x has 500 properties" in schema_refused(tmp_path, json.dumps(NESTED))


def test_hd_generate_refuses_a_900_deep_schema_in_one_line(tmp_path):
    """Before: a RecursionError traceback (exit 1) where hd serve answers 400."""
    assert "the schema is nested too deeply" in schema_refused(tmp_path, DEEP)


def test_serve_refuses_big_schemas_and_endless_patterns_naming_the_field(served):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": NESTED}}},
              "response_format.json_schema.schema", "has 500 properties"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": BEYOND[1][1]}}},
              "response_format.json_schema.schema", "beyond the grammar engine's limits"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": CROWDED}}]},
              "tools[0].function.parameters", "has 500 properties")]
    for extra, param, says in cases:
        status, text = post(served, messages=ASK, **extra)
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param and err["message"].startswith(param + ":"), (extra, text)
        assert says in err["message"], err


def test_a_slow_compile_does_not_stall_another_clients_stream(served, monkeypatch):
    """Before: job_for compiled holding the tokenizer lock that prompts and streamed text take, so
    a schema compiling for 22 s stalled every other client as long. A compile made slow here
    waits for the other client's stream to finish: that stream must not need the compile's end."""
    real = constrain.compile
    entered, streamed = threading.Event(), threading.Event()
    order = []

    def slow(lm, kind, source=None):
        entered.set()
        streamed.wait(8)   # before the fix: the stream below waits on this thread's lock, then goes on
        order.append("compiled")
        return real(lm, kind, source)
    monkeypatch.setattr(constrain, "compile", slow)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, served, messages=ASK, response_format={"type": "json_object"})
        assert entered.wait(30)
        status, text = post(served, messages=[{"role": "user", "content": "Hi"}], stream=True)
        order.append("streamed")
        streamed.set()
        assert first.result()[0] == 200
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    assert order == ["streamed", "compiled"]


# --- log-probabilities under a grammar: no -inf, masked tokens left out ------------------------

def test_masked_alternatives_are_left_out_of_logprobs():
    row = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    (lp, best), = logprobs_of(row, [0], [2], 4)
    assert [t for t, _ in best] == [2, 0] and all(math.isfinite(x) for _, x in best) and math.isfinite(lp)


GRAMMARS = {"json_object": {"response_format": {"type": "json_object"}},
            "json_schema": {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "p", "schema": PERSON}}},
            "tools": {"tools": [CLOCK], "tool_choice": "required"}}


@pytest.mark.parametrize("extra", list(GRAMMARS.values()), ids=list(GRAMMARS))
def test_top_logprobs_under_a_grammar_are_json_and_leave_masked_tokens_out(served, extra):
    """Before: a 500 ("Out of range float values are not JSON compliant"); streams carried -Infinity."""
    status, text = post(served, messages=ASK, logprobs=True, top_logprobs=5, **extra)
    assert status == 200, text
    content = strict_json(text)["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) <= 5 for c in content)
    assert any(len(c["top_logprobs"]) < 5 for c in content)   # the grammar forbade the rest there
    status, text = post(served, messages=ASK, logprobs=True, top_logprobs=5, stream=True, **extra)
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    chunks = [strict_json(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    streamed = [c for ch in chunks for choice in ch["choices"] if choice.get("logprobs")
                for c in choice["logprobs"]["content"]]
    # the same alternatives (their numbers may differ in the last bits: the server runs without the
    # M-invariant mode here, where a row's floats depend on the tree verified beside it)
    assert [[a["token"] for a in c["top_logprobs"]] for c in streamed] == \
        [[a["token"] for a in c["top_logprobs"]] for c in content]


def test_hd_generate_json_logprobs_under_a_grammar_are_json(folder, tmp_path):
    """Before: --json wrote -Infinity for the alternatives the grammar forbids."""
    grammar = tmp_path / "answer.regex"
    grammar.write_text(r"(yes|no), [a-z ]{1,20}\.")
    proc = hd_main("generate", "--model", folder, "--dtype", "fp32", "--kernels", "torch", "--invariant", "off",
                   "-p", "Is it?", "-n", "6", "--grammar", grammar, "--logprobs", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lps = strict_json(proc.stdout)["logprobs"]
    assert lps and any(len(e["top"]) < 4 for e in lps)


# --- fields that were a 500 or a traceback ----------------------------------------------------

def test_a_logit_bias_key_of_5000_digits_is_a_400_naming_the_field(served):
    """Before: a 500 (int() refuses strings over 4300 digits)."""
    status, text = post(served, messages=ASK, logit_bias={"9" * 5000: 1.0})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "logit_bias" and "is not a token id" in err["message"], text
    assert len(err["message"]) < 200
    status, text = post(served, messages=ASK, logit_bias={"0" * 30 + "13": 1.0})   # leading zeros: id 13, as before
    assert status == 200, text


def test_an_unknown_grammar_format_names_the_known_ones(tmp_path):
    """Before: "--grammar x.peg: say its format with --grammar-format ..." even with one given."""
    grammar = tmp_path / "answer.peg"
    grammar.write_text('start: "yes"')
    line = one_line_error(hd_main("generate", "-p", "Hi", "--grammar", grammar, "--grammar-format", "peg"))
    assert "--grammar-format 'peg' is not a grammar format hd reads: give one of lark, gbnf, regex" in line, line

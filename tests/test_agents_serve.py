"""`hd serve` for agents (issue 48): response_format json_object / json_schema, tools with
tool_choice required / a named function / auto, tool and assistant tool_calls messages, streamed
tool-call deltas, predicted outputs, and the bad input of each (a 400 naming the field).

One server on the bundled SmolLM2 (its template has no tools: hd's tool prompt and the hermes
call format, engine/text/tools.py) serves the whole module, drafting as configured; every constrained
answer is compared with plain decoding in this process under the same grammar (drafter None),
token for token. The cost curve is a fixed one (measuring it took minutes here; exactness does not
depend on it), the model runs on torch kernels without the M-invariant mode (its calibration took
as long): requests are then verified each in a forward of its own, exact either way."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from hdcli import api
from hdcli.engine.text import constrain, tools
from hdcli.engine.decode import costs
from hdcli.engine.text.prompts import encode_messages

from conftest import require_bundled
from test_serve import Running, http

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.bundled

MAX = 40
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served():
    require_bundled()
    mp = pytest.MonkeyPatch()
    mp.setattr(costs, "curve_for", lambda lm, *a, **k: costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}))
    cfg = api.DecodingConfig(model="smollm2-135m", dtype="fp32", kernels="torch", invariant="off",
                             max_new_tokens=MAX)
    r = Running(cfg, max_batch=4)
    yield r
    r.stop()
    mp.undo()


def post(served, **body):
    status, text = http("POST", served.url + "/v1/chat/completions",
                        json.dumps({"model": served.server.name, "temperature": 0, **body}).encode())
    return status, json.loads(text)


def plain(served, messages, grammar=None, tools_=None, max_tokens=MAX, prediction=None):
    """Plain decoding in this process (drafter None) of what the server renders for these messages."""
    lm = served.server.lm
    ids = (tools.render(lm.tokenizer, messages, tools.parse_tools(tools_)) if tools_
           else encode_messages(lm.tokenizer, messages))
    return api.generate(lm, prompt_ids=ids, max_new_tokens=max_tokens, drafter=None, grammar=grammar,
                        prediction=prediction)


def conforms(value, schema) -> bool:
    """The few JSON Schema keywords these tests' schemas use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


def test_bad_agent_input_is_a_400_naming_the_field(served):
    tool_msg = [ASK[0], {"role": "tool", "tool_call_id": "call_nowhere", "content": "22 C"}]
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    bad_type = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frobnicated"}}}}}
    cases = [
        ({"tools": [bad_params]}, "tools[0].function.parameters"),
        ({"tools": [CLOCK, bad_type]}, "tools[1].function.parameters"),
        ({"tools": [CLOCK, CLOCK]}, "tools[1].function.name"),
        ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [CLOCK], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": tool_msg}, "messages.1.tool_call_id"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "frobnicated"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
         "response_format.json_schema.schema"),
        ({"tools": [CLOCK], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prediction": {"type": "content", "content": "cat " * 9000}}, "prediction"),
    ]
    for extra, param in cases:
        status, body = post(served, **{"messages": ASK, "max_tokens": 4, **extra})
        err = body["error"]
        assert status == 400 and err["param"] == param and err["message"].startswith(param + ":"), (extra, body)
    long = post(served, messages=ASK, prediction={"type": "content", "content": "cat " * 9000})[1]["error"]["message"]
    assert "9001 tokens" in long and "context" in long, long
    status, body = post(served, messages=ASK, max_tokens=2)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    # a grammar that cannot finish within max_tokens: "length", the text so far, never a 500
    for extra in [{"tools": [WEATHER], "tool_choice": "required"}, {"response_format": {"type": "json_object"}}]:
        status, body = post(served, messages=ASK, max_tokens=3, **extra)
        out = body["choices"][0]
        assert status == 200 and out["finish_reason"] == "length" and "tool_calls" not in out["message"], body
        assert isinstance(out["message"]["content"], str) and body["usage"]["completion_tokens"] == 3


def test_json_formats_served_equal_plain_decoding_under_the_grammar(served):
    lm = served.server.lm
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    for fmt, grammar, schema in [
            ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
             constrain.compile(lm, "json_schema", PERSON), PERSON),
            ({"type": "json_object"}, constrain.compile(lm, "json_object"), {"type": "object"})]:
        status, body = post(served, messages=messages, max_tokens=MAX, response_format=fmt)
        assert status == 200, body
        ref = plain(served, messages, grammar)
        choice = body["choices"][0]
        assert choice["message"]["content"] == ref.text and body["usage"]["completion_tokens"] == len(ref.tokens)
        if ref.stop_reason == "eos":
            assert choice["finish_reason"] == "stop" and conforms(json.loads(ref.text), schema), ref.text


def test_required_and_named_tool_calls_parse_validate_and_equal_plain(served):
    lm = served.server.lm
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    # parallel_tool_calls false: exactly one call (this small model, let go on, repeats its call to max_tokens)
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        status, body = post(served, messages=ASK, max_tokens=60, tools=[WEATHER, CLOCK], tool_choice=choice,
                            parallel_tool_calls=False)
        assert status == 200, body
        out = body["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
        calls = out["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        assert conforms(arguments, schemas[name])
        if choice == "required":   # exact: plain decoding under the same call grammar
            grammar = constrain.compile(lm, "lark", tools.call_grammar(tools.parse_tools([WEATHER, CLOCK]),
                                                                       "required", False, "hd"))
            ref = plain(served, ASK, grammar, [WEATHER, CLOCK], max_tokens=60)
            (want,) = tools.parse_calls(ref.text, "hd")
            assert (name, arguments) == (want["function"]["name"], json.loads(want["function"]["arguments"]))
            assert body["usage"]["completion_tokens"] == len(ref.tokens)
        else:
            assert name == "get_time"


def test_the_official_clients_two_turn_tool_flow(served):
    c = served.server.name
    client = served.client()
    messages = list(ASK)
    first = client.chat.completions.create(model=c, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"
    args = json.loads(msg.tool_calls[0].function.arguments)
    messages.append(msg)   # the client's own message object, as apps send it back
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": json.dumps(
        {"city": args["city"], "temperature": 21, "unit": args["unit"]})})
    second = client.chat.completions.create(model=c, messages=messages, tools=[WEATHER], temperature=0, max_tokens=24)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    # what the model saw: the call rendered as text and the result in a user turn (hd's tool prompt)
    ids = tools.render(served.server.lm.tokenizer, [ASK[0], msg.model_dump(exclude_none=True), messages[-1]],
                       tools.parse_tools([WEATHER]))
    assert second.usage.prompt_tokens == len(ids)


def reassemble(chunks) -> tuple[str, str | None, dict[int, dict]]:
    """A streamed chat answer's content, finish reason and tool calls ({index: id, name, arguments}),
    put together from its chunks' deltas as a client does."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += d.id or ""
            got["name"] += (d.function.name or "") if d.function else ""
            got["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, finish, calls


def test_streamed_tool_call_deltas_reassemble_to_the_calls(served):
    client = served.client()
    kw = dict(model=served.server.name, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    content, finish, calls = reassemble(client.chat.completions.create(stream=True, **kw))
    assert content == "" and finish == "tool_calls"   # the call's text is never streamed as content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_prediction_usage_is_reported_and_the_answer_unchanged(served):
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    ref = plain(served, messages, max_tokens=24)
    for prediction, right in [(ref.text, True), ("Completely different words here, nothing alike at all.", False)]:
        status, body = post(served, messages=messages, max_tokens=24,
                            prediction={"type": "content", "content": [{"type": "text", "text": prediction}]})
        assert status == 200 and body["choices"][0]["message"]["content"] == ref.text, body
        details = body["usage"]["completion_tokens_details"]
        accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        size = len(served.server.lm.tokenizer(prediction, add_special_tokens=False)["input_ids"])
        assert accepted >= 0 and (accepted + rejected == size or rejected == 0), details
        if right:
            assert accepted >= len(ref.tokens) - 2 and rejected <= 2, details
        else:
            assert accepted < size // 2, details
    # without a prediction, OpenAI's details all the same (issue 61: clients read them unchecked)
    assert post(served, messages=messages, max_tokens=2)[1]["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


def test_auto_answers_the_same_streamed_and_whole(served):
    """Under tool_choice auto the output is the model's own (not constrained): text or calls, the
    streamed answer holds back what may become a call and ends as the whole one does."""
    client = served.client()
    kw = dict(model=served.server.name, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=20)
    whole = client.chat.completions.create(**kw).choices[0]
    ref = plain(served, ASK, None, [WEATHER], max_tokens=20)
    content, calls = tools.split_calls(ref.text, "hd", tools.parse_tools([WEATHER]))
    if calls is None or ref.stop_reason != "eos":
        assert whole.message.content == ref.text and not whole.message.tool_calls
    else:
        assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == len(calls)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == (whole.message.content or "") and finish == whole.finish_reason


@pytest.fixture(scope="module")
def served_batched(tmp_path_factory):
    """A tiny random llama over the bundled tokenizer, served in the M-invariant mode: concurrent
    requests are verified in shared forwards (the bundled model's calibration takes minutes here)."""
    require_bundled()
    from hdcli.engine import loader
    from conftest import tiny_llama
    folder = tmp_path_factory.mktemp("tiny-real-tokenizer")
    tok = loader.load_tokenizer(loader.DEFAULT_MODEL)
    tiny_llama(vocab_size=len(tok), seed=7, hidden=64, scale=2.0).save_pretrained(folder)
    tok.save_pretrained(folder)
    mp = pytest.MonkeyPatch()
    mp.setattr(costs, "curve_for", lambda lm, *a, **k: costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}))
    r = Running(api.DecodingConfig(model=str(folder), dtype="fp32", kernels="torch", max_new_tokens=MAX), max_batch=4)
    assert r.server.scheduler.batched, "the test model must hold the M-invariant mode"
    yield r
    r.stop()
    mp.undo()


def test_four_concurrent_clients_in_shared_forwards_each_get_the_plain_answer(served_batched):
    """json_schema under 4 concurrent clients, their trees verified together in one forward a
    step: each answer equals plain decoding under the grammar in this process, token for token."""
    s = served_batched.server
    widest = []
    step = s.scheduler.on_step
    s.scheduler.on_step = lambda jobs, counts: (widest.append(len(jobs)), step(jobs, counts))
    asks = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(4)]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(messages):
        status, body = post(served_batched, messages=messages, response_format=fmt, max_tokens=MAX)
        assert status == 200, body
        return body
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, asks))
    g = constrain.compile(s.lm, "json_schema", PERSON)
    for messages, body in zip(asks, answers):
        want = plain(served_batched, messages, grammar=g)
        assert body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["completion_tokens"] == len(want.tokens)
    assert max(widest) > 1   # requests really shared forwards

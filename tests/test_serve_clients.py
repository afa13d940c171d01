"""`hd serve` driven by the real clients apps use (issue 61, item 8): the `openai` client and
langchain-openai, at the versions pinned in pyproject.toml's `test` extra. Chat, streams, the
two-turn tool flow with the client's own message sent back (the object and its model_dump()),
streamed tool calls, json_object, json_schema (and the SDK's parse() with a pydantic model),
tools under `required` and a named function, `prediction`, and the fields the clients and
libraries add (usage details, extra_body's top_k, reasoning_effort).

One served tiny model for the module: a random llama over a byte-level tokenizer (so it can spell
JSON and tool calls, which the word-level model of conftest cannot), on torch kernels outside the
M-invariant mode and with a fixed cost curve (nothing to calibrate or measure; requests are then
verified each in a forward of its own, exact either way). Its answers are gibberish: the tests
check structure and exactness (a served greedy answer equals plain decoding in this process of
what the server renders, under the same grammar), not content."""
from __future__ import annotations

import json
import urllib.request

import pytest

from hdcli import api
from hdcli.engine.decode import costs
from hdcli.engine.text import constrain, tools
from hdcli.engine.text.prompts import encode_messages
from hdcli.serve import protocol, structured

from conftest import CHAT_TEMPLATE
from test_agents_serve import reassemble
from test_serve import Running, http

openai = pytest.importorskip("openai")
try:
    import langchain_openai
except ImportError:   # the tests of the other clients still run
    langchain_openai = None
needs_langchain = pytest.mark.skipif(langchain_openai is None,
                                     reason="langchain-openai is not installed (pyproject.toml's test extra pins it)")

MAX = 24
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {
    "name": "note", "description": "Keep a note",
    "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"], "additionalProperties": False}}}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "zone": {"enum": ["UTC", "CET"]}},
        "required": ["ok", "zone"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: one token a byte, so any text (JSON, calls) is spelled."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + alphabet)}, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_byte_model(path):
    """A random llama (hidden 64, 2 layers) over byte_tokenizer(), with room for hd's tool prompt in bytes."""
    import contextlib
    import io
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = byte_tokenizer()
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(costs, "curve_for", lambda lm, *a, **k: costs.CostCurve({1: 1.0, 8: 1.3, 64: 4.0}))
    cfg = api.DecodingConfig(model=str(save_byte_model(tmp_path_factory.mktemp("byte-llama"))), dtype="fp32",
                             kernels="torch", invariant="off", max_new_tokens=MAX)
    r = Running(cfg, max_batch=4)
    yield r
    r.stop()
    mp.undo()


def blanks(served) -> dict[str, float]:
    """logit_bias against whitespace, for requests under a grammar: JSON's whitespace is free,
    and the random model, let choose, writes newlines to max_tokens (plain() takes it too)."""
    return {str(served.server.lm.tokenizer(c)["input_ids"][0]): -100.0 for c in " \n\t\r"}


def create(served, **kw):
    return served.client().chat.completions.create(**{"model": served.server.name, "temperature": 0,
                                                      "max_tokens": MAX, **kw})


def plain(served, messages, grammar=None, tools_=None, max_tokens=MAX, **options):
    """Plain decoding in this process (drafter None) of what the server renders for these messages."""
    lm = served.server.lm
    ids = (tools.render(lm.tokenizer, messages, tools.parse_tools(tools_)) if tools_ is not None
           else encode_messages(lm.tokenizer, messages))
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    return api.generate(lm, prompt_ids=ids, max_new_tokens=max_tokens, drafter=None, grammar=grammar, **options)


def call_grammar(served, tools_, choice, parallel):
    lm = served.server.lm
    return constrain.compile(lm, "lark", tools.call_grammar(tools.parse_tools(tools_), choice, parallel, "hd"))


def ended_on_eos(served, ref) -> bool:
    return ref.stop_reason == "eos" and ref.tokens[-1] in served.server.lm.eos_ids


# ------------------------------------------------------------------ the request fields, parsed

def test_the_sdks_message_dump_is_taken_and_what_hd_cannot_use_is_named():
    """An answer's message as the client dumps it (null refusal, annotations, audio, function_call)
    was a 400 "unknown field 'messages.1.annotations'"."""
    from openai.types.chat import ChatCompletionMessage
    msg = ChatCompletionMessage(role="assistant", content="hi there")
    dumped = msg.model_dump()
    assert {"annotations", "audio", "function_call", "refusal"} <= set(dumped)
    body = {"model": "m", "messages": [ASK[0], dumped, {"role": "user", "content": "and now?"}]}
    req = protocol.parse(protocol.ChatRequest, body)
    assert [m.text() for m in req.messages] == [ASK[0]["content"], "hi there", "and now?"]
    cited = dict(dumped, annotations=[{"type": "url_citation", "url_citation": {
        "start_index": 0, "end_index": 2, "title": "t", "url": "https://example.org"}}])
    assert protocol.parse(protocol.ChatRequest, {**body, "messages": [ASK[0], cited]}).messages[1].text() == "hi there"
    for field, value, says in [("audio", {"id": "audio_1"}, "makes no audio"),
                               ("function_call", {"name": "f", "arguments": "{}"}, "tool_calls")]:
        with pytest.raises(protocol.ApiError) as err:
            protocol.parse(protocol.ChatRequest, {**body, "messages": [ASK[0], dict(dumped, **{field: value})]})
        assert err.value.status == 400 and err.value.param == f"messages.1.{field}", err.value.message
        assert err.value.message.startswith(f"messages.1.{field}:") and says in err.value.message


def test_openai_request_fields_are_taken_or_named():
    """The SDK's request fields: taken where they change nothing, ignored (and listed) where they
    ask for what hd does not do to this model, a 400 naming them where they ask for what it cannot make."""
    base = {"model": "m", "messages": ASK}
    taken = {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
             "safety_identifier": "s", "audio": None, "modalities": ["text"], "moderation": None,
             "functions": [], "function_call": "none", "top_k": 5, "reasoning_effort": "low", "verbosity": "low"}
    req = protocol.parse(protocol.ChatRequest, {**base, **taken})
    assert req.ignored() == ["reasoning_effort", "verbosity"] and req.top_k == 5
    assert protocol.parse(protocol.ChatRequest, base).ignored() == []
    assert protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", "top_k": -1}).top_k == -1
    for field, value in [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
                         ("moderation", {"model": "omni-moderation-latest"}), ("functions", [{"name": "f"}]),
                         ("function_call", "auto"), ("top_k", -2), ("top_k", "5")]:
        with pytest.raises(protocol.ApiError) as err:
            protocol.parse(protocol.ChatRequest, {**base, field: value})
        assert err.value.status == 400 and err.value.param == field, (field, err.value.message)
        assert err.value.message.startswith(field), err.value.message
    with pytest.raises(protocol.ApiError) as err:   # still strict: a field no client sends is refused
        protocol.parse(protocol.ChatRequest, {**base, "reasoning": {"effort": "low"}})
    assert err.value.param == "reasoning"


def test_a_named_tool_choice_is_one_call_unless_parallel_is_asked(served):
    """langchain-openai's bind_tools(tool_choice=NAME) sends no parallel_tool_calls: the call
    grammar then allowed several calls, and a small model's repeated call ran the tool twice."""
    lm = served.server.lm

    def spec(**kw):
        return structured.tool_spec(protocol.parse(protocol.ChatRequest, {"model": "m", "messages": ASK,
                                                                          "tools": [CLOCK, NOTE], **kw}), lm)
    assert spec(tool_choice=NAMED).parallel is False
    assert spec(tool_choice=NAMED, parallel_tool_calls=True).parallel is True
    assert spec(tool_choice="required").parallel is True and spec().parallel is True   # OpenAI's default
    assert spec(tool_choice="required", parallel_tool_calls=False).parallel is False


# ------------------------------------------------------------------ the openai client

def test_chat_whole_and_streamed_equal_plain_decoding_with_openais_usage(served):
    ref = plain(served, ASK)
    r = create(served, messages=ASK, logprobs=True)
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.tokens)
    # the details objects OpenAI always sends: read without a check (this raised on a null)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.usage.prompt_tokens_details.audio_tokens == 0
    # completion_tokens counts the end token where the answer ended on one; logprobs have none for it
    entries = len(r.choices[0].logprobs.content)
    assert r.usage.completion_tokens == entries + ended_on_eos(served, ref)
    pieces, usage = [], None
    for chunk in create(served, messages=ASK, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(pieces) == ref.text and usage.completion_tokens == len(ref.tokens)
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_extra_body_top_k_is_taken_and_reasoning_effort_is_named_in_a_header(served):
    """extra_body's top_k and reasoning_effort were 400s: top_k is implemented (sampling from the
    top 1 is greedy decoding, exactly), reasoning_effort taken and named."""
    greedy = plain(served, ASK).text
    sampled = [create(served, messages=ASK, temperature=1.0, seed=seed, **extra).choices[0].message.content
               for seed in (1, 2, 3) for extra in ({"extra_body": {"top_k": 1}}, {})]
    assert sampled[0::2] == [greedy] * 3 and sampled[1::2] != [greedy] * 3   # not ignored
    raw = served.client().chat.completions.with_raw_response.create(
        model=served.server.name, messages=ASK, temperature=0, max_tokens=MAX, reasoning_effort="low")
    assert raw.headers["x-hd-ignored-fields"] == "reasoning_effort"
    assert raw.parse().choices[0].message.content == plain(served, ASK).text
    plain_headers = served.client().chat.completions.with_raw_response.create(
        model=served.server.name, messages=ASK, temperature=0, max_tokens=2).headers
    assert "x-hd-ignored-fields" not in plain_headers
    body = json.dumps({"model": served.server.name, "messages": ASK, "max_tokens": 2, "stream": True,
                       "reasoning_effort": "high", "verbosity": "low"}).encode()
    request = urllib.request.Request(served.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as f:
        assert f.headers["X-HD-Ignored-Fields"] == "reasoning_effort, verbosity"
        assert f.read().decode().endswith("data: [DONE]\n\n")


def test_the_two_turn_tool_flow_with_the_sdks_own_message_sent_back(served):
    """messages.append(resp.choices[0].message), and its model_dump() (null annotations, audio,
    function_call, refusal: a 400 before), render the same prompt and get the same answer."""
    first = create(served, messages=ASK, tools=[CLOCK], tool_choice=NAMED, max_tokens=120, logit_bias=blanks(served))
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = msg.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    ref = plain(served, ASK, call_grammar(served, [CLOCK], "get_time", False), [CLOCK], max_tokens=120,
                logit_bias=blanks(served))
    assert tools.parse_calls(ref.text, "hd")[0]["function"]["arguments"] == call.function.arguments
    assert first.usage.completion_tokens == len(ref.tokens)
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "12:00"})}
    answers = []
    for echoed in (msg, msg.model_dump()):
        second = create(served, messages=[*ASK, echoed, result], tools=[CLOCK])
        answers.append((second.choices[0].message.content, second.choices[0].finish_reason, second.usage.prompt_tokens))
    assert answers[0] == answers[1]
    ids = tools.render(served.server.lm.tokenizer, [*ASK, msg.model_dump(exclude_none=True), result],
                       tools.parse_tools([CLOCK]))
    assert answers[0][2] == len(ids)


def test_required_and_named_calls_whole_and_streamed_equal_plain(served):
    for choice, parallel in [("required", None), (NAMED, None), ("required", False)]:
        kw = dict(messages=ASK, tools=[CLOCK, NOTE], tool_choice=choice, max_tokens=120, logit_bias=blanks(served))
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        whole = create(served, **kw).choices[0]
        name = "required" if choice == "required" else "get_time"
        ref = plain(served, ASK, call_grammar(served, [CLOCK, NOTE], name, parallel is not False and name == "required"),
                    [CLOCK, NOTE], max_tokens=120, logit_bias=blanks(served))
        assert ended_on_eos(served, ref), ref.text   # whole calls (the grammars end them, whitespace aside)
        want = tools.parse_calls(ref.text, "hd")
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == \
            [(w["function"]["name"], w["function"]["arguments"]) for w in want]
        if choice == NAMED:
            assert len(want) == 1 and want[0]["function"]["name"] == "get_time"
        content, finish, calls = reassemble(create(served, stream=True, **kw))
        assert content == "" and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_json_object_and_json_schema_equal_plain_decoding_under_the_grammar(served):
    lm = served.server.lm
    for fmt, grammar, schema in [
            ({"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}},
             constrain.compile(lm, "json_schema", FLAG), FLAG),
            ({"type": "json_object"}, constrain.compile(lm, "json_object"), None)]:
        r = create(served, messages=ASK, response_format=fmt, max_tokens=48, logit_bias=blanks(served))
        ref = plain(served, ASK, grammar, max_tokens=48, logit_bias=blanks(served))
        assert ended_on_eos(served, ref), ref.text   # the case worth checking: a whole JSON answer
        assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.tokens), fmt
        value = json.loads(ref.text)
        assert isinstance(value, dict) and (schema is None or set(value) == set(schema["required"]))
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           create(served, messages=ASK, response_format=fmt, max_tokens=48, stream=True,
                                  logit_bias=blanks(served)) if c.choices)
        assert streamed == ref.text


def test_the_sdks_parse_with_a_pydantic_model(served):
    """client.chat.completions.parse(response_format=Model): the SDK's strict schema, its answer parsed."""
    from typing import Literal
    from pydantic import BaseModel

    class Flag(BaseModel):
        ok: bool
        zone: Literal["UTC", "CET"]
    r = served.client().chat.completions.parse(model=served.server.name, messages=ASK, response_format=Flag,
                                               temperature=0, max_tokens=48, logit_bias=blanks(served))
    msg = r.choices[0].message
    sent = Flag.model_json_schema() | {"additionalProperties": False}   # as the SDK makes it strict
    ref = plain(served, ASK, constrain.compile(served.server.lm, "json_schema", sent),
                max_tokens=48, logit_bias=blanks(served))
    assert msg.content == ref.text and msg.parsed == Flag.model_validate_json(ref.text) and msg.refusal is None


def test_a_prediction_leaves_the_answer_and_counts_in_openais_details(served):
    ref = plain(served, ASK)
    accepted = []
    # the answer's text (its bytes, cut where they are no UTF-8, come back as U+FFFD), then another
    for prediction in (ref.text, "nothing like the answer at all"):
        r = create(served, messages=ASK, prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == ref.text
        d = r.usage.completion_tokens_details
        size = len(served.server.lm.tokenizer(prediction)["input_ids"])
        assert d.reasoning_tokens == 0 and d.accepted_prediction_tokens + d.rejected_prediction_tokens == size, d
        accepted.append(d.accepted_prediction_tokens)
    assert accepted[0] > accepted[1]


def test_bad_sdk_fields_are_400s_naming_them(served):
    for body, param in [({"modalities": ["text", "audio"]}, "modalities"),
                        ({"messages": [ASK[0], {"role": "assistant", "content": None,
                                                "function_call": {"name": "f", "arguments": "{}"}}]},
                         "messages.1.function_call")]:
        status, text = http("POST", served.url + "/v1/chat/completions", json.dumps(
            {"model": served.server.name, "messages": ASK, "max_tokens": 2, **body}).encode())
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param and err["message"].startswith(param + ":"), err


# ------------------------------------------------------------------ langchain-openai

def chat_model(served, **kw):
    return langchain_openai.ChatOpenAI(model=served.server.name, base_url=served.url + "/v1", api_key="none",
                                       temperature=0, max_retries=0, timeout=60, **{"max_tokens": MAX, **kw})


@needs_langchain
def test_langchain_invoke_and_stream_equal_plain_decoding(served):
    from langchain_core.messages import HumanMessage
    ref = plain(served, ASK)
    llm = chat_model(served)
    answer = llm.invoke([HumanMessage(ASK[0]["content"])])
    assert answer.content == ref.text
    assert answer.usage_metadata["output_tokens"] == len(ref.tokens)
    assert "".join(chunk.content for chunk in llm.stream(ASK[0]["content"])) == ref.text


@needs_langchain
def test_langchain_bind_tools_with_a_named_choice_makes_one_call_and_takes_its_result(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    llm = chat_model(served, max_tokens=120, logit_bias=blanks(served)).bind_tools([CLOCK], tool_choice="get_time")
    question = HumanMessage(ASK[0]["content"])
    first = llm.invoke([question])
    ref = plain(served, ASK, call_grammar(served, [CLOCK], "get_time", False), [CLOCK], max_tokens=120,
                logit_bias=blanks(served))
    (want,) = tools.parse_calls(ref.text, "hd")
    assert [(c["name"], c["args"]) for c in first.tool_calls] == \
        [("get_time", json.loads(want["function"]["arguments"]))]   # one call: the tool runs once
    result = ToolMessage(json.dumps({"time": "12:00"}), tool_call_id=first.tool_calls[0]["id"])
    second = chat_model(served).bind_tools([CLOCK]).invoke([question, first, result])
    sent = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": first.tool_calls[0]["id"], "type": "function", "function": want["function"]}]},
        {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": result.content}]
    assert second.usage_metadata["input_tokens"] == len(tools.render(
        served.server.lm.tokenizer, sent, tools.parse_tools([CLOCK])))


@needs_langchain
def test_langchain_structured_output_follows_the_schema(served):
    schema = {"title": "flag", "description": "a flag", **FLAG}
    out = chat_model(served, max_tokens=48, logit_bias=blanks(served)).with_structured_output(
        schema, method="json_schema", include_raw=True)
    got = out.invoke(ASK[0]["content"])
    ref = plain(served, ASK, constrain.compile(served.server.lm, "json_schema", FLAG), max_tokens=48,
                logit_bias=blanks(served))
    assert got["raw"].content == ref.text and ended_on_eos(served, ref), ref.text
    assert got["parsed"] == json.loads(ref.text) and got["parsing_error"] is None

"""engine/text/tools.py: tools checked, families found from chat templates, conversations with tool
calls rendered, call grammars, and calls parsed back in the three families' formats.

The templates below are small ones written here that use `tools`, tool_calls and tool messages
the way the families' own templates do (Qwen/Hermes, Llama 3.1 JSON, Mistral v3)."""
from __future__ import annotations

import json

import pytest

from hdcli.engine.text import tools

HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{%- for m in messages %}{%- if m.role == 'user' and tools and loop.last %}<|start_header_id|>user<|end_header_id|>

Respond with {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- set c = m.tool_calls[0].function %}{"name": "{{ c.name }}", "parameters": {{ c.arguments | tojson }}}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{%- endif %}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{%- for m in messages %}{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{% if c.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{% endfor %}]</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{% endif %}{% endfor %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc123", "type": "function",
                                                         "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "22 C and sunny"},
]


@pytest.fixture(scope="module")
def smol():
    from conftest import require_bundled
    require_bundled()
    from hdcli.engine import loader
    return loader.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def smol_lm(smol):
    """What the grammar engine needs of a loaded model (its tokenizer, EOS ids, logits' width),
    without loading the weights."""
    from types import SimpleNamespace
    return SimpleNamespace(tokenizer=smol, eos_ids={smol.convert_tokens_to_ids("<|im_end|>")},
                           model=SimpleNamespace(config=SimpleNamespace(vocab_size=len(smol))))


def with_template(template: str):
    from hdcli.engine import loader
    tok = loader.load_tokenizer("smollm2-135m")
    tok.chat_template = template
    return tok


def test_families_are_found_from_the_chat_template(smol):
    assert tools.family(smol) == "hd"   # the bundled SmolLM2: its template never reads `tools`
    assert tools.family(with_template(HERMES)) == "hermes"
    assert tools.family(with_template(LLAMA3)) == "llama3"
    assert tools.family(with_template(MISTRAL)) == "mistral"
    assert tools.family(with_template("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}")) == "hd"


def test_bad_tools_are_refused_naming_the_field(smol_lm):
    cases = [
        ([WEATHER, {"type": "function"}], "tools[1]"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tools[0].function.parameters"),
        ([TIME, {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "frobnicated"}}}}}], "tools[1].function.parameters"),
    ]
    for bad, where in cases:
        with pytest.raises(tools.ToolError) as err:
            tools.parse_tools(bad, smol_lm)
        assert err.value.field == where and str(err.value).startswith(where + ": "), str(err.value)
    got = tools.parse_tools([WEATHER, TIME], smol_lm)
    assert [t.name for t in got] == ["get_weather", "get_time"] and got[0].parameters["required"] == ["city"]


def test_bfcl_types_map_to_json_schema():
    fn = {"name": "math.area", "description": "Area", "parameters": {"type": "dict", "properties": {
        "base": {"type": "float"}, "sides": {"type": "tuple", "items": {"type": "integer"}},
        "shape": {"type": "dict", "properties": {"x": {"type": "any"}}}}, "required": ["base"]}}
    got = tools.openai_tool_from_bfcl(fn)["function"]
    assert got["name"] == "math.area" and got["parameters"]["type"] == "object"
    props = got["parameters"]["properties"]
    assert props["base"] == {"type": "number"} and props["sides"] == {"type": "array", "items": {"type": "integer"}}
    assert props["shape"] == {"type": "object", "properties": {"x": {}}}
    assert tools.parse_tools([tools.openai_tool_from_bfcl(fn)])[0].name == "math.area"


def test_a_template_without_tools_gets_hds_system_message_and_text_calls(smol):
    ts = tools.parse_tools([WEATHER])
    text = smol.decode(tools.render(smol, CONVERSATION, ts))
    assert tools.system_message(ts) in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C and sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_templates_get_tools_calls_as_objects_and_results():
    ts = tools.parse_tools([WEATHER])
    hermes = with_template(HERMES)
    text = hermes.decode(tools.render(hermes, CONVERSATION, ts))
    assert json.dumps(WEATHER) in text   # the template's own rendering of `tools`
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text   # an object, not JSON text
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in text
    llama = with_template(LLAMA3)
    text = llama.decode(tools.render(llama, CONVERSATION, ts))
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text and "22 C and sunny" in text
    mistral = with_template(MISTRAL)   # its template takes 9-character ids only: mapped, consistently
    text = mistral.decode(tools.render(mistral, CONVERSATION, ts))
    call_id = text.split('"id": "')[1][:9]
    assert call_id.isalnum() and f'"call_id": "{call_id}"' in text and "[AVAILABLE_TOOLS]" in text


def test_calls_parse_in_each_familys_format():
    ts = tools.parse_tools([WEATHER, TIME])
    hermes = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = tools.split_calls(hermes, "hermes", ts)
    assert content == "Let me look.\n" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert json.loads(tools.parse_calls(llama, "llama3", ts)[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len(tools.parse_calls('<|python_tag|>{"name": "get_time", "parameters": {}}; ' + llama, "llama3", ts)) == 2
    mistral = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
               '{"name": "get_time", "arguments": {}}]')
    assert [c["function"]["name"] for c in tools.parse_calls(mistral, "mistral", ts)] == ["get_weather", "get_time"]
    assert tools.parse_calls(mistral[len("[TOOL_CALLS]"):], "mistral", ts) is not None   # control token decoded away
    # not calls: then the answer is text
    for text, fam in [("It is sunny.", "hermes"), ('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                                   '"Paris"}\n</tool_call>', "hd"),
                      ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "hd"),
                      ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and more', "hd"),
                      ('{"name": "get_time", "parameters": {}} trailing', "llama3"), ('{"city": "x"}', "llama3"),
                      ("[1, 2]", "mistral"), ("Sure.", "mistral"),
                      ('<tool_call>\n{"name": "get_time", "arguments": ' + "[" * 100000 + "\n</tool_call>", "hd")]:
        assert tools.split_calls(text, fam, ts) == (text, None), (text, fam)


def test_text_is_held_only_while_it_may_become_a_call():
    assert tools.held("Hello <tool", "hd") == len("Hello ")
    assert tools.held("Hello <b>", "hd") == len("Hello <b>")
    assert tools.held("Hi\n<tool_call>\n{", "hermes") == len("Hi\n")
    assert tools.held("  <tool_c", "hermes") == 0 and tools.held("\n", "hd") == 0
    assert tools.held(' {"name', "llama3") == 0 and tools.held("The answer", "llama3") == len("The answer")
    assert tools.held("[{", "mistral") == 0 and tools.held("No.", "mistral") == 3


def test_call_grammars_admit_only_calls_of_the_chosen_tools(smol_lm):
    from hdcli.engine.text import constrain
    ts = tools.parse_tools([WEATHER, TIME])
    tok = smol_lm.tokenizer
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

    def admits(grammar_text, text):
        state = constrain.compile(smol_lm, "lark", grammar_text).start()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return state.valid_prefix(ids) == len(ids) and (state.advance(ids) or True) and \
            bool(state.allowed_now()[sorted(smol_lm.eos_ids)].any())
    assert admits(tools.call_grammar(ts, "required", True, "hd"), good + second)
    assert not admits(tools.call_grammar(ts, "required", False, "hd"), good + second)   # exactly one
    assert admits(tools.call_grammar(ts, "required", False, "hd"), good)
    assert not admits(tools.call_grammar(ts, "get_time", True, "hd"), good)              # the named one only
    assert not admits(tools.call_grammar(ts, "required", True, "hd"),
                      '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert admits(tools.call_grammar(ts, "get_weather", False, "llama3"),
                  '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    with pytest.raises(tools.ToolError):
        tools.call_grammar(ts, "nope", True, "hd")

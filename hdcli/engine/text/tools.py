"""Tool calls: OpenAI `tools` checked, rendered into the prompt, constrained and parsed back.

Public API (hd serve and hdcli/bench use it alike):

  Tool(name, description, parameters, strict)   one function; .openai() its OpenAI tool dict
  ToolError(HdError)                            .field: the request field at fault ("tools[1].function.parameters"),
                                                the message starts with it
  parse_tools(tools, lm=None) -> list[Tool]     OpenAI `tools` checked (with lm: every `parameters` schema
                                                compiled by engine/text/constrain.py, so one the grammar engine
                                                refuses is a ToolError naming it)
  openai_tool_from_bfcl(fn) -> dict             a BFCL function document as an OpenAI tool ("dict" -> "object",
                                                "float" -> "number", "tuple" -> "array", "any" -> no type)
  family(tokenizer) -> str                      how the model calls tools: FAMILIES
  render(tokenizer, messages, tools, family=None, max_tokens=None, lock=None) -> list[int]
                                                the conversation (OpenAI messages: assistant tool_calls, tool
                                                results) with the tools, as prompt ids ready for the answer
  call_grammar(tools, choice, parallel, family, tokenizer=None) -> str
                                                llguidance Lark text admitting exactly the calls allowed:
                                                choice "required" (any tool) or a tool's name; parallel False:
                                                exactly one call. Each call's arguments follow its schema.
  parse_calls(text, family, tools=None) -> list[dict] | None
                                                the calls in an answer, OpenAI's shape ({"id": "call_<hex>",
                                                "type": "function", "function": {"name", "arguments": JSON
                                                text}}), or None where the text is not well-formed calls
  split_calls(text, family, tools=None) -> (content, calls)
                                                the same with the text before the calls (hermes, hd)
  held(text, family) -> int                     how many characters of a growing answer may be streamed as
                                                text: what follows may still become a call
  system_message(tools) -> str                  the "hd" family's system message

Families (FAMILIES), found from the chat template's text:
  hermes   Qwen 2.5/3, Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one per call
  llama3   Llama 3.1-3.3 JSON tool calling: {"name": ..., "parameters": {...}} (calls joined by "; ")
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] ([TOOL_CALLS] a control token)
  hd       a template that does not use `tools` (the bundled SmolLM2) or whose call format hd does
           not know: hd writes the tools in a system message (system_message: the tools as JSON,
           one a line, and the hermes call format), renders an assistant turn's tool_calls as
           <tool_call> blocks after its text, and the results of tool messages as
           <tool_response>\\n...\\n</tool_response> blocks in a user turn (consecutive results in one turn).

The other families get `tools=` and the messages as their own template expects them: assistant
tool_calls with arguments as objects, tool messages with tool_call_id and the function's name
(Mistral's template takes 9-character alphanumeric ids only: ids are mapped to such, consistently).
Control tokens' strings in messages and tools stay text (engine/text/prompts.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from ...errors import HdError
from . import constrain
from .prompts import encode_messages

FAMILIES = ("hermes", "llama3", "mistral", "hd")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")   # OpenAI's [A-Za-z0-9_-], and "." as BFCL's names have
BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
OPENERS = {"hermes": "<tool_call>", "hd": "<tool_call>", "llama3": "{", "mistral": "["}


class ToolError(HdError):
    """A tool, tool_choice or tool message that cannot be used; .field names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def openai(self) -> dict:
        fn = {"name": self.name} | ({"description": self.description} if self.description else {})
        return {"type": "function", "function": fn | {"parameters": self.parameters}}


# ------------------------------------------------------------------ tools in

def parse_tools(tools, lm=None) -> list[Tool]:
    """OpenAI `tools` ([{"type": "function", "function": {name, description, parameters, strict}}])
    as Tools, or ToolError naming the first bad one's field. lm: also compile each `parameters`
    schema for that model's tokenizer (engine/text/constrain.py), so a schema the grammar engine refuses
    is refused here, not while decoding."""
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of tools")
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise ToolError(where, 'a tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        fn = item["function"]
        unknown = (sorted(set(item) - {"type", "function"})
                   or [f"function.{k}" for k in sorted(set(fn) - FUNCTION_FIELDS)])
        if unknown:
            raise ToolError(f"{where}.{unknown[0]}", "unknown field: a tool has type and function, a function "
                            "name, description, parameters and strict")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name", "a name of 1 to 64 letters, digits, '_', '-' or '.'")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"'{name}' is also the name of tools[{seen[name]}]: "
                            "give each tool a name of its own")
        seen[name] = i
        description = fn.get("description") or ""   # null: none, as clients may send it
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        strict = fn.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise ToolError(f"{where}.function.strict", "must be true or false")
        parameters = fn.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters   # no arguments
        _check_parameters(parameters, f"{where}.function.parameters", lm)
        out.append(Tool(name, description, parameters, bool(strict)))
    return out


def _check_parameters(schema, where: str, lm) -> None:
    if not isinstance(schema, dict):
        raise ToolError(where, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ToolError(where, f"must be a schema of type \"object\" (the call's arguments), not {schema['type']!r}")
    if lm is not None:
        try:
            constrain.compile(lm, "json_schema", schema)
        except constrain.GrammarError as exc:
            raise ToolError(where, str(exc)) from None


def openai_tool_from_bfcl(fn: dict) -> dict:
    """A BFCL function document ({"name", "description", "parameters": {"type": "dict", ...}}) as
    an OpenAI tool, its BFCL types mapped to JSON Schema's (BFCL_TYPES), at every depth."""
    out = {"name": fn["name"], "parameters": _json_schema_types(fn.get("parameters") or {"type": "dict"})}
    if fn.get("description"):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _json_schema_types(node):
    if isinstance(node, list):
        return [_json_schema_types(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            mapped = BFCL_TYPES.get(value, value)
            if mapped is not None:
                out[key] = mapped
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _json_schema_types(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems"):
            out[key] = _json_schema_types(value)
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------ the prompt

def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def family(tokenizer) -> str:
    """How the model calls tools (FAMILIES), from its chat template's text: "hd" for a template
    that never reads `tools` or writes a format hd does not parse."""
    text = _template_text(tokenizer)
    if not re.search(r"\btools\b", text):
        return "hd"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|start_header_id|>" in text):
        return "llama3"
    return "hd"


detect_family = family   # for functions whose `family` argument hides it


def system_message(tools: list[Tool]) -> str:
    """The "hd" family's tool prompt: the tools as JSON, one a line, and how to call them."""
    lines = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user's request. The functions, one a line "
            f"as JSON:\n<tools>\n{lines}\n</tools>\n\nTo call a function, answer with a JSON object holding its "
            "name and arguments within <tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


def _call_text(call: dict) -> str:
    fn = call.get("function", {})
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))},
                                        ensure_ascii=False) + "\n</tool_call>"


def _arguments(arguments):
    """A call's arguments as an object where its JSON text is one (templates write them with tojson)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _hd_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """The conversation for a template without tools: the tools in the system message, calls and
    results as text (module docstring)."""
    out: list[dict] = []
    if tools:
        first = messages[0] if messages and messages[0].get("role") == "system" else None
        intro = (first.get("content") or "") + "\n\n" if first else ""
        out.append({"role": "system", "content": intro + system_message(tools)})
        messages = messages[1:] if first else messages
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def _template_messages(messages: list[dict], fam: str) -> list[dict]:
    """The conversation as tool-using templates expect it: arguments as objects, a tool message
    with its function's name; Mistral's 9-character ids."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                names[c.get("id", "")] = fn.get("name", "")
                calls.append({"id": _template_id(c.get("id", ""), fam), "type": "function",
                              "function": {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}})
            m["tool_calls"] = calls
        elif m.get("role") == "tool":
            m.setdefault("name", names.get(m.get("tool_call_id", ""), ""))
            m["tool_call_id"] = _template_id(m.get("tool_call_id", ""), fam)
        out.append(m)
    return out


def _template_id(call_id: str, fam: str) -> str:
    if fam != "mistral" or (len(call_id) == 9 and call_id.isalnum()):
        return call_id
    return hashlib.sha1(call_id.encode()).hexdigest()[:9]


def render(tokenizer, messages: list[dict], tools: list[Tool] | None, family: str | None = None,
           max_tokens: int | None = None, lock=None) -> list[int]:
    """Prompt ids of a conversation (OpenAI messages: system/user/assistant with optional
    tool_calls, tool with tool_call_id) offering these tools, ready for the assistant's answer.
    family: detect_family(tokenizer) unless given. Errors: engine/text/prompts.py's (TemplateError, PromptTooLong)."""
    fam = family or detect_family(tokenizer)
    tools = tools or []
    if fam == "hd":
        return encode_messages(tokenizer, _hd_messages(messages, tools), max_tokens=max_tokens, lock=lock)
    return encode_messages(tokenizer, _template_messages(messages, fam), max_tokens=max_tokens, lock=lock,
                           tools=[t.openai() for t in tools] or None)


# ------------------------------------------------------------------ the answer

def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_grammar(tools: list[Tool], choice: str, parallel: bool, family: str, tokenizer=None) -> str:
    """Lark text (llguidance's dialect) admitting only calls in family's format: of any tool
    (choice "required") or of the tool named choice; one call, or several where parallel. Each
    call's arguments follow its tool's `parameters` schema (inline %json). tokenizer: Mistral's,
    for the id of its [TOOL_CALLS] control token."""
    chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
    if not chosen:
        raise ToolError("tool_choice", f"no tool is named {choice!r}")
    key = "parameters" if family == "llama3" else "arguments"
    rules = []
    for i, t in enumerate(chosen):
        head = _lark_string('{"name": ' + json.dumps(t.name) + f', "{key}": ')
        rules.append(f"args{i}: %json {json.dumps(t.parameters, ensure_ascii=False)}\n"
                     f"call{i}: {head} args{i} \"}}\"")
    one = "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))
    if family in ("hermes", "hd"):
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f"start: {block}" + (f' ("\\n" {block})*' if parallel else "")
    elif family == "llama3":
        start = 'start: call' + (' ("; " call)*' if parallel else "")
    elif family == "mistral":
        start = f'start: {_mistral_marker(tokenizer)} "[" call' + (' (", " call)*' if parallel else "") + ' "]"'
    else:
        raise ValueError(f"unknown tool family {family!r}")
    return "\n".join([start, one] + rules) + "\n"


def _mistral_marker(tokenizer) -> str:
    tid = None
    if tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
        if tid == getattr(tokenizer, "unk_token_id", None):
            tid = None
    return f"<[{tid}]>" if isinstance(tid, int) else '"[TOOL_CALLS]"'


def held(text: str, family: str) -> int:
    """How many leading characters of a growing answer are text for sure: the rest may still
    become a tool call (hermes, hd: from a "<tool_call>" or what may begin one; llama3, mistral:
    an answer that starts with "{" or "[" is held whole). Leading whitespace is held too."""
    opener = OPENERS[family]
    if family in ("llama3", "mistral"):
        body = text.lstrip()
        return 0 if not body or body.startswith(opener) else len(text)
    at = text.find(opener)
    cut = at if at >= 0 else len(text)
    if at < 0:
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:n]):
                cut = len(text) - n
                break
    return cut if text[:cut].strip() else 0


def _call(name, arguments) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _one_call(obj, key: str, names) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments") if key != "arguments" else None)
    if isinstance(args, str):   # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or set(obj) - {"name", key, "arguments", "id"}:
        return None
    if names is not None and obj["name"] not in names:
        return None
    return _call(obj["name"], args)


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values text holds one after another, separated by whitespace and `separator`
    (may be empty), or None where anything else is there."""
    dec, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values or None
        if values and separator:
            if not text.startswith(separator, i):
                return None
            i += len(separator)
            while i < len(text) and text[i].isspace():
                i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):   # nested past the parser's recursion: not a call either
            return None
        values.append(value)


BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def split_calls(text: str, family: str, tools: list[Tool] | None = None) -> tuple[str | None, list[dict] | None]:
    """(content, calls) of an answer: calls None where the text is not well-formed calls (every
    call a JSON object with a known name and object arguments; nothing but whitespace between
    and after them), content the text before the calls (hermes, hd; None where only whitespace),
    else the whole text."""
    names = {t.name for t in tools} if tools is not None else None
    if family in ("hermes", "hd"):
        at = text.find("<tool_call>")
        if at < 0:
            return text, None
        rest, calls, end = text[at:], [], 0
        for m in BLOCK.finditer(rest):
            if rest[end:m.start()].strip():
                return text, None
            values = _json_values(m.group(1), "")
            call = _one_call(values[0], "arguments", names) if values and len(values) == 1 else None
            if call is None:
                return text, None
            calls.append(call)
            end = m.end()
        if not calls or rest[end:].strip():
            return text, None
        return (text[:at] if text[:at].strip() else None), calls
    if family == "llama3":
        body = text.strip()
        body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
        values = _json_values(body, ";")
        key = "parameters"
    elif family == "mistral":
        body = text.strip()
        body = body[len("[TOOL_CALLS]"):] if body.startswith("[TOOL_CALLS]") else body
        values = _json_values(body, "")
        values = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
        key = "arguments"
    else:
        raise ValueError(f"unknown tool family {family!r}")
    calls = [_one_call(v, key, names) for v in values or []]
    if not calls or any(c is None for c in calls):
        return text, None
    return None, calls


def parse_calls(text: str, family: str, tools: list[Tool] | None = None) -> list[dict] | None:
    """The tool calls an answer is (split_calls), or None where it is not well-formed calls."""
    return split_calls(text, family, tools)[1]


__all__ = ["Tool", "ToolError", "FAMILIES", "parse_tools", "openai_tool_from_bfcl", "family", "render",
           "call_grammar", "parse_calls", "split_calls", "held", "system_message"]

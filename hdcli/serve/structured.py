"""What a chat request asks of its output beyond sampling: a grammar (`response_format`, or the
call grammar of `tool_choice` "required" / a named function), its tools, and a predicted output.
Each is checked here against the served model, and a fault is an ApiError(400) naming its field:

  tools                         engine/text/tools.parse_tools: shape, unique names, each `parameters`
                                an object schema the grammar engine compiles
                                ("tools[1].function.parameters: ...")
  tool_choice                   none | auto | required | {"type": "function", "function": {"name"}};
                                required or a name needs tools, a name one of theirs. Unset: auto
                                with tools, else none
  parallel_tool_calls           unset: one call under a named function, several otherwise (OpenAI's)
  messages.i.tool_call_id       a tool message answers a call of an earlier assistant message
  response_format...schema      compiled for the model (engine/text/constrain.py); not with a call grammar
  prediction                    at most the tokens the context leaves after the prompt

Under "required" and a named function the output is constrained to calls (engine/text/tools.call_grammar:
their arguments always parse and follow the schema); under "auto" it is not (the model's own
answer, text or calls, exactly as plain decoding gives it), and it is parsed for calls all the
same: one that does not parse is text. "none" renders the tools but parses nothing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..engine.text import constrain, tools
from ..engine.decode.prediction import prediction_ids as predicted_ids
from ..errors import HdError
from .protocol import ApiError

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSpec:
    tools: list = field(default_factory=list)   # engine/text/tools.Tool
    mode: str = "none"         # none | auto | required | named
    name: str | None = None    # the function named (mode "named")
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def parsed(self) -> bool:
        """Whether the answer is parsed for calls."""
        return self.mode != "none"


def tool_spec(req, lm) -> ToolSpec:
    """The request's tools and tool_choice, checked (ApiError 400 naming the field)."""
    try:
        offered = tools.parse_tools(req.tools or [], lm)
    except tools.ToolError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    names = [t.name for t in offered]
    choice, name = req.tool_choice, None
    if choice is None:
        mode = "auto" if offered else "none"
    elif isinstance(choice, str):
        if choice not in CHOICES:
            raise ApiError(400, f"tool_choice: {_shown(choice)} is not 'none', 'auto', 'required' or "
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
        mode = choice if offered or choice == "none" else "none"
        if choice == "required" and not offered:
            raise ApiError(400, "tool_choice: 'required' needs tools: give them in `tools`", "tool_choice")
    else:
        named = choice.get("type") == "function" and set(choice) == {"type", "function"}
        fn = choice["function"] if named else None
        name = fn.get("name") if isinstance(fn, dict) and set(fn) == {"name"} else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice: a named function is {"type": "function", "function": {"name": ...}}',
                           "tool_choice")
        if name not in names:
            known = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ApiError(400, f"tool_choice: no tool is named {_shown(name)} (the tools: {known or 'none'})",
                           "tool_choice")
        mode = "named"
    # a named function is one call of it unless the request asks for several (parallel_tool_calls:
    # true): clients that name one (langchain-openai's bind_tools(tool_choice=NAME)) send no
    # parallel_tool_calls and run each call, so a small model repeating its call ran the tool twice.
    # Otherwise OpenAI's default, several.
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else mode != "named"
    return ToolSpec(offered, mode, name, parallel)


def parses_calls(req, spec: ToolSpec | None) -> bool:
    """Whether the answer is parsed for tool calls: tools offered and not "none", and no
    response_format asking for JSON (then the answer is that JSON, whatever keys it has)."""
    if spec is None or not spec.parsed:
        return False
    return req.response_format is None or req.response_format.type == "text"


def check_tool_messages(req) -> None:
    """Every tool message answers a call of an earlier assistant message (by its id)."""
    made: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role == "assistant" and m.tool_calls:
            made.update(c.id for c in m.tool_calls)
        elif m.role == "tool" and m.tool_call_id not in made:
            raise ApiError(400, f"messages.{i}.tool_call_id: {_shown(m.tool_call_id)} answers no call of an earlier "
                           "assistant message: give the id of the call it answers", f"messages.{i}.tool_call_id")


def grammar_for(req, lm, spec: ToolSpec, family: str, lock=contextlib.nullcontext()) -> constrain.Grammar | None:
    """The grammar the answer follows: the call grammar, the response_format's, or None. lock: held
    only where lm.tokenizer is used (the call grammar's control token), never while compiling,
    which may take seconds (constrain.compile needs no lock after constrain.prepare)."""
    fmt = req.response_format
    if spec.constrained:
        if fmt is not None and fmt.type != "text":
            raise ApiError(400, "response_format: cannot be combined with tool_choice 'required' or a named "
                           "function (the answer is then the call): leave one out", "response_format")
        with lock:
            text = tools.call_grammar(spec.tools, spec.name or "required", spec.parallel, family, lm.tokenizer)
        return _compiled(lm, "lark", text, "tools")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _compiled(lm, "json_object", None, "response_format")
    where = "response_format.json_schema.schema"
    if fmt.json_schema.schema_ is None:
        raise ApiError(400, f"{where}: give the JSON schema the answer must follow", where)
    return _compiled(lm, "json_schema", fmt.json_schema.schema_, where)


def _compiled(lm, kind: str, source, where: str) -> constrain.Grammar:
    try:
        return constrain.compile(lm, kind, source)
    except constrain.GrammarError as exc:
        raise ApiError(400, f"{where}: {exc}", where) from None


def prediction_ids(req, lm, room: int) -> list[int] | None:
    """The predicted output's token ids (None without one), at most `room` of them."""
    if req.prediction is None:
        return None
    try:
        return predicted_ids(lm, req.prediction.text(), room)
    except HdError as exc:
        raise ApiError(400, f"prediction: {exc}", "prediction", "context_length_exceeded") from None


def _shown(value: str) -> str:
    """A client's string quoted in a message, cut to a readable length."""
    return repr(value if len(value) <= 64 else value[:61] + "...")

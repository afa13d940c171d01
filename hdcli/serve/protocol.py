"""The OpenAI-compatible request bodies `hd serve` takes, and its error documents.

Requests are validated strictly: an unknown field, a wrong type ("10" for an integer) or a value
out of range is a 400 with OpenAI's error schema naming the field (`param`), never a guess. Fields
a request leaves out take the server's configuration (`hd serve` options, as `hd generate`'s):
temperature 0 (greedy) unless the server was started with another.

Implemented: `frequency_penalty`, `presence_penalty`, `logit_bias` (logits processors applied
to every verified row with its own path's counts, engine/verify.py) and `logprobs` with
`top_logprobs` (chat) or `logprobs` (completions): plain decoding's numbers exactly, in streams
too. Fields apps send by default are taken at their neutral values (`response_format` text, no
tools, `tool_choice` "none" or "auto" with no tools; `parallel_tool_calls`, `store`, `metadata`,
`service_tier` whatever their value: they change nothing hd computes); any other value of them is
a 400 naming the field, since hd does not implement it (`neutral_problem`).
An assistant message's `content: null` is empty text; "tool" and "function" messages are a 400
naming their role (no tool calls).
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..config import MAX_LOGPROBS

MAX_STOP = 4
MAX_CHOICES = 8   # `n`: each choice is a request of its own in the decode loop (--max-batch)
TOOL_ROLES = ("tool", "function")   # refused by name: hd serve does not implement tool calls


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]   # "tool"/"function": parse() says why not
    # null: an assistant turn without text (OpenAI clients send it so), taken as empty text
    content: Union[str, list[TextPart], None]
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _text_unless_assistant(cls, content, info: ValidationInfo):
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("null_content", "null is taken only in assistant messages: give the "
                                      "message's text (a string or a list of text parts)")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class _Common(_Strict):
    model: str
    # sent by apps at their neutral values: accepted there, refused elsewhere (neutral_problem)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: Optional[str] = None

    # field -> (the values taken besides unset, as the message names them, what is not
    # implemented); a response_format is judged by its type
    NEUTRAL: ClassVar[dict[str, tuple[tuple, str, str]]] = {}

    def neutral_problem(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value hd does not implement, else None."""
        for name, (neutral, takes, missing) in self.NEUTRAL.items():
            value = getattr(self, name)
            if isinstance(value, ResponseFormat):
                value = value.type
            if value is not None and value not in neutral:
                return name, f"{name}: hd serve takes only {takes} ({missing}; got {value!r})"
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ApiError(400, f"stop: at most {MAX_STOP} non-empty strings", "stop")
        return stops


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None

    NEUTRAL: ClassVar[dict[str, tuple[tuple, str, str]]] = {
        **_Common.NEUTRAL,
        "response_format": (("text",), "type 'text'", "other formats are not implemented"),
        "tools": (([],), "none or []", "tool calls are not implemented"),
        "tool_choice": (("none", "auto"), "'none'", "tool calls are not implemented"),
    }

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to return with its log-probability, or None (no logprobs)."""
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)

    def limit(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


def parse(kind: type[_Strict], data) -> _Strict:
    """The request, or ApiError(400) naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    where = _not_unicode(data)
    if where is not None:
        raise ApiError(400, f"{where or 'the body'}: holds a lone surrogate escape (such as \\ud800), "
                       "which is not Unicode text: send the text as valid UTF-16 pairs or UTF-8", where or None)
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # a tool turn also has fields a message lacks (tool_call_id): its role says more than those
        err = next((e for e in errors if e["loc"][-1:] == ("role",) and e.get("input") in TOOL_ROLES), errors[0])
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "union[")))
        if err["loc"][-1:] == ("role",) and err.get("input") in TOOL_ROLES:
            msg = f"{loc}: '{err['input']}' messages are not supported (hd serve does not implement tool calls)"
        elif err["type"] == "extra_forbidden":
            msg = f"unknown field '{loc}': hd serve does not take it"
        elif loc == "n":
            msg = f"n: hd serve makes 1 to {MAX_CHOICES} choices per request"
        else:
            msg = f"{loc}: {err['msg']}"
        raise ApiError(400, msg, loc or None) from None
    problem = req.neutral_problem()
    if problem:
        raise ApiError(400, problem[1], problem[0])
    return req


def _not_unicode(doc) -> str | None:
    """Where (a dotted field path, "" for the body) a parsed JSON document holds a string with a
    lone surrogate (JSON's "\\ud800" escape parses to one; no tokenizer or UTF-8 encoder takes
    it), else None. A bad key is named by its object's path (the answer must not echo it)."""
    stack = [(doc, "")]   # not recursive: the document may be nested as deeply as json allows
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return where
        elif isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not _encodes(key):
                    return where
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{where}.{key}" if where else str(key)))
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False

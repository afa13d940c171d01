"""The OpenAI-compatible request bodies `hd serve` takes, and its error documents.

Requests are validated strictly: an unknown field, a wrong type ("10" for an integer) or a value
out of range is a 400 with OpenAI's error schema naming the field (`param`), never a guess. Fields
a request leaves out take the server's configuration (`hd serve` options, as `hd generate`'s):
temperature 0 (greedy) unless the server was started with another.

Implemented: `frequency_penalty`, `presence_penalty`, `logit_bias` (logits processors applied
to every verified row with its own path's counts, engine/decode/verify.py) and `logprobs` with
`top_logprobs` (chat) or `logprobs` (completions): plain decoding's numbers exactly, in streams
too. `response_format` (text, json_object, json_schema), `tools`, `tool_choice` (none, auto,
required, {"type": "function", "function": {"name"}}), `parallel_tool_calls` and `prediction`
({"type": "content", "content": text or text parts}) are implemented by hdcli/serve (grammars:
engine/text/constrain.py; tools: engine/text/tools.py; predictions: engine/decode/prediction.py); this module
checks their shape, the server what depends on the model (schemas compiled, tool names, lengths).
`top_k` (vLLM's and llama.cpp's, sent in extra_body) is implemented. `store`, `metadata`,
`service_tier` (chat also `prompt_cache_key`, `prompt_cache_retention`, `prompt_cache_options`,
`safety_identifier`) are taken whatever their value (they change nothing hd computes); fields
listed in IGNORED (`reasoning_effort`, `verbosity`) too, and the answer's IGNORED_HEADER names
them; fields listed in NEUTRAL are taken only at their neutral values (`neutral_problem`).
An assistant message's `content: null` (or none) is empty text, its `tool_calls` the calls it
made; the rest of what the openai client's `message.model_dump()` sends back (`refusal`,
`annotations`, a null `audio` and `function_call`) is taken and unused; a "tool" message answers
one of them by `tool_call_id`; "function" messages (OpenAI's deprecated form) are a 400 naming
their role.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..config import served_bounds

# the response header naming the request's fields hd took and did not act on (_Common.IGNORED)
IGNORED_HEADER = "X-HD-Ignored-Fields"

MAX_STOP = 4
MAX_CHOICES = 8   # `n`: each choice is a request of its own in the decode loop (--max-batch)
TOOL_ROLES = ("function",)   # OpenAI's deprecated function messages: refused by name ("tool" is taken)


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _served(name: str, default=None):
    """A field of the same meaning as the DecodingConfig field `name`, taking its range (hdcli/config.py
    declares it once: what hd generate takes, and where OpenAI's API takes less, hd serve's)."""
    return Field(default, **served_bounds(name))


class _Strict(BaseModel):
    # allow_inf_nan: JSON's NaN and Infinity parse as floats, and NaN passes every range check
    # (a NaN temperature was called too big); refused as "not a finite number", naming the field
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str      # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]   # "function": parse() says why not
    # null or left out: an assistant turn without text (OpenAI clients send it so), taken as empty text
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None    # assistant: the calls it made
    tool_call_id: Optional[str] = None             # tool: the call this answers
    # what the openai client's message.model_dump() sends back with an answer: taken, unused
    refusal: Optional[str] = None
    annotations: Optional[list] = None             # an answer's citations (web search): not input to the model
    # OpenAI's audio reply and deprecated function call: hd makes neither, so only null (a value is a 400)
    audio: Optional[dict] = None
    function_call: Optional[dict] = None

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("null_content", "{field}: give the message's text (a string or a list of "
                                      "text parts); null is taken only in assistant messages", {"field": "content"})
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("misplaced", "{field}: only assistant messages carry tool calls",
                                      {"field": "tool_calls"})
        if self.audio is not None:
            raise PydanticCustomError("unsupported", "{field}: hd serve makes no audio, so there is none to refer "
                                      "to: leave it null", {"field": "audio"})
        if self.function_call is not None:
            raise PydanticCustomError("unsupported", "{field}: OpenAI's deprecated function call is not supported: "
                                      "send the call in tool_calls and leave this null", {"field": "function_call"})
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise PydanticCustomError("misplaced", "{field}: a tool message names the call it answers by "
                                      "tool_call_id; other messages have none", {"field": "tool_call_id"})
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")   # checked and compiled by the server
    strict: Optional[bool] = None    # hd holds every schema strictly: the output always follows it


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.json_schema is None) == (self.type == "json_schema"):
            raise PydanticCustomError("misplaced", "{field}: given with type 'json_schema' (and only then)",
                                      {"field": "json_schema"})
        return self


class Prediction(_Strict):
    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Speculative(_Strict):
    """A request's own hold on drafting (engine/decode/request.Speculation); none of it changes an
    output token, only what is drafted and verified. enabled false: plain decoding; n_max: most
    drafted tokens verified a step (0: none; past the server's cap of 63 nodes a step, the cap);
    layers: the server's drafting layers this request drafts with, most local first (checked
    against the server's by Server.job_for); governor: true, the request drafts only while
    drafting pays on its own clock, false, every step drafts what the cost curve admits; unset,
    as the server runs (--governor; engine/decode/governor.py)."""
    enabled: bool = True
    n_max: Optional[int] = Field(None, ge=0)
    layers: Optional[list[str]] = None
    governor: Optional[bool] = None


class _Common(_Strict):
    model: str
    # sent by apps at their neutral values: accepted there, refused elsewhere (neutral_problem)
    frequency_penalty: Optional[float] = _served("frequency_penalty")
    presence_penalty: Optional[float] = _served("presence_penalty")
    logit_bias: Optional[dict[str, float]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    max_tokens: Optional[int] = _served("max_new_tokens")
    temperature: Optional[float] = _served("temperature")
    top_p: Optional[float] = _served("top_p")
    seed: Optional[int] = _served("seed")
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: Optional[str] = None
    # not OpenAI's, sent by clients of vLLM and llama.cpp (extra_body): implemented; -1 and 0: off
    top_k: Optional[int] = _served("top_k")
    # hd's per-request drafting controls (Speculative), and llama-server's flat key for the same cap
    speculative: Optional[Speculative] = None
    speculative_n_max: Optional[int] = Field(None, alias="speculative.n_max", ge=0)
    # llama-server's other per-request drafting keys: taken and not acted on (IGNORED): hd drafts
    # what its cost curve pays for, not a least length or probability
    speculative_n_min: Optional[int] = Field(None, alias="speculative.n_min")
    speculative_p_min: Optional[float] = Field(None, alias="speculative.p_min")

    # field -> (the values taken besides unset, as the message names them, what is not
    # implemented); a response_format is judged by its type
    NEUTRAL: ClassVar[dict[str, tuple[tuple, str, str]]] = {}
    # fields taken at any value and not acted on, named in the answer's IGNORED_HEADER
    IGNORED: ClassVar[tuple[str, ...]] = ()

    def ignored(self) -> list[str]:
        """The IGNORED fields this request set, as the request names them."""
        ignored = self.IGNORED + ("speculative_n_min", "speculative_p_min")
        return [type(self).model_fields[name].alias or name for name in ignored if getattr(self, name) is not None]

    def speculation(self) -> tuple[bool, int | None, list[str] | None, bool | None]:
        """(enabled, n_max, layers, governor) of `speculative` and llama-server's
        `speculative.n_max`; both caps given must agree."""
        own = self.speculative or Speculative()
        if own.n_max is not None and self.speculative_n_max is not None and own.n_max != self.speculative_n_max:
            raise ApiError(400, f"speculative.n_max: given twice, {self.speculative_n_max} and {own.n_max} "
                           "(as a flat key and in the speculative object): give one", "speculative.n_max")
        return (own.enabled, own.n_max if own.n_max is not None else self.speculative_n_max, own.layers,
                own.governor)

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
    max_completion_tokens: Optional[int] = _served("max_new_tokens")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = _served("logprobs")
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None    # checked against the tools by the server
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[Prediction] = None
    # taken whatever their value: they change nothing hd computes (its prefix cache is --prefix-cache-mb's,
    # per scope)
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict] = None
    safety_identifier: Optional[str] = None
    # hints to OpenAI's reasoning models; hd decodes the served model as it is (IGNORED)
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    # OpenAI's fields for what hd does not make (audio, moderation) or its deprecated functions:
    # taken at their neutral values only (NEUTRAL)
    audio: Optional[dict] = None
    modalities: Optional[list[str]] = None
    moderation: Optional[dict] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None

    IGNORED: ClassVar[tuple[str, ...]] = ("reasoning_effort", "verbosity")
    NEUTRAL: ClassVar[dict[str, tuple[tuple, str, str]]] = {
        "audio": ((), "null", "it makes text only"),
        "modalities": ((["text"],), "null or [\"text\"]", "it makes text only"),
        "moderation": ((), "null", "it runs no moderation"),
        "functions": (([],), "null or []", "OpenAI's deprecated functions: give them in `tools`"),
        "function_call": (("none",), "null or 'none'", "OpenAI's deprecated functions: use `tool_choice`"),
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
    logprobs: Optional[int] = Field(None, ge=0, le=5)   # OpenAI's completions: at most 5 alternatives

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
        if err.get("ctx", {}).get("field"):   # a check of several fields (a model validator): it names one
            loc = f"{loc}.{err['ctx']['field']}" if loc else err["ctx"]["field"]
            msg = err["msg"].replace(f"{err['ctx']['field']}:", f"{loc}:", 1)
        elif err["loc"][-1:] == ("role",) and err.get("input") in TOOL_ROLES:
            msg = (f"{loc}: '{err['input']}' messages are not supported (OpenAI's deprecated form): send the "
                   "function's result as a 'tool' message with the tool_call_id it answers")
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

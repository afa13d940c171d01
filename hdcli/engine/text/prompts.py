"""From a prompt to token ids, and from accepted tokens back to text.

encode_prompt/encode_messages apply the model's chat template (rendered with bounded time and
size, engine/text/templates.py; a prompt surely longer than the context is refused before it is
tokenized whole); TextStream turns tokens into text pieces as they are accepted (holding back
incomplete UTF-8); stop_checker and cut_at_stop implement stop strings (the output is cut at the shortest prefix that contains one).

Message contents are text: a special token's string in a message ("<|im_end|>") is tokenized as
those characters, never as the control token, so a user cannot forge a system or assistant turn;
only the template's own special tokens are control tokens. Contents without such strings give the
tokenizer's usual ids, unchanged. A raw prompt (encode_prompt with chat=False, as /v1/completions)
is the caller's own text: its special tokens' strings stay special.
"""
from __future__ import annotations

import contextlib
import json
from typing import Callable, Sequence

from ...errors import HdError
from . import templates
from .templates import TemplateError


# A prompt longer than CHARS_PER_TOKEN characters a token of context is counted in pieces of that
# many characters before it is tokenized whole: a prompt file of megabytes took tens of seconds and
# gigabytes to be found too long. A cut between pieces may add a few tokens (PIECE_SLACK) that the whole lacks.
CHARS_PER_TOKEN = 8
PIECE_SLACK = 4


class PromptTooLong(HdError):
    """The prompt holds more tokens than the model's context."""


def encode_prompt(tokenizer, prompt: str, chat: bool = True, system: str | None = None,
                  max_tokens: int | None = None) -> list[int]:
    """Token ids of the prompt, through the model's chat template unless chat is False.
    max_tokens: the model's context; a prompt surely longer is refused before it is tokenized whole."""
    if not prompt or not prompt.strip():
        raise HdError("the prompt is empty: pass --prompt TEXT or --prompt-file FILE")
    if not chat:   # a raw prompt: the caller may write control tokens on purpose
        refuse_too_long(tokenizer, [prompt], max_tokens, as_text=False)
        return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    messages = ([{"role": "system", "content": system}] if system else [])
    try:
        return encode_messages(tokenizer, messages + [{"role": "user", "content": prompt}], chat=chat,
                               max_tokens=max_tokens)
    except TemplateError as exc:
        raise TemplateError(f"{exc}: fix the template, or pass --raw to send the prompt as it is") from None


def encode_messages(tokenizer, messages: list[dict], chat: bool = True, max_tokens: int | None = None,
                    lock=None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the assistant's answer:
    the chat template when the tokenizer has one (and chat), else the contents of the user and
    assistant turns joined by blank lines (a lone prompt is itself; a system message is dropped).
    Contents are text either way: special tokens' strings in them never become control tokens.
    max_tokens: as encode_prompt's. lock: held around each use of the tokenizer (not while the
    template renders: hd serve's decode loop decodes with it meanwhile). tools: OpenAI tool dicts
    for the template's `tools` variable (engine/text/tools.py renders calls and results for templates
    without it); their control tokens' strings stay text as the messages' do.
    The template renders with bounded time and size (engine/text/templates.py): TemplateError else."""
    lock = lock or contextlib.nullcontext()
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    refuse_too_long(tokenizer, contents, max_tokens, lock=lock)
    if chat and getattr(tokenizer, "chat_template", None):
        try:
            ids = _through_template(tokenizer, messages, sum(len(c) for c in contents), lock, tools)
        except ValueError as exc:
            if "Can't sanitize" not in str(exc):
                raise
            # a tokenizer whose vocabulary has the token's string as a word gives it back from text
            raise HdError(f"a message holds a control token of this model that its tokenizer cannot keep "
                          f"as text ({exc}): remove it from the message") from None
        return [int(t) for t in ids]
    text = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    with lock:
        return [int(t) for t in tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]]


def _through_template(tokenizer, messages: list[dict], chars: int, lock, tools: list[dict] | None = None) -> list[int]:
    """apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
    sanitize_control_tokens=True) step by step, its template rendered by templates.render:
    transformers marks control tokens in the messages and encodes them as text, the template's
    own as tokens; what holds none is encoded exactly as without the flag."""
    from transformers.utils import chat_template_utils as ctu
    source = getattr(tokenizer, "name_or_path", "") or "this model"
    template = tokenizer.get_chat_template(None, tools)   # a "tool_use" template where it has one
    literal = templates.literal_text(template, source)   # parsed here: transformers would compile it
    with lock:
        added = list(tokenizer.added_tokens_decoder.values())
        variables = ctu._plain_template_data(dict(tokenizer.special_tokens_map))
    # tokenizer._get_control_tokens, on the literal text parsed above
    listed = tokenizer.chat_control_tokens
    controls = tuple(t.content for t in added if t.special or (
        t.content in set(listed) if listed is not None else t.content in literal and not t.content.isspace()))
    marked = ctu.mark_control_tokens(ctu._normalize_chat_messages(messages), ctu._get_control_token_patterns(controls)[0])
    chat = ctu._alias_reasoning_fields(ctu._plain_template_data(marked))
    if tools is not None:
        tools = ctu._plain_template_data(ctu.mark_control_tokens(tools, ctu._get_control_token_patterns(controls)[0]))
        chars += len(json.dumps(tools))
    text = templates.render(template, source,
                            max_chars=templates.TEMPLATE_CHARS + 2 * chars, messages=chat, tools=tools,
                            documents=None, add_generation_prompt=True, **variables)
    if not text.strip():   # a prompt of nothing: the template dropped the messages (or failed quietly)
        raise TemplateError(f"the chat template of {source} gave no text for the messages")
    with lock:
        return tokenizer(text, add_special_tokens=False, sanitize_control_tokens=True)["input_ids"]


def refuse_too_long(tokenizer, texts: Sequence[str], max_tokens: int | None, as_text: bool = True,
                    lock=None) -> None:
    """HdError when texts (a prompt, a conversation's contents) surely hold more than max_tokens
    tokens, found by tokenizing pieces of CHARS_PER_TOKEN * max_tokens characters until their
    tokens (less PIECE_SLACK each) pass it; texts within one piece's length are left to the exact
    count after tokenizing. as_text: special tokens' strings count as text (messages' contents)."""
    chars = sum(len(t) for t in texts)
    piece = CHARS_PER_TOKEN * (max_tokens or 0)
    if not max_tokens or chars <= piece:
        return
    lock = lock or contextlib.nullcontext()
    counted = 0
    for text in texts:
        for start in range(0, len(text), piece):
            with lock:
                n = len(tokenizer(text[start:start + piece], add_special_tokens=False,
                                  split_special_tokens=as_text)["input_ids"])
            counted += max(0, n - PIECE_SLACK)
            if counted > max_tokens:
                raise PromptTooLong(f"the prompt ({chars} characters) is longer than the model's context "
                                    f"of {max_tokens} tokens: shorten it")


class TextStream:
    """Turns accepted tokens into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, on_text: Callable[[str, str | None], None]):
        self.tok, self.on_text = tokenizer, on_text
        self.tokens: list[int] = []
        self.emitted = ""

    def __call__(self, tokens: list[int], layers: list[str | None]) -> None:
        for t, layer in zip(tokens, layers):
            self.tokens.append(t)
            text = self.tok.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if text.startswith(self.emitted):
                piece = text[len(self.emitted):]
                if piece:
                    self.on_text(piece, layer)
            self.emitted = text


def stop_checker(tokenizer, stop: Sequence[str]):
    if not stop:
        return None

    def check(tokens: list[int]) -> int | None:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not any(s in text for s in stop):
            return None
        for n in range(1, len(tokens) + 1):  # the shortest output that contains a stop string
            if any(s in tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stop):
                return n
        return None
    return check


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text

"""From a prompt to token ids, and from accepted tokens back to text.

encode_prompt/encode_messages apply the model's chat template; TextStream turns tokens into text
pieces as they are accepted (holding back incomplete UTF-8); stop_checker and cut_at_stop
implement stop strings (the output is cut at the shortest prefix that contains one).

Message contents are text: a special token's string in a message ("<|im_end|>") is tokenized as
those characters, never as the control token, so a user cannot forge a system or assistant turn;
only the template's own special tokens are control tokens. Contents without such strings give the
tokenizer's usual ids, unchanged. A raw prompt (encode_prompt with chat=False, as /v1/completions)
is the caller's own text: its special tokens' strings stay special.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..errors import HdError


def encode_prompt(tokenizer, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids of the prompt, through the model's chat template unless chat is False."""
    if not prompt or not prompt.strip():
        raise HdError("the prompt is empty: pass --prompt TEXT or --prompt-file FILE")
    if not chat:   # a raw prompt: the caller may write control tokens on purpose
        return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    messages = ([{"role": "system", "content": system}] if system else [])
    return encode_messages(tokenizer, messages + [{"role": "user", "content": prompt}], chat=chat)


def encode_messages(tokenizer, messages: list[dict], chat: bool = True) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the assistant's answer:
    the chat template when the tokenizer has one (and chat), else the contents of the user and
    assistant turns joined by blank lines (a lone prompt is itself; a system message is dropped).
    Contents are text either way: special tokens' strings in them never become control tokens."""
    if chat and getattr(tokenizer, "chat_template", None):
        try:
            # transformers marks control tokens in the messages and encodes them as text, the
            # template's own as tokens; what holds none is encoded exactly as without the flag
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                sanitize_control_tokens=True)
        except ValueError as exc:
            if "Can't sanitize" not in str(exc):
                raise
            # a tokenizer whose vocabulary has the token's string as a word gives it back from text
            raise HdError(f"a message holds a control token of this model that its tokenizer cannot keep "
                          f"as text ({exc}): remove it from the message") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    text = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    return [int(t) for t in tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]]


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

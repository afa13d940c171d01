"""Predicted outputs (OpenAI's `prediction`): a layer at the top of the hierarchy that drafts the
continuation of a text the caller expects the answer to repeat (the file being edited).

State: `pos`, the index in the prediction of the token expected next (None: lost), and `run`, how
many output tokens in a row matched it. Each output token that equals prediction[pos] moves pos
on; a mismatch re-aligns: pos becomes the place just after the next occurrence in the prediction
of the output's last `ALIGN_N` tokens (searched from the old place first, then from the start),
or after its last `ALIGN_N - 1`, ..., down to 2 tokens; none found: lost until one is.

Draft length: the layer offers the prediction up to the room the loop gives; its per-token
acceptance estimate grows with how long the current match has held, rate() = (run + 1) / (run + 2)
within [0.5, 0.98], and the tree's cost cap (engine/decode/tree.cap_by_cost, the measured cost curve)
keeps the prefix whose expected tokens pay for its rows. A prediction never changes output: its
tokens are drafts the target verifies like any other.
"""
from __future__ import annotations

from typing import Sequence

from ...errors import HdError

ALIGN_N = 4            # longest suffix of the output looked up in the prediction to re-align
MIN_RATE, MAX_RATE = 0.5, 0.98


class Prediction:
    name = "prediction"

    def __init__(self, tokens: Sequence[int]):
        self.tokens = [int(t) for t in tokens]
        # n-gram -> positions just after each occurrence, for n = 2 .. ALIGN_N
        self.after: dict[tuple[int, ...], list[int]] = {}
        for n in range(2, ALIGN_N + 1):
            for i in range(len(self.tokens) - n + 1):
                self.after.setdefault(tuple(self.tokens[i:i + n]), []).append(i + n)
        self.pos: int | None = 0 if self.tokens else None
        self.run = 0

    def rate(self) -> float:
        return min(MAX_RATE, max(MIN_RATE, (self.run + 1) / (self.run + 2)))

    def propose(self, max_len: int) -> list[int]:
        if self.pos is None or max_len <= 0:
            return []
        return self.tokens[self.pos:self.pos + max_len]

    def extend(self, output: Sequence[int], new: int) -> None:
        """output (every generated token, the `new` last ones just added) moved on by `new` tokens."""
        for k in range(len(output) - new, len(output)):
            t = output[k]
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == t:
                self.pos += 1
                self.run += 1
            else:
                self.run = 0
                self.pos = self._realign(output[:k + 1])

    def peek(self, output: Sequence[int], more: Sequence[int], max_len: int) -> list[int]:
        """What propose() would give after `more` tokens were output, the state left unchanged."""
        pos, run = self.pos, self.run
        try:
            full = list(output) + list(more)
            self.extend(full, len(more))
            return self.propose(max_len)
        finally:
            self.pos, self.run = pos, run

    def _realign(self, output: Sequence[int]) -> int | None:
        start = self.pos or 0
        for n in range(min(ALIGN_N, len(output)), 1, -1):
            places = self.after.get(tuple(output[-n:]))
            if places:
                return next((p for p in places if p >= start), places[0])
        return None


def prediction_ids(lm, prediction: str | Sequence[int] | None, room: int) -> list[int] | None:
    """A predicted output as token ids (text is tokenized without special tokens), or HdError
    when it is longer than the room the context leaves after the prompt."""
    if prediction is None or len(prediction) == 0:
        return None
    ids = ([int(t) for t in lm.tokenizer(prediction, add_special_tokens=False)["input_ids"]]
           if isinstance(prediction, str) else [int(t) for t in prediction])
    if len(ids) > room:
        raise HdError(f"the prediction is {len(ids)} tokens, more than the {room} the model's context "
                      "leaves after the prompt: shorten it")
    return ids

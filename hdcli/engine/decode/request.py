"""Request: what one generation asks for, as one frozen record.

Every way in builds one in one place, `DecodingConfig.request` (hdcli/config.py), through a
run's `Run.request` (hdcli/generation.py), which checks it against the context's room: the API
and the CLI from a configuration, `hd serve` with a parsed request body's own fields
(`Server.job_for`, hdcli/serve/server.py). The decode loop takes it (`Decoder.generate`,
`Decoder.stream`, `Stream`: engine/decode/loop.py), and so does the server's decode loop (a
`Job` is a Request plus how its answer travels and when it ran: hdcli/serve/scheduler.py).
What is the run's, not one generation's (the model, the drafter, the cost curve), is the
Decoder's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable, Sequence

from ..text.constrain import Grammar
from .verify import Sampling


@dataclass(frozen=True)
class Speculation:
    """A request's own hold on drafting; none of it changes an output token, only how many are
    drafted and verified. enabled False: plain decoding, nothing drafted (not the grammar's forced
    tokens, not a prediction). max_draft: most drafted tokens verified a step (the tree's nodes past
    its root; 0: none drafted; None: as many as the cost curve admits, at most the decoder's
    max_nodes). layers: the run's drafting layers this request drafts with, most local first (a
    subset of the run's own, checked by the caller; None: all of them). governed: True, a step
    drafts only while drafting pays on this request's own clock (engine/decode/governor.py; off by
    default: on our sets it cost more than it saved, docs/benchmarks.md); False, every step drafts
    what the cost curve admits; None, the run's choice (DecodingConfig.governor; the decode loop
    reads None as False). hd serve's `speculative` body field
    (llama-server's per-request `speculative.n_max` is its precedent), the API's `speculation=`."""
    enabled: bool = True
    max_draft: int | None = None
    layers: tuple[str, ...] | None = None
    governed: bool | None = None

    def __post_init__(self):
        if self.max_draft is not None and self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, not {self.max_draft}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def drafts(self) -> bool:
        """Whether anything is drafted at all."""
        return self.enabled and self.max_draft != 0


@dataclass(frozen=True)
class Request:
    """One generation: its prompt, how long it may run, how each token is chosen and what the
    answer is held to or comes with.

    prompt_ids: the prompt as token ids (not empty). max_new_tokens: most tokens generated.
    sampling: how each next token is chosen (verify.Sampling; the default is greedy). seed, choice:
    sampled output is keyed by (seed, choice index, output position), so the same seed gives the
    same tokens with or without drafts (verify.coupled_choice); None draws a key at random. stop:
    strings that end the answer (cut before them; the caller's stop_check looks for them).
    logprobs: None, or k to return each token's log-probability and its k best alternatives.
    grammar: the output follows it (engine/text/constrain.py). prediction: token ids the answer
    is expected to repeat, drafted by their own layer (engine/decode/prediction.py). scope: whose
    prefix-cache entries the prompt may reuse (hd serve's tenants; "" is one scope for all).
    speculation: how much this request drafts (Speculation: off, a cap a step, its layers)."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: int | None = None
    choice: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None
    prediction: tuple[int, ...] | None = None
    scope: Hashable = ""
    speculation: Speculation = Speculation()

    def __post_init__(self):
        # one form whatever the caller passed (lists, a tensor's ints): the record stays hashable
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.prediction is not None:
            object.__setattr__(self, "prediction", tuple(int(t) for t in self.prediction))

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, request: "Request | Sequence[int]", **fields) -> "Request":
        """request as it is, or prompt ids with the other fields by name (the decode loop's
        shorthand: Decoder(model).generate(ids, max_new_tokens=40))."""
        if isinstance(request, Request):
            return request.replace(**fields) if fields else request
        return cls(request, **fields)

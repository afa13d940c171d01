"""The decode loop: draft, verify every drafted token in one target forward, accept, crop, repeat.

KV-cache invariant: at the top of each step the cache holds every history token except the
last one (`last`), which is fed as the first input of the step together with the draft. After a
forward over [last] + draft the cache holds history + draft; we crop it to history + the accepted
draft tokens, so a rejected token never stays in the cache. The target's own next token becomes
`last` for the next step.

With no drafter this is plain autoregressive decoding with the same model and cache (the `ar`
baseline every speedup is measured against).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .drafting import Hierarchy
from .stats import RunStats
from .verify import Sampling, accept_chain

# on_tokens(tokens, layers): called after each step with the new tokens and, per token, the name
# of the layer that drafted it (None for the target's own token).
TokenCallback = Callable[[list[int], list[str | None]], None]


@dataclass
class Generation:
    tokens: list[int]            # new tokens, EOS included when it ended the generation
    layers: list[str | None]     # per token: the drafting layer, or None for the target's own
    stop_reason: str             # "eos" | "length" | "stop"
    stats: RunStats = field(default_factory=RunStats)


def _crop_to(cache, length: int) -> None:
    """Drop cache entries past `length`. transformers 5 reads crop(-r) as "remove r" and refuses
    positive values; older versions read a positive value as the length to keep. -r means the
    same in both."""
    remove = cache.get_seq_length() - length
    assert remove >= 0, f"cache holds {cache.get_seq_length()} tokens, cannot crop to {length}"
    if remove:
        cache.crop(-remove)


class Decoder:
    """Speculative decoding of one sequence with a target model and a drafting hierarchy."""

    def __init__(self, model, eos_ids: Sequence[int] = (), drafter: Hierarchy | None = None):
        self.model = model
        self.eos_ids = set(int(e) for e in eos_ids)
        self.drafter = drafter
        self.device = next(model.parameters()).device

    def _forward(self, ids: Sequence[int], cache) -> torch.Tensor:
        inp = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return self.model(input_ids=inp, past_key_values=cache, use_cache=True).logits[0]

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 256,
                 sampling: Sampling = Sampling(), seed: int | None = None,
                 stop_check: Callable[[list[int]], int | None] | None = None,
                 on_tokens: TokenCallback | None = None) -> Generation:
        """stop_check(tokens) may return a length to cut the output at (a stop string was seen)."""
        from transformers import DynamicCache
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else torch.seed())
        stats = RunStats(prompt_tokens=len(prompt_ids))
        t_start = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        history = [int(t) for t in prompt_ids]
        if len(history) > 1:
            self._forward(history[:-1], cache)
        stats.prefill_seconds = time.perf_counter() - t_start
        drafter = self.drafter
        if drafter is not None:
            drafter.reset(history)
        out: list[int] = []
        out_layers: list[str | None] = []
        stop_reason = "length"
        while len(out) < max_new_tokens:
            t0 = time.perf_counter()
            drafts = drafter.propose(history, max_new_tokens - len(out) - 1, stats) if drafter else []
            draft = list(drafts[0].tokens) if drafts else []
            t1 = time.perf_counter()
            kept = len(history) - 1            # cache length before this step
            logits = self._forward([history[-1]] + draft, cache)
            n, nxt = accept_chain(logits, draft, sampling, gen)
            _crop_to(cache, kept + 1 + n)      # keep `last` and the accepted draft tokens only
            t2 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            new = draft[:n] + [nxt]
            new_layers = [drafts[0].layer] * n + [None] if drafts else [None]
            if drafts:
                ls = stats.layer(drafts[0].layer)
                ls.drafted += len(draft)
                ls.accepted += n
            for i, t in enumerate(new):
                if t in self.eos_ids:
                    new, new_layers, stop_reason = new[:i + 1], new_layers[:i + 1], "eos"
                    break
            stats.accept_lengths.append(len(new))
            history.extend(new)
            before = len(out)
            out.extend(new)
            out_layers.extend(new_layers)
            if stop_check is not None:
                cut = stop_check(out)
                if cut is not None:
                    del out[cut:], out_layers[cut:]
                    stop_reason = "stop"
            if on_tokens is not None and len(out) > before:
                on_tokens(out[before:], out_layers[before:])
            if stop_reason != "length":
                break
            if drafter is not None:
                drafter.extend(new)
        stats.new_tokens = len(out)
        stats.wall_seconds = time.perf_counter() - t_start
        return Generation(tokens=out, layers=out_layers, stop_reason=stop_reason, stats=stats)

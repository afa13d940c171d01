"""What the decode loop asks of a target model (`TargetModel`) and of its KV cache (`KVCache`), and
the adapter that gives it over transformers' stock forward (`TransformersForward`).

Two kinds of target implement it: hd's own forward (llama.LlamaForward and gemma3.Gemma3Forward),
and a transformers causal LM wrapped in TransformersForward (the loader wraps the models it loads
for other architectures; `as_target` wraps one a caller passes). The decode loop, tree
verification, the batched forward, the prefix cache, cost measurement and calibration call these
methods only, so a reader can follow each call to the forward that runs it.

    class TargetModel:
        config                      # vocab_size, num_hidden_layers, ... (hd's ModelConfig or transformers')
        numerics: Numerics | None   # how it computes (model/numerics.py); None on transformers' forward
        invariant: bool             # rows bit-equal to one-token rows (the M-invariant mode)
        eos_token_id                # the model's own end-of-sequence id(s), or None
        device, dtype               # where its weights are and what they compute in
        module                      # the torch module holding the weights (counting, packing, generate)
        def new_cache(self) -> KVCache                       # an empty KV cache for this model
        def prefill(self, input_ids, cache) -> None          # append a prompt's keys and values, no logits
        def forward(self, input_ids, cache=None, position_ids=None, mask=None) -> logits [m, V]
        def forward_many(self, parts) -> list[logits]        # parts: (input_ids, cache, position_ids, mask)

forward runs the new rows of one stream on `cache` (which grows by them; None: a fresh cache);
position_ids and mask are given for a token tree (engine/decode/tree.py builds them), None for a
causal chain. forward_many runs several streams' rows, each on its own cache.

    class KVCache:
        def get_seq_length(self) -> int                      # tokens cached
        def append(self, layer, keys, values) -> None        # rows [b, kv heads, m, d] after the cached ones
        def crop(self, max_length) -> None                   # negative: drop the last -max_length rows
        def keep_path(self, past, path) -> None              # after a tree's forward: the root and path stay
        def sliding_windows(self) -> list[int | None]        # per block, the window the tree mask applies
        def supports_trees(self) -> bool                     # whether rejected branches can be cut from it

A target's new_cache makes one; two kinds implement it. hd's own forward's (kvcache.Cache): every
block keeps every row and the owned attention applies a sliding window itself, so no block asks
the tree mask for one. Transformers' DynamicCache, for TransformersForward
(transformers_cache.TransformersCache): its sliding-window layers show a forward only their last
window - 1 rows, so the tree mask applies the window. The decode loop, tree verification
(engine/decode/tree.py), cost measurement and calibration call these methods only; what lies
inside a cache is read by its own forward, and by the prefix cache, which serves hd's own forward
alone (engine/decode/prefix.py).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .llama import LlamaForward
from .numerics import Numerics


class KVCache(Protocol):
    """See the module docstring; kvcache.Cache and transformers_cache.TransformersCache implement it."""

    def get_seq_length(self) -> int: ...
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...
    def crop(self, max_length: int) -> None: ...
    def keep_path(self, past: int, path: Sequence[int]) -> None:
        """After a forward over a token tree on a cache of `past` tokens: keep the root's and the
        accepted path's rows (node ids, root excluded, in order) where a chain's would be, drop the
        rest (engine/decode/tree.py numbers the nodes)."""
    def sliding_windows(self) -> list[int | None]: ...
    def supports_trees(self) -> bool: ...


class TargetModel(Protocol):
    """See the module docstring; LlamaForward (Gemma3Forward) and TransformersForward implement it."""

    config: object
    numerics: Numerics | None
    invariant: bool
    eos_token_id: object
    device: torch.device
    dtype: torch.dtype
    module: torch.nn.Module

    def new_cache(self) -> KVCache: ...
    def prefill(self, input_ids: torch.Tensor, cache: KVCache) -> None: ...
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                position_ids: torch.Tensor | None = None, mask=None) -> torch.Tensor: ...
    def forward_many(self, parts: Sequence[tuple]) -> list[torch.Tensor]: ...


class TransformersForward:
    """TargetModel over a transformers causal LM (`module`) and its stock forward: a DynamicCache
    (transformers_cache.TransformersCache), no M-invariant mode; several streams run one forward each."""

    numerics = None
    invariant = False

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.config = module.config

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def eos_token_id(self):
        return self.module.generation_config.eos_token_id

    def new_cache(self) -> KVCache:
        """A DynamicCache whose every layer can be cropped back after a rejection
        (transformers_cache.py: imported here, where a transformers model already runs)."""
        from .transformers_cache import TransformersCache
        return TransformersCache(config=self.config)

    def prefill(self, input_ids: torch.Tensor, cache) -> None:
        """The head runs on one row where the model takes `logits_to_keep`, as its generate()
        does (for a 400-token prompt that saves 400 rows of the head)."""
        try:
            self.module(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except TypeError:  # an older model class without logits_to_keep; the cache is untouched
            self.module(input_ids=input_ids, past_key_values=cache, use_cache=True)

    def forward(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                mask=None) -> torch.Tensor:
        if cache is None:
            return self.module(input_ids=input_ids).logits[0]
        tree = {} if mask is None else {"position_ids": position_ids, "attention_mask": mask}
        return self.module(input_ids=input_ids, past_key_values=cache, use_cache=True, **tree).logits[0]

    def forward_many(self, parts: Sequence[tuple]) -> list[torch.Tensor]:
        return [self.forward(ids, cache, pos, mask) for ids, cache, pos, mask in parts]


def as_target(model) -> TargetModel:
    """`model` as a TargetModel: hd's own forward, an adapter and any other object that is not a
    torch module (a stand-in that implements the protocol itself: bench/drafts.py's replay) as they
    are, a transformers model wrapped in TransformersForward."""
    if isinstance(model, (LlamaForward, TransformersForward)) or not isinstance(model, torch.nn.Module):
        return model
    return TransformersForward(model)

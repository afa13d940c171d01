"""The KV cache of a target on transformers' forward (target.TransformersForward): transformers'
DynamicCache with the methods of target.KVCache, so that the decode loop and tree verification
never look inside it.

It is a DynamicCache, not a wrapper around one: the model's forward takes it as its
past_key_values, as transformers' own generate() passes its cache. This module imports
transformers, so it is imported only where a transformers model runs (TransformersForward.new_cache).

Invariants
  * Every layer can be cut back after a rejected draft: full layers keep every row, and sliding-window
    layers are made to record their past (`activate_past_recording`), keeping every row until
    keep_path's crop cuts them back to window - 1 (transformers' DynamicSlidingWindowLayer.crop).
  * A sliding-window layer holds fewer rows than a full one, so keep_path finds a tree's rows from
    each layer's end.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from .kvcache import keep_rows


def _is_sliding(layer) -> bool:
    return getattr(layer, "is_sliding", False)


class TransformersCache(DynamicCache):
    """target.KVCache over transformers' DynamicCache (module header). config None: layers made as
    rows arrive, all full (transformers' DynamicCache())."""

    def __init__(self, config=None):
        super().__init__(config=config)
        for layer in self.layers:
            if _is_sliding(layer) and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.update(keys, values, layer)

    def keep_path(self, past: int, path: Sequence[int]) -> None:
        want = [0, *path]
        nodes = self.get_seq_length() - past
        keep_rows(self.layers, nodes, want)
        remove = nodes - len(want)
        assert remove >= 0
        if remove:
            self.crop(-remove)
        for layer in self.layers:   # back to window - 1 rows (recording keeps them all)
            if _is_sliding(layer) and layer.get_seq_length() >= layer.sliding_window \
                    and layer.keys.shape[-2] >= layer.sliding_window:
                layer.crop(0)

    def sliding_windows(self) -> list[int | None]:
        return [layer.sliding_window if _is_sliding(layer) else None for layer in self.layers]

    def supports_trees(self) -> bool:
        """Every sliding-window layer records its past, so rejected branches can be cut from it
        (a cache made without the recording, by transformers' own code, cannot)."""
        return all(getattr(layer, "record_past", False) for layer in self.layers if _is_sliding(layer))

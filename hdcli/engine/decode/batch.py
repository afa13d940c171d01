"""Verification forwards of several generations at once: each stream's tree in its own rows of
one forward, each on its own KV cache.

Why: a decode step of a small model is bound by reading the weights and by per-forward overhead,
not by arithmetic; k streams' rows through one forward cost far less than k forwards (the cost
curve, hdcli/engine/decode/costs.py). One step of several streams (loop.speculative_steps, each
turn of `hd serve`) verifies them through here.

Exactness: in the M-invariant mode (hdcli/engine/kernels/invariant.py) every row-wise op (embedding,
norms, rotary, Linear layers, head) gives each row the value it has in any forward of any width
up to invariant.MAX_ROWS, and each stream's attention runs on its own cache and layout (hd's own
forward's forward_many, hdcli/engine/model/llama.py). So a stream's logits are torch.equal to
its forward alone, whatever else is verified beside it (tests/test_batch.py).

Parameters and invariants
  * forward_many(model, items) batches only where the model is hd's own forward in the mode;
    otherwise (transformers' forward, the mode off) it runs the items one forward each, which
    is exact too but saves nothing.
  * A group never exceeds invariant.MAX_ROWS rows, the widest forward the mode is calibrated
    for: items are packed in order into groups that fit.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import invariant
from .tree import Tree, tree_forward, tree_rows


def can_batch(model) -> bool:
    """Whether forward_many verifies several items in one forward for this model (a TargetModel,
    engine/model/target.py): hd's own forward in the M-invariant mode."""
    return model.invariant


def groups(sizes: Sequence[int], max_rows: int = invariant.MAX_ROWS) -> list[list[int]]:
    """Item indices packed in order into groups of at most max_rows rows (an item wider than
    max_rows is a group of its own)."""
    out: list[list[int]] = []
    rows = 0
    for i, n in enumerate(sizes):
        if out and rows + n <= max_rows:
            out[-1].append(i)
            rows += n
        else:
            out.append([i])
            rows = n
    return out


@torch.inference_mode()
def forward_many(model, items: Sequence[tuple[Tree, int, object]]) -> list[torch.Tensor]:
    """items: (tree, root token, cache) per stream. Returns each tree's logits [nodes, V], as
    tree_forward would alone; each cache grows by its tree's nodes."""
    if len(items) == 1 or not can_batch(model):
        return [tree_forward(model, tree, root, cache) for tree, root, cache in items]
    parts = [tree_rows(model, tree, root, cache) for tree, root, cache in items]
    out: list[torch.Tensor] = []
    for group in groups([p[0].shape[1] for p in parts]):
        out.extend(model.forward_many([parts[i] for i in group]))
    return out

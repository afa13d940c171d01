"""Token trees: several drafted candidates merged by shared prefix and verified in one forward.

Node 0 is the root: the last token of the history (fed as the first input of every step, see
decode.py). Every other node is a drafted token whose parent is the node before it in its
candidate. Nodes are numbered in insertion order, so a parent always precedes its children and
the first candidate's tokens are nodes 1..len(c) -- when the first candidate wins, its KV entries
are already where a chain's would be and no cache entry has to move.

The forward over a tree feeds every node at once, at position (cache length + depth), with an
attention mask that lets a node see the whole cache, its ancestors and itself, nothing else. Each
node's logits are then the logits of its path run alone (tests/test_tree.py checks this).

Cost cap. Each node gets an estimate of the probability that the target accepts it: along a
candidate, the product of its layer's per-token acceptance estimate; for the j-th child of a
node, times the chance that the children tried before it were rejected. A verification forward
over w tokens costs cost(w) (measured, hdcli/costs.py, one-token forward = 1). Keeping the k
likeliest nodes yields 1 + sum of their estimates tokens per step, so we keep the k that maximises
(1 + sum) / cost(1 + k). k = 0 is plain decoding: a draft that is not expected to pay for its
forward is not sent.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class Tree:
    def __init__(self):
        self.tokens: list[int] = [-1]           # node -> token (root: filled in by the caller)
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.layers: list[str | None] = [None]  # layer of the candidate that created the node
        self.children: list[list[int]] = [[]]   # in insertion order = the order they are tried

    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def add(self, parent: int, token: int, layer: str | None) -> int:
        for c in self.children[parent]:
            if self.tokens[c] == token:
                return c
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.layers.append(layer)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def add_candidate(self, tokens: Sequence[int], layer: str | None) -> None:
        node = 0
        for t in tokens:
            node = self.add(node, t, layer)

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def subtree(self, keep: Sequence[int]) -> "Tree":
        """A new tree of the kept nodes (must be closed under parent), in the original order."""
        t = Tree()
        new_of = {0: 0}
        for i in sorted(keep):
            if i == 0:
                continue
            new_of[i] = t.add(new_of[self.parents[i]], self.tokens[i], self.layers[i])
        return t


Rate = Callable[[str | None, int, bool], float]  # (layer, depth, first child?) -> acceptance


def node_estimates(tree: Tree, rate: Rate) -> list[float]:
    """Estimated probability that each node is accepted (root: 1)."""
    est = [1.0] * len(tree.tokens)
    for parent in range(len(tree.tokens)):
        left = est[parent]  # chance that the search reaches this child: parent reached, earlier siblings rejected
        for j, c in enumerate(tree.children[parent]):
            a = rate(tree.layers[c], tree.depths[c], j == 0)
            est[c] = left * a
            left *= 1.0 - a
    return est


def cap_by_cost(tree: Tree, est: Sequence[float], cost: Callable[[int], float],
                max_nodes: int = 64) -> Tree:
    """Keep the k likeliest nodes maximising (1 + their summed estimates) / cost(1 + k).

    A child's estimate never exceeds its parent's and ties go to the lower index (the parent),
    so every prefix of the ranking is closed under parent and is a tree."""
    order = sorted(range(1, len(tree.tokens)), key=lambda i: (-est[i], i))[:max_nodes]
    best_k, best, gain = 0, 1.0 / cost(1), 1.0
    for k, i in enumerate(order, start=1):
        gain += est[i]
        value = gain / cost(1 + k)
        if value > best:
            best_k, best = k, value
    if best_k == len(tree.tokens) - 1:
        return tree
    return tree.subtree(order[:best_k])


def build_tree(drafts, rate: Rate, cost: Callable[[int], float] | None,
               max_nodes: int = 63, branches: bool = True) -> Tree:
    """Merge candidates (drafting.Draft, best first) into a tree and keep what pays for its
    forward (cost None: everything up to max_nodes). branches False: the first candidate only."""
    tree = Tree()
    for d in drafts if branches else drafts[:1]:
        tree.add_candidate(d.tokens, d.layer)
    if tree.size() and cost is not None:
        return cap_by_cost(tree, node_estimates(tree, rate), cost, max_nodes)
    if tree.size() > max_nodes:
        return tree.subtree(range(max_nodes + 1))
    return tree


def reached(tree: Tree, path: Sequence[int]) -> tuple[dict, dict]:
    """Drafted nodes the verification reached (parent kept) and nodes it kept, counted by
    (layer, bucket) where bucket is drafting.bucket(depth, first child?)."""
    from .drafting import bucket
    on_path = set(path)
    tested: dict[tuple, int] = {}
    accepted: dict[tuple, int] = {}
    for i in range(1, len(tree.tokens)):
        parent = tree.parents[i]
        if parent == 0 or parent in on_path:
            key = (tree.layers[i], bucket(tree.depths[i], tree.children[parent][0] == i))
            tested[key] = tested.get(key, 0) + 1
            if i in on_path:
                accepted[key] = accepted.get(key, 0) + 1
    return tested, accepted


def tree_mask(tree: Tree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive 4D mask [1, 1, nodes, past + nodes]: 0 where a node may attend, -inf elsewhere."""
    n = len(tree.tokens)
    allowed = torch.zeros((n, past + n), dtype=torch.bool)
    allowed[:, :past] = True
    for i in range(n):
        if i:
            allowed[i, past:] = allowed[tree.parents[i], past:]
        allowed[i, past + i] = True
    mask = torch.zeros((n, past + n), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def tree_forward(model, tree: Tree, root_token: int, cache) -> torch.Tensor:
    """Logits [nodes, V] of one forward over the tree on top of `cache` (which grows by all nodes)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[root_token] + tree.tokens[1:]], dtype=torch.long, device=device)
    if tree.is_chain():  # a chain is causal: let the model build its usual mask
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
    past = cache.get_seq_length()
    pos = torch.tensor([[past + d for d in tree.depths]], dtype=torch.long, device=device)
    mask = tree_mask(tree, past, model.dtype, device)
    return model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                 use_cache=True).logits[0]


def keep_path(cache, past: int, path: Sequence[int]) -> None:
    """After a tree forward, keep the root and the accepted path's entries in the cache, in order.

    The cache holds `past` entries, then one per tree node. Path nodes that are already at their
    final place (the first candidate's chain) are not moved."""
    want = [0] + list(path)
    if want != list(range(len(want))):
        src = torch.tensor([past + i for i in want], dtype=torch.long)
        for layer in cache.layers:
            idx = src.to(layer.keys.device)
            layer.keys[..., past:past + len(want), :] = layer.keys.index_select(-2, idx)
            layer.values[..., past:past + len(want), :] = layer.values.index_select(-2, idx)
    remove = cache.get_seq_length() - (past + len(want))
    assert remove >= 0
    if remove:
        cache.crop(-remove)


def supports_trees(cache) -> bool:
    """Tree forwards need every cache layer to keep all positions (no sliding window)."""
    return all(not getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", []))

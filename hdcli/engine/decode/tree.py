"""Token trees: several drafted candidates merged by shared prefix and verified in one forward.

Node 0 is the root: the last token of the history (fed as the first input of every step, see
loop.py). Every other node is a drafted token whose parent is the node before it in its
candidate. Nodes are numbered in insertion order, so a parent always precedes its children and
the first candidate's tokens are nodes 1..len(c) -- when the first candidate wins, its KV entries
are already where a chain's would be and no cache entry has to move.

The forward over a tree feeds every node at once, at position (cache length + depth), with an
attention mask that lets a node see the whole cache, its ancestors and itself, nothing else. Each
node's logits are then the logits of its path run alone (tests/test_tree.py checks this).
Sliding-window layers (Gemma 2/3, Mistral) get their own mask: a node at position p sees only the
keys at positions > p - window, cached ones and its own ancestors alike, as it would in a chain,
where the cache asks for it (KVCache.sliding_windows, engine/model/target.py); models mixing both
kinds of layers take the two masks as a dict keyed by layer type, the form transformers' own mask
mapping has.

Cost cap. Each node gets an estimate of the probability that the target accepts it: along a
candidate, the product of its layer's per-token acceptance estimate; for the j-th child of a
node, times the chance that the children tried before it were rejected. A verification forward
over w tokens costs cost(w) (measured, hdcli/engine/decode/costs.py, one-token forward = 1). Keeping the k
likeliest nodes yields 1 + sum of their estimates tokens per step, so we keep the k that maximises
(1 + sum) / cost(1 + k), where a kept set that branches also pays the curve's measured branch cost
per row (its attention gathers each row's keys). k = 0 is plain decoding: a draft that is not
expected to pay for its forward is not sent.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .draft import bucket
from ..model.target import KVCache


class Tree:
    def __init__(self):
        self.tokens: list[int] = [-1]           # node -> token (root: filled in by the caller)
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.layers: list[str | None] = [None]  # layer of the candidate that created the node
        self.children: list[list[int]] = [[]]   # in insertion order = the order they are tried
        # the target's probability of the node's token after its parent, where the drafter knew it
        # (Draft.p: recorded from the target's own rows under sampling), else None
        self.probs: list[float | None] = [None]

    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def add(self, parent: int, token: int, layer: str | None, prob: float | None = None) -> int:
        for c in self.children[parent]:
            if self.tokens[c] == token:
                if self.probs[c] is None:
                    self.probs[c] = prob
                return c
        self.probs.append(prob)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.layers.append(layer)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def add_candidate(self, tokens: Sequence[int], layer: str | None,
                      probs: Sequence[float] | None = None) -> None:
        node = 0
        for j, t in enumerate(tokens):
            node = self.add(node, t, layer, None if probs is None else probs[j])

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
            new_of[i] = t.add(new_of[self.parents[i]], self.tokens[i], self.layers[i], self.probs[i])
        return t


Rate = Callable[[str | None, int, bool], float]  # (layer, depth, first child?) -> acceptance


def node_estimates(tree: Tree, rate: Rate) -> list[float]:
    """Estimated probability that each node is accepted (root: 1). A node whose probability the
    drafter knew (tree.probs, sampling) is accepted with it once its parent is: the target's token
    there is one draw, each child a different token, so children are kept in disjoint events
    (verify.accept_tree); it is bounded by what the earlier siblings left."""
    est = [1.0] * len(tree.tokens)
    probs = tree.probs
    for parent in range(len(tree.tokens)):
        left = est[parent]  # chance that the search reaches this child: parent reached, earlier siblings rejected
        for j, c in enumerate(tree.children[parent]):
            if probs[c] is None:
                est[c] = left * rate(tree.layers[c], tree.depths[c], j == 0)
            else:
                est[c] = min(left, est[parent] * probs[c])
            left = max(0.0, left - est[c])
    return est


def forward_cost(cost: Callable[[int], float], rows: int, streams: int = 1, branched_rows: int = 0) -> float:
    """cost(rows) plus what a measured CostCurve adds for trees that branch and for streams
    beyond the first (costs.CostCurve.forward); a plain callable prices rows only."""
    extra = getattr(cost, "forward", None)
    return cost(rows) if extra is None else extra(rows, streams, branched_rows)


def _best_chain(tree: Tree, est: Sequence[float]) -> list[int]:
    """The path from the root through the likeliest child of each node: the best draft that does
    not branch (a ranking's prefixes branch as soon as a sibling outranks a grandchild)."""
    path, node = [], 0
    while tree.children[node]:
        node = max(tree.children[node], key=lambda c: (est[c], -c))
        path.append(node)
    return path


def _best_prefix(trees: Sequence[Tree], order: Sequence[tuple[int, int]], ests, cost, base: float):
    """(value, k): the prefix of `order` ((stream, node) pairs, each stream's closed under parent)
    with the most tokens per unit of forward cost; k = 0 sends no draft."""
    n = len(trees)
    best, best_k, gain = base / forward_cost(cost, n, n), 0, base
    kids = [[0] * len(t.tokens) for t in trees]
    rows, branched = [1] * n, [False] * n
    for k, (s, i) in enumerate(order, start=1):
        gain += ests[s][i]
        rows[s] += 1
        parent = trees[s].parents[i]
        kids[s][parent] += 1
        branched[s] = branched[s] or kids[s][parent] > 1
        value = gain / forward_cost(cost, n + k, n, sum(r for r, b in zip(rows, branched) if b))
        if value > best:
            best, best_k = value, k
    return best, best_k


def cap_by_cost(tree: Tree, est: Sequence[float], cost: Callable[[int], float],
                max_nodes: int = 64) -> Tree:
    """Keep the k likeliest nodes maximising (1 + their summed estimates) / the forward's cost
    (cost(1 + k), plus the branch term once the kept nodes branch: forward_cost); or, where it is
    worth more, a prefix of the best chain alone.

    A child's estimate never exceeds its parent's and ties go to the lower index (the parent),
    so every prefix of the ranking is closed under parent and is a tree."""
    keep = _cap_one(tree, est, cost, max_nodes)
    return tree if len(keep) == len(tree.tokens) else tree.subtree(keep)


def _cap_one(tree: Tree, est: Sequence[float], cost: Callable[[int], float], max_nodes: int) -> list[int]:
    """cap_jointly for one stream (the decode loop's every step), without its per-stream lists:
    the same two rankings, the same value per prefix, the same choice (tests/test_tree.py checks
    the two agree)."""
    forward = getattr(cost, "forward", None)
    price = (lambda rows, branched: cost(rows)) if forward is None else (lambda rows, branched: forward(rows, 1, branched))
    parents = tree.parents
    everything = sorted((-est[i], i) for i in range(1, len(tree.tokens)))[:max_nodes]
    chain = sorted((-est[i], i) for i in _best_chain(tree, est))[:max_nodes]
    best, keep = None, []
    for order in (everything, chain):
        value, k, gain = 1.0 / price(1, 0), 0, 1.0
        kids = [0] * len(tree.tokens)
        branched = False
        for j, (_, i) in enumerate(order, start=1):
            gain += est[i]
            kids[parents[i]] += 1
            branched = branched or kids[parents[i]] > 1
            v = gain / price(1 + j, 1 + j if branched else 0)
            if v > value:
                value, k = v, j
        if best is None or value > best:
            best, keep = value, [i for _, i in order[:k]]
    return [0] + keep


def cap_jointly(trees: Sequence[Tree], ests: Sequence[Sequence[float]], cost: Callable[[int], float],
                max_rows: int) -> list[list[int]]:
    """Several streams verified in one forward (engine/decode/batch.py): keep the drafted nodes, over
    all trees, that maximise (streams + their summed estimates) / the forward's cost (rows,
    streams, and rows of trees that branch: forward_cost) -- the tokens per unit of time of the
    shared forward. Two rankings are tried, every drafted node and each tree's best chain alone,
    so that a chain is kept where the branch cost makes the branches not pay. A node one stream
    sends makes every stream's forward dearer, so trees shrink as streams are added.
    Returns per tree the kept node ids (root included), closed under parent."""
    n = len(trees)
    room = max(0, max_rows - n)
    everything = sorted((-e[i], s, i) for s, (t, e) in enumerate(zip(trees, ests)) for i in range(1, len(t.tokens)))
    chains = sorted((-ests[s][i], s, i) for s, t in enumerate(trees) for i in _best_chain(t, ests[s]))
    best = None
    for order in (everything[:room], chains[:room]):
        pairs = [(s, i) for _, s, i in order]
        value, k = _best_prefix(trees, pairs, ests, cost, float(n))
        if best is None or value > best[0]:
            best = (value, pairs[:k])
    keep = [[0] for _ in trees]
    for s, i in best[1]:
        keep[s].append(i)
    return keep


def build_tree(drafts, rate: Rate, cost: Callable[[int], float] | None,
               max_nodes: int = 63, branches: bool = True) -> Tree:
    """Merge candidates (drafting.Draft, best first) into a tree and keep what pays for its
    forward (cost None: everything up to max_nodes). branches False: the first candidate only."""
    tree = Tree()
    for d in drafts if branches else drafts[:1]:
        tree.add_candidate(d.tokens, d.layer, getattr(d, "p", None))
    if tree.size() and cost is not None:
        return cap_by_cost(tree, node_estimates(tree, rate), cost, max_nodes)
    if tree.size() > max_nodes:
        return tree.subtree(range(max_nodes + 1))
    return tree


def reached(tree: Tree, path: Sequence[int]) -> tuple[dict, dict]:
    """Drafted nodes the verification reached (parent kept) and nodes it kept, counted by
    (layer, bucket) where bucket is drafting.bucket(depth, first child?)."""
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


def _tree_part(tree: Tree) -> torch.Tensor:
    """[nodes, nodes] bool: node i sees its ancestors and itself."""
    n = len(tree.tokens)
    allowed = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        if i:
            allowed[i] = allowed[tree.parents[i]]
        allowed[i, i] = True
    return allowed


def _fill(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """-inf (the dtype's min) where not allowed, in place; [1, 1, rows, cols] view."""
    mask.masked_fill_(~allowed, torch.finfo(mask.dtype).min)
    return mask[None, None]


def tree_mask(tree: Tree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive 4D mask [1, 1, nodes, past + nodes]: 0 where a node may attend, -inf elsewhere.
    Built on the device: only the [nodes, nodes] tree part travels there, not the whole mask."""
    n = len(tree.tokens)
    mask = torch.zeros((n, past + n), dtype=dtype, device=device)
    _fill(mask[:, past:], _tree_part(tree).to(device))
    return mask[None, None]


def sliding_tree_mask(tree: Tree, past: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The mask of a sliding-window layer, [1, 1, nodes, c + nodes]: such a layer shows the last
    c = min(past, window - 1) cached keys (positions past - c .. past - 1), and a node at depth d
    (position past + d) may see cached key j (position past - c + j) only when j > c + d - window,
    and an ancestor at depth a only when a > d - window."""
    n, c = len(tree.tokens), min(past, window - 1)
    mask = torch.zeros((n, c + n), dtype=dtype, device=device)
    depths = torch.tensor(tree.depths, device=device)
    _fill(mask[:, :c], torch.arange(c, device=device)[None, :] >= (c + depths - window + 1)[:, None])
    # the window holds for the tree's own nodes too: a node at depth d >= window no longer sees
    # its ancestors at depth <= d - window (the root first), as in a chain
    in_window = (depths[:, None] - depths[None, :]) < window
    _fill(mask[:, c:], _tree_part(tree).to(device) & in_window)
    return mask[None, None]


def attention_mask(model, tree: Tree, past: int, cache: KVCache):
    """The mask (or the dict of masks by layer type) for a forward over `tree` on `cache`: the
    sliding-window mask for the layers whose window the cache asks the mask to apply."""
    full = tree_mask(tree, past, model.dtype, model.device)
    windows = cache.sliding_windows()
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return full
    sw = sliding_tree_mask(tree, past, sliding[0], model.dtype, model.device)
    if len(sliding) == len(windows):
        return sw
    return {"full_attention": full, "sliding_attention": sw}


def tree_rows(model, tree: Tree, root_token: int, cache) -> tuple:
    """One stream's part of a forward over `tree` on `cache`: (input_ids [1, nodes], cache,
    position_ids, mask), the last two None for a chain (causal: the model's usual mask)."""
    ids = torch.tensor([[root_token] + tree.tokens[1:]], dtype=torch.long, device=model.device)
    if tree.is_chain():
        return ids, cache, None, None
    past = cache.get_seq_length()
    pos = torch.tensor([[past + d for d in tree.depths]], dtype=torch.long, device=model.device)
    return ids, cache, pos, attention_mask(model, tree, past, cache)


def tree_forward(model, tree: Tree, root_token: int, cache) -> torch.Tensor:
    """Logits [nodes, V] of one forward over the tree on top of `cache` (which grows by all nodes);
    model: a TargetModel (engine/model/target.py)."""
    return model.forward(*tree_rows(model, tree, root_token, cache))


def keep_path(cache: KVCache, past: int, path: Sequence[int]) -> None:
    """After a forward over a tree (or chain) on a cache of `past` tokens, keep the root and the
    accepted path's entries in the cache, in order, and crop the rest (KVCache.keep_path). Path
    nodes already at their final place (the first candidate's chain) are not moved."""
    cache.keep_path(past, path)

"""The M-invariant mode's calibration and proof on one model and machine: each Linear's least row
count (kernels/invariant.py, min_rows_for), then a self-check through the forward itself (a chain and
a token tree, every row torch.equal to its one-token forward). Cached under HD_CACHE_DIR per model
key and attention (records.py); a model that fails stays out of the mode (NotInvariant).
"""
from __future__ import annotations

import torch

from .. import records
from ..kernels import fused, invariant
from .tree import Tree, tree_forward


@torch.inference_mode()
def compare_rows(model: torch.nn.Module, tree, prompt: list[int]) -> list[tuple[bool, float]]:
    """Verify `tree` (root prompt[-1]) in one forward after prompt[:-1] is cached, then run each
    leaf's path token by token on the same cache (a node's one-token row is the one its first
    walk gives: the cache then holds exactly its path; one walk a leaf, not one a node, keeps an
    8B model's check to a few dozen forwards). Per node: (its row torch.equal to the one-token
    forward of the node, the largest |difference|)."""
    device = model.device
    cache = model.new_cache()
    model.prefill(torch.tensor([prompt[:-1]], device=device), cache)   # as decoding reads a prompt: keys only, no logits
    base = cache.get_seq_length()
    rows = tree_forward(model, tree, prompt[-1], cache)
    ones: dict[int, torch.Tensor] = {}
    for leaf in [n for n in range(len(tree.tokens)) if not tree.children[n]]:
        cache.crop(-(cache.get_seq_length() - base))
        for node in [0] + tree.path(leaf):
            tok = prompt[-1] if node == 0 else tree.tokens[node]
            one = model.forward(torch.tensor([[tok]], device=device), cache)[-1]
            ones.setdefault(node, one)
    return [(torch.equal(ones[n], rows[n]), float((ones[n].float() - rows[n].float()).abs().max()))
            for n in range(len(tree.tokens))]


def covering_blocks(model) -> list[int]:
    """The blocks the self-check runs: the first, the last, and each block holding a kind of layer
    no block before it held (a Linear's shape, kernel and file type: Linear.shape_key; the
    attention's kind, full or sliding). Every block runs the same code on its kinds of layer, and
    an M-invariant row depends on the kernels' arithmetic, not on the weights' values: these
    blocks take every path the whole model takes, in 2-4 blocks where an 8B model has 32 (its
    first start's self-check that much shorter)."""
    from ..model.parts import Linear
    seen: set = set()
    chosen = []
    last = len(model.blocks) - 1
    for i, blk in enumerate(model.blocks):
        kinds = {m.shape_key() for m in blk.modules() if isinstance(m, Linear)} | {f"attention {blk.kind}"}
        if i in (0, last) or not kinds <= seen:
            chosen.append(i)
            seen |= kinds
    return chosen


HEAD_BLOCKS = 64   # a GGUF head's column blocks the self-check computes: 1024 logits a row


def self_check(model: torch.nn.Module, seed: int = 0) -> tuple[int, int]:
    """The mode's proof on this model and machine: after a cached prefix longer than a chunk (and
    than a small sliding window), a chain and a token tree are verified in one forward each; every
    row must equal (torch.equal) the one-token forward of its node after its path. Run on the
    model's covering blocks (covering_blocks; the embedding, the final norm and the head as they
    are, the head narrowed to HEAD_BLOCKS column blocks where it is a GGUF kernel). Returns
    (rows equal, rows). Only hd's own forward runs the mode, so the model always has subset."""
    model = model.subset(covering_blocks(model), head_blocks=HEAD_BLOCKS)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def rand(k):
        return torch.randint(3, vocab, (k,), generator=gen).tolist()
    trees = [Tree(), Tree()]
    trees[0].add_candidate(rand(5), "x")
    for _ in range(4):
        trees[1].add_candidate(rand(1) + rand(int(torch.randint(1, 4, (1,), generator=gen))), "x")
    trees[1].add_candidate(trees[1].tokens[1:2] + rand(2), "x")
    rows = [eq for tree, prefix in zip(trees, (invariant.CHUNK + 9, 2 * invariant.CHUNK + 3))
            for eq, _ in compare_rows(model, tree, rand(prefix))]
    return sum(rows), len(rows)


class NotInvariant(Exception):
    """The mode does not hold for this model here: a Linear shape no row padding up to 16 makes
    M-invariant, or the self-check found a row that differs."""


def _why_not(record: dict) -> str | None:
    """Why a calibration record says the mode does not hold (None: it holds, as far as measured)."""
    failed = [k for k, r in record["linear_min_rows"].items() if r is None]
    if failed:
        return f"no row padding up to 16 makes these Linear shapes M-invariant: {', '.join(failed)}"
    check = record.get("self_check")
    if check is not None and check[0] != check[1]:
        return f"self-check: {check[0]} of {check[1]} verified rows equal their one-token forward"
    return None


def holds(info: dict | None) -> bool:
    """Whether try_enable's answer put the model in the mode."""
    return bool(info) and "off" not in info


FORMAT = 1


def _path(key: str):
    return records.cache_file("invariant", key)


def _valid(d: dict) -> bool:
    """A calibration record's shape: {shape key: least rows (int >= 1) or None}, self_check None or
    [rows equal, rows]."""
    rows, check = d["linear_min_rows"], d.get("self_check")
    return (isinstance(rows, dict) and all(r is None or records.number(r, 1) and int(r) == r for r in rows.values())
            and (check is None or isinstance(check, list) and len(check) == 2
                 and all(records.number(c, 0) and int(c) == c for c in check)))


def _read(key: str | None) -> dict | None:
    """The cached calibration record ({"linear_min_rows", "self_check"}), or None."""
    data = None if key is None else records.read_record(_path(key), key, FORMAT, _valid, "the invariant calibration record")
    if data is None:
        return None
    return {"linear_min_rows": data["linear_min_rows"], "self_check": data.get("self_check")}


def _write(key: str | None, info: dict) -> None:
    if key is not None:
        records.write_json(_path(key), {"key": key, "format": FORMAT, **info})


def enable(model, cache_key: str | None = None) -> dict:
    """Put an owned forward (hdcli/engine/model/) in the M-invariant mode: each Linear's least
    row count calibrated per shape and kernel (Linear.min_rows; 1 where the kernel's per-row
    arithmetic is fixed, as hd's GGUF GEMMs' is: calibrated all the same, the check is what proves
    it), the invariant attention (Numerics.invariant), then the self-check through the forward
    itself. Calibration and check are cached under HD_CACHE_DIR when cache_key (costs.curve_key
    of the model) is given, and written only when measured. Returns what was measured; raises
    NotInvariant (the model is left out of the mode)."""
    cache_key = None if cache_key is None else f"{cache_key}|owned|attention:{fused.name()}"
    record = _read(cache_key)
    layers = model.linears()
    if record is not None and any(lin.shape_key() not in record["linear_min_rows"] for lin in layers):
        record = None   # calibrated for another model once at this path: calibrated again
    measured = record is None
    if measured:
        found: dict = {}
        for lin in layers:
            key = lin.shape_key()
            if key not in found:   # hd's GGUF GEMMs are M-invariant by construction (test_quants
                # proves it per type): a short probe of each M on 4 of its column blocks (each runs
                # the same code); dense kernels get the full one
                gguf = lin.kind == "gguf"
                found[key] = invariant.min_rows_for(lin.kernel.narrowed(4) if gguf else lin.kernel, lin.in_features, lin.dtype,
                                          rows_per_m=16 if gguf else 256)
        record = {"linear_min_rows": found, "self_check": None}
    why = _why_not(record)
    if why is None:
        rows = record["linear_min_rows"]
        for lin in layers:
            lin.min_rows = int(rows.get(lin.shape_key()) or 1)
        model.numerics.min_rows = dict(rows)
        model.numerics.invariant = True
        if record["self_check"] is None:
            record["self_check"], measured = list(self_check(model)), True
        why = _why_not(record)
    if measured:
        _write(cache_key, record)
    if why is not None:
        disable(model)
        raise NotInvariant(why)
    return {"attention": invariant.NAME, "chunk": invariant.CHUNK, "kernel": fused.name(), **record}


def disable(model) -> None:
    """An owned forward out of the mode: SDPA over the cache, Linear layers unpadded."""
    model.numerics.invariant = False
    model.numerics.min_rows = {}
    for lin in model.linears():
        lin.min_rows = 1


def try_enable(model, cache_key: str | None) -> dict:
    """enable(), or {"off": why} where the mode does not hold."""
    try:
        return enable(model, cache_key)
    except NotInvariant as exc:
        return {"off": str(exc)}

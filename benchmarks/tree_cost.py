"""What does one target forward cost against the number of tokens it verifies?

Times a forward over W new tokens (W = 1, 2, 4, ..., 64) on top of a ~300-token KV cache, as a
chain (causal) and as a tree (explicit 4D attention mask), relative to a one-token forward. This
curve is what caps the draft tree (hdcli/engine/decode/costs.py measures the same curve at run time).

    python benchmarks/tree_cost.py --dtype fp32 --out benchmarks/results/tree_cost_fp32.json
"""
from __future__ import annotations

import argparse
import json

import torch

from hdcli import api
from hdcli.engine.decode.tree import Tree, tree_forward

from common import machine, median_forward_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    lm = api.load_model(dtype=args.dtype)
    ctx = list(range(1000, 1000 + args.context))
    widths = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    rows = {}
    with torch.inference_mode():
        cache = lm.model.new_cache()
        lm.model.forward(torch.tensor([ctx]), cache)
        for w in widths:
            ids = [7 + i for i in range(w)]
            chain = median_forward_seconds(
                lambda: lm.model.forward(torch.tensor([ids]), cache), cache, args.repeats)
            # a bushy tree of the same width: the root and w - 1 drafted nodes, depth <= 4
            tree = Tree()
            j = 0
            while tree.size() < w - 1:
                tree.add_candidate([3 + j % 5, 20 + j, 40 + j, 60 + j], "x")
                j += 1
            tree = tree.subtree(range(w))
            nodes = tree.size() + 1
            tr = median_forward_seconds(lambda: tree_forward(lm.model, tree, 9, cache), cache, args.repeats)
            rows[w] = {"chain_seconds": chain, "tree_seconds": tr, "tree_nodes": nodes}
    one = rows[1]["chain_seconds"]
    print(f"{'width':>5} {'chain':>7} {'tree':>7}  (cost relative to a 1-token forward, {args.dtype})")
    for w, r in rows.items():
        r["chain_cost"], r["tree_cost"] = r["chain_seconds"] / one, r["tree_seconds"] / one
        print(f"{w:>5} {r['chain_cost']:7.2f} {r['tree_cost']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "context": args.context, "threads": torch.get_num_threads(),
                       "machine": machine(),
                       "one_token_seconds": one, "widths": rows}, f, indent=1)


if __name__ == "__main__":
    main()

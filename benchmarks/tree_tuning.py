"""Choose the tree defaults (policy, candidates C, draft length L) by replay.

Under greedy decoding the target keeps exactly the tree path that matches its own output, so a
tree can be scored against recorded plain outputs without running the model (replay.py explains
the idea): this replays every policy, C and L with the very tree builder and cost cap of the
decoder (hdcli.tree.build_tree), for the measured cost curves of fp32 and bf16
(benchmarks/results/tree_cost_*.json), on Spec-Bench questions (5 per category by default).

    python benchmarks/tree_tuning.py --stats-db stats.lmdb --model-db model.lmdb \
        --out benchmarks/results/tree_tuning.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hdcli import api, specbench
from hdcli.costs import CostCurve
from hdcli.drafting import Hierarchy
from hdcli.stores import Store
from hdcli.tree import build_tree, reached


def record(path: Path, limit: int, max_new_tokens: int, cache: Path) -> list:
    """(category, prompt ids, plain fp32 greedy output) per question; cached in a JSON file."""
    if cache.exists():
        return json.loads(cache.read_text())
    lm = api.load_model(dtype="fp32")
    refs = []
    for q in specbench.select(specbench.load(path), limit):
        ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
        out = api.generate(lm, prompt_ids=ids, max_new_tokens=max_new_tokens, drafter=None).tokens
        refs.append((q["category"], ids, out))
        print(f"recorded {len(refs)}", flush=True)
    cache.write_text(json.dumps(refs))
    return refs


def replay(refs, make: callable, cost: CostCurve) -> dict:
    spent = plain = steps = nodes = 0
    layers: dict[str, list[int]] = {}
    for _, prompt, ref in refs:
        hier, pos, h = make(), 0, list(prompt)
        hier.reset(h)
        while pos < len(ref):
            drafts = hier.propose(h, len(ref) - pos - 1)
            tree = build_tree(drafts, hier.rate, cost)
            path, node = [], 0
            while pos + len(path) < len(ref):
                nxt = next((c for c in tree.children[node] if tree.tokens[c] == ref[pos + len(path)]), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            tested, accepted = reached(tree, path)
            hier.observe(tested, accepted)
            for name in tree.layers[1:]:
                layers.setdefault(name, [0, 0])[0] += 1
            for i in path:
                layers[tree.layers[i]][1] += 1
            new = ref[pos:pos + len(path) + 1]
            spent += cost(1 + tree.size())
            nodes += tree.size()
            steps += 1
            pos += len(new)
            h += new
            hier.extend(new)
        plain += len(ref)
    return {"predicted_speedup": plain / spent, "mean_accepted": plain / steps,
            "mean_tree": nodes / steps,
            "layers": {k: {"drafted": v[0], "accepted": v[1]} for k, v in layers.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None)
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--stats-db", required=True)
    ap.add_argument("--model-db", required=True)
    ap.add_argument("--refs", default="/tmp/hd_tree_refs.json")
    ap.add_argument("--out")
    args = ap.parse_args()
    refs = record(specbench.find(args.data), args.limit, args.max_new_tokens, Path(args.refs))
    stats, model = Store(args.stats_db), Store(args.model_db)
    results_dir = Path(__file__).parent / "results"
    rows = []
    for dtype in ("fp32", "bf16"):
        data = json.loads((results_dir / f"tree_cost_{dtype}.json").read_text())
        cost = CostCurve({int(w): r["chain_cost"] for w, r in data["widths"].items()})
        for policy in Hierarchy.POLICIES:
            for C in (1, 2, 4, 8):
                for L in (8, 16):
                    def make():
                        return api.make_drafter(["context", "model", "stats"], draft_len=L,
                                                cheap_verify=cost.verifies_cheaply(),
                                                stats_dbs=[stats], model_db=model, policy=policy,
                                                candidates=C)
                    r = replay(refs, make, cost)
                    rows.append({"dtype": dtype, "policy": policy, "candidates": C, "draft_len": L, **r})
                    print(f"{dtype} {policy:9} C={C} L={L:2}: speedup {r['predicted_speedup']:.3f} "
                          f"accepted {r['mean_accepted']:.2f} tree {r['mean_tree']:.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

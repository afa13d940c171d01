"""Which model-DB index and which statistics DB draft best: replayed on recorded answers (issue 38).

Records plain greedy answers (the run's dtype, `--dtype auto`: the answers `hd bench` verifies) to
the first turns of Spec-Bench `--limit` questions per category and of the 30 user-like questions of
benchmarks/prompts/user_questions.jsonl, then replays drafters on them (common.py: replay, with the
decoder's tree builder and this machine's cost curve): the context DB alone, SuffixDecoding (the
peer, its global tree learning over the set), the context DB with the model layer as a suffix index
over the model DB's answers (drafting/model.py) or as its n-gram table, at several settings, and the
context DB with statistics DBs (several probability cut-offs, extra DBs given with --stats-db, e.g.
one built with --max-n 6 or from one category's corpus). The recycle layer needs the target's
forward and is not replayed (`hd bench spec-bench` measures it). Mean accepted tokens and the
predicted speedup are deterministic; the answers are cached in --refs (common.record).

    python benchmarks/tuning/hierarchy_replay.py --model-db model.lmdb --stats-db stats.lmdb \
        --stats-db stats_n6.lmdb --out benchmarks/results/model_db/replay.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hdcli import api
from hdcli.bench import specbench
from hdcli.db import stores
from hdcli.drafting import AnswerIndex, ModelLayer, ContextDB, Hierarchy, StatsLayer
from hdcli.drafting.suffix import SuffixDrafter, new_cache
from hdcli.engine.decode import costs

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))   # common.py, one folder up
from common import command_line, machine, record, replay, write_result  # noqa: E402

USER = BENCHMARKS / "prompts" / "user_questions.jsonl"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-db", required=True)
    ap.add_argument("--stats-db", action="append", default=[])
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--refs", type=Path, help="cache of the recorded answers (JSON)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = api.load_model(dtype="auto", quiet=True)
    cost = costs.curve_for(lm)
    mdb = stores.Store(args.model_db)
    answers = list(mdb.sequences())
    sdbs = {Path(p).name: stores.Store(p) for p in args.stats_db}
    sets = {"spec_bench": specbench.select(specbench.load(specbench.find(None)), args.limit),
            "user": specbench.load(USER)}
    hier = lambda *layers: Hierarchy(list(layers), policy="fill", max_candidates=4)

    # each variant: make() -> (a factory of fresh drafters, capped by cost?); indexes and the
    # peer's cache are made anew per replay, since they learn from the answers replayed
    def fixed(*layers):
        return lambda: ((lambda: hier(ContextDB(1, 4), *layers)), True)

    def with_answers(extra=(), subset=None, **kw):
        def make():
            index = AnswerIndex(answers[:subset], **kw)
            return (lambda: hier(ContextDB(1, 4), ModelLayer(index), *extra)), True
        return make

    def peer():
        cache = new_cache()
        return (lambda: SuffixDrafter(cache)), False   # sent whole, as vLLM does (hd bench too)

    variants = {"context": fixed(), "suffix (peer)": peer,
                "context + model (n-gram table)": fixed(StatsLayer(mdb, name="model", min_prob=0.1))}
    for p, f in ((0.1, 1.0), (0.1, 4.0), (0.05, 4.0), (0.3, 8.0)):
        variants[f"context + model (answers, p {p}, factor {f})"] = with_answers(min_token_prob=p, max_spec_factor=f)
    variants["context + model (answers, first quarter of the DB)"] = with_answers(subset=len(answers) // 4)
    for name, db in sdbs.items():
        for p in (0.05, 0.1, 0.2, 0.3):
            variants[f"context + stats ({name}, p {p})"] = fixed(StatsLayer(db, min_prob=p))
        variants[f"context + model (answers) + stats ({name})"] = with_answers([StatsLayer(db, min_prob=0.1)])
    rows = []
    for set_name, qs in sets.items():
        cache = args.refs and args.refs.with_name(f"{args.refs.stem}_{set_name}{args.refs.suffix}")
        refs = record([q["turns"][0] for q in qs], args.max_new_tokens, cache, lm=lm)
        cats = [q["category"] for q in qs]
        for label, make in variants.items():
            factory, capped = make()
            r = replay(refs, factory, cost, cap=capped)
            total = sum(v["accepted"] for v in r["layers"].values()) or 1
            # per category too: the same drafter setting replayed on one category's answers
            by_cat = {}
            for c in dict.fromkeys(cats):
                factory, capped = make()
                rc = replay([x for x, cc in zip(refs, cats) if cc == c], factory, cost, cap=capped)
                by_cat[c] = {"mean_accepted": rc["mean_accepted"], "predicted_speedup": rc["predicted_speedup"]}
            rows.append({"set": set_name, "drafter": label, **r, "categories": by_cat,
                         "share_of_accepted": {k: v["accepted"] / total for k, v in r["layers"].items()}})
            print(f"{set_name:10s} {label:54s} MAT {r['mean_accepted']:.2f} predicted {r['predicted_speedup']:.3f} "
                  + " ".join(f"{k} {v:.0%}" for k, v in rows[-1]["share_of_accepted"].items()), flush=True)
    write_result(args.out, {"command": command_line("tuning/hierarchy_replay.py", args), "machine": machine(),
                            "model": lm.name, "dtype": lm.dtype, "kernels": lm.kernels,
                            "model_db": {k: mdb.header.get(k) for k in ("sequences", "tokens", "prompts", "samples")},
                            "rows": rows})


if __name__ == "__main__":
    main()

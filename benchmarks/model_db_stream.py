"""The model DB over a stream of related requests: does its share of accepted tokens rise as it learns?

A stream of `--requests` related requests is decoded: `--stream template` (the default) is what an
app sends, one prompt template filled with different values (here: 40 small Python functions on a
list of numbers); `--stream FILE.jsonl` takes the last prompts of a file (e.g. GSM8K-style word
problems from the corpus's `gsm8k_train.jsonl`: related by topic only). The stream is by hd's default hierarchy with a model DB, greedy, in two arms run one
after the other on each request:
  learning  one index for the whole stream: each answer joins the model layer's index as it is
            written (what `hd serve` and a long-running process do; --learn also keeps it on disk);
  frozen    a fresh index per request (the DB as built, nothing learned);
  ngrams    the model layer as the DB's n-gram table (stats.StatsLayer, hd's model layer before the
            suffix index), learning as `--learn` does (api.learn after each request, into a copy);
and plain decoding, which both must equal token for token. Printed and saved: the model layer's
share of accepted tokens and the mean accepted tokens per window of `--window` requests.

    python benchmarks/model_db_stream.py --model-db model.lmdb --stats-db stats.lmdb \
        --out benchmarks/results/model_db/stream.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from hdcli import api
from hdcli.compose import build_drafter, open_dbs, warm_up
from hdcli.config import DecodingConfig
from hdcli.db.stores import Store
from hdcli.drafting import AnswerIndex, RecycledTable, StatsLayer

from common import command_line, machine, write_result


TEMPLATE = "Write a Python function that returns the {} of a list of numbers. Add a docstring and one example call."
TASKS = ["sum", "product", "largest value", "smallest value", "mean", "median", "range", "variance",
         "number of even values", "number of odd values", "sum of squares", "product of the positive values",
         "second largest value", "second smallest value", "number of negative values", "largest even value",
         "smallest odd value", "sum of absolute values", "mean of the positive values", "number of zeros",
         "sorted copy", "reversed copy", "unique values", "running totals", "differences between neighbours",
         "index of the largest value", "index of the smallest value", "first repeated value",
         "length of the longest increasing run", "number of distinct values", "most common value",
         "geometric mean", "harmonic mean", "standard deviation", "sum of cubes",
         "number of values above the mean", "largest gap between neighbours", "value closest to zero",
         "sum of the values at even positions", "average of the first and last value"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-db", required=True)
    ap.add_argument("--stats-db", action="append", default=[])
    ap.add_argument("--stream", default="template",
                    help="'template', or a jsonl with `prompt` whose last --requests prompts are the stream")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.stream == "template":
        stream = [TEMPLATE.format(what) for what in TASKS][:args.requests]
    else:
        lines = [json.loads(x) for x in Path(args.stream).read_text(encoding="utf-8").split("\n") if x.strip()]
        stream = [r["prompt"] for r in lines[-args.requests:]]
    cfg = DecodingConfig(model_db=args.model_db, stats_dbs=args.stats_db, max_new_tokens=args.max_new_tokens)
    lm = api.load_model_for(cfg, quiet=True)
    dbs = open_dbs(cfg, lm)
    warm_up(lm)
    ARMS = ("learning", "frozen", "ngrams")
    shared, tables = AnswerIndex(dbs.model.sequences()), {arm: RecycledTable() for arm in ARMS}
    copy = Path(tempfile.mkdtemp()) / "model.lmdb"
    shutil.copy(args.model_db, copy)
    ngram_db = Store(copy, writable=True)
    rows = []
    for i, text in enumerate(stream):
        ids = api.encode_prompt(lm.tokenizer, text)
        plain = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=None)
        row = {"request": i, "new_tokens": len(plain.tokens)}
        for arm in ARMS:
            index = shared if arm == "learning" else AnswerIndex(dbs.model.sequences())
            d = build_drafter(cfg, lm, dbs, recycle_table=tables[arm], answer_index=index)
            if arm == "ngrams":  # the same place in the hierarchy, the n-gram table instead
                at = next(j for j, layer in enumerate(d.layers) if layer.name == "model")
                d.layers[at] = StatsLayer(ngram_db, name="model", min_prob=0.1)
            got = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=d)
            if arm == "ngrams":
                api.learn(ngram_db, ids, got.tokens)
            acc = {k: v.accepted for k, v in got.stats.layers.items()}
            row[arm] = {"differs": got.tokens != plain.tokens, "steps": got.stats.steps,
                        "accepted": acc, "tokens_per_second": got.stats.tokens_per_second}
        rows.append(row)
        print(f"{i + 1}/{len(stream)}: model layer accepted " + ", ".join(
            f"{arm} {row[arm]['accepted'].get('model', 0)}" for arm in ARMS) + f" of {row['new_tokens']}", flush=True)
    windows = []
    for w in range(0, len(rows), args.window):
        part = rows[w:w + args.window]
        win = {"requests": f"{w + 1}-{w + len(part)}"}
        for arm in ARMS:
            drafted = sum(sum(r[arm]["accepted"].values()) for r in part)
            model = sum(r[arm]["accepted"].get("model", 0) for r in part)
            tokens, steps = sum(r["new_tokens"] for r in part), sum(r[arm]["steps"] for r in part)
            win[arm] = {"model_share_of_accepted": model / drafted if drafted else 0.0,
                        "mean_accepted_tokens": tokens / steps}
        windows.append(win)
        print(f"requests {win['requests']}: model share (MAT) " + ", ".join(
            f"{arm} {win[arm]['model_share_of_accepted']:.0%} ({win[arm]['mean_accepted_tokens']:.2f})" for arm in ARMS))
    differ = sum(r[a]["differs"] for r in rows for a in ARMS)
    print(f"answers unlike plain decoding: {differ}")
    write_result(args.out, {"command": command_line("model_db_stream.py", args), "machine": machine(),
                            "model": lm.name, "dtype": lm.dtype, "kernels": lm.kernels,
                            "model_db": dbs.model.header, "windows": windows, "differ_from_plain": differ,
                            "rows": rows})


if __name__ == "__main__":
    main()

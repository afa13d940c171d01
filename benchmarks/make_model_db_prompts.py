"""Prompts like users' for a model-DB build: user turns of ../shared/corpora (never Spec-Bench).

The mix of issue 38's model DB (docs/benchmarks.md, "The hierarchy, layer by layer"): 420 AlpacaEval
instructions (chat), 200 GSM8K problems, 150 GPTeacher code tasks, 100 Code Alpaca tasks, 100
GPTeacher role plays, and 100 "summarize this" prompts over long AlpacaEval answers, each source's
prompts shuffled with seed 0 and the sources interleaved. The last 40 GSM8K problems are left out:
they are benchmarks/model_db_stream.py's held-out stream. The corpora's files under CC BY-NC 4.0
(SOURCE.md) stay on your machine: only the model's own answers go into the DB.

    python benchmarks/make_model_db_prompts.py ../shared/corpora > prompts.jsonl
    hd build-model-db -o model.lmdb --prompts prompts.jsonl -n 192 --json
"""
import glob
import json
import random
import sys
from pathlib import Path

TAKE = {"alpaca_eval": 420, "gsm8k_train": 200, "gpteacher_codegen": 150, "codealpaca_2k": 100,
        "gpteacher_roleplay": 100}
SUMMARIES = 100
HELD_OUT_GSM8K = 40

corpora = sys.argv[1] if len(sys.argv) > 1 else "../shared/corpora"
rng = random.Random(0)
by_source: dict[str, dict[str, str]] = {}   # source -> prompt -> its answer in the corpus
for f in sorted(glob.glob(f"{corpora}/**/*.jsonl", recursive=True)):
    key = "alpaca_eval" if "alpaca_eval" in f else Path(f).stem
    with open(f, encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            by_source.setdefault(key, {}).setdefault(r["prompt"], r["text"])
held_out = set(list(by_source["gsm8k_train"])[-HELD_OUT_GSM8K:])
lists = {}
for key, n in TAKE.items():
    prompts = list(by_source[key])
    rng.shuffle(prompts)
    lists[key] = prompts[:n]
long_answers = [t for t in by_source["alpaca_eval"].values() if 120 < len(t.split()) < 400]
rng.shuffle(long_answers)
lists["summarize"] = ["Summarize the following text in a few sentences.\n\n" + t for t in long_answers[:SUMMARIES]]
sources = {k: iter(v) for k, v in lists.items()}
while sources:   # one of each source in turn: any prefix of the file is a mix
    for key in list(sources):
        p = next(sources[key], None)
        if p is None:
            del sources[key]
        elif p not in held_out:
            print(json.dumps({"prompt": p, "source": key}))

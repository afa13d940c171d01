"""Prompts for the model-DB benchmark build: user turns of ../shared/corpora (never Spec-Bench).

    python benchmarks/make_model_db_prompts.py > /tmp/mdb_prompts.jsonl
    hd build-model-db -o /tmp/model200k.lmdb --prompts /tmp/mdb_prompts.jsonl --num-prompts 1000 \
        --max-new-tokens 256 --batch-size 16 --json
"""
import glob
import json
import random
import sys

corpora = sys.argv[1] if len(sys.argv) > 1 else "../shared/corpora"
rows = []
for f in sorted(glob.glob(f"{corpora}/**/*.jsonl", recursive=True)):
    for line in open(f):
        p = json.loads(line).get("prompt", "")
        if 20 < len(p) < 1200:
            rows.append(p)
random.Random(0).shuffle(rows)
seen = set()
for p in rows:
    if p not in seen and len(seen) < 1200:
        seen.add(p)
        print(json.dumps({"prompt": p}))

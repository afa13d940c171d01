"""`hd serve`'s decode loop without HTTP: throughput of the same Spec-Bench requests served with
--max-batch 1 (one at a time) and wider, passes interleaved, in one process on one loaded model.

What serve_load.py measures through the server and the openai client, less the HTTP side and the
clients' timing: every request is queued at once, so the loop always has --max-batch of them to
step. Each pass is a fresh Server (fresh shared recycled predictions) on the same model.

    python benchmarks/scheduler_widths.py --stats-db stats.lmdb --widths 1,4 --repeats 2 \
        --out benchmarks/results/serve/scheduler_int4.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from hdcli import api
from hdcli.engine.text.prompts import encode_messages
from hdcli.engine.decode.request import Request
from hdcli.serve.server import Server
from hdcli.serve.scheduler import Job

from common import command_line, load_questions, machine, requests_from, write_result


def one_pass(cfg, lm, prompts, width: int, n: int) -> dict:
    server = Server(cfg, lm, port=0, max_batch=width)
    done: list[Job] = []
    for p in prompts:
        server.scheduler.submit(Job(Request(p, n),
                                    emit=lambda e: done.append(e[1]) if e[0] == "done" else None))
    t0 = time.perf_counter()
    server.scheduler.stop(drain=True)
    server.scheduler.run()          # drains the queue in this (the main) thread, then returns
    wall = time.perf_counter() - t0
    tokens = sum(len(j.stream.out) for j in done)
    return {"width": width, "tokens": tokens, "wall_seconds": round(wall, 3),
            "tokens_per_second": round(tokens / wall, 2),
            "decode_loop_seconds": {k: round(v, 3) for k, v in server.scheduler.times.items()},
            "answers": [j.stream.out for j in sorted(done, key=lambda j: int(j.id))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", default="int4")
    ap.add_argument("--stats-db", action="append", default=[])
    ap.add_argument("--data", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = api.DecodingConfig(model=args.model, dtype=args.dtype, kernels=args.kernels,
                             stats_dbs=args.stats_db, max_new_tokens=args.max_tokens)
    lm = api.load_model_for(cfg, quiet=True)
    questions = requests_from(load_questions(args.data), args.requests)
    prompts = [encode_messages(lm.tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in questions]
    widths = [int(x) for x in args.widths.split(",")]
    runs = []
    for _ in range(args.repeats):
        for w in widths:
            runs.append(one_pass(cfg, lm, prompts, w, args.max_tokens))
            print(f"width {w}: {runs[-1]['tokens_per_second']:.1f} tok/s, loop {runs[-1]['decode_loop_seconds']}",
                  flush=True)
    ref = runs[0]["answers"]
    summary = []
    for w in widths:
        mine = [r for r in runs if r["width"] == w]
        tps = sum(r["tokens"] for r in mine) / sum(r["wall_seconds"] for r in mine)
        summary.append({"width": w, "tokens_per_second": round(tps, 2),
                        "differ": sum(a != b for r in mine for a, b in zip(r["answers"], ref))})
    base = summary[0]["tokens_per_second"]
    for s in summary:
        s["vs_first_width"] = round(s["tokens_per_second"] / base, 3)
        print(f"width {s['width']}: {s['tokens_per_second']:.1f} tok/s, x{s['vs_first_width']:.2f}, "
              f"{s['differ']} answers unlike width {widths[0]}'s")
    for r in runs:
        r.pop("answers")
    doc = {"machine": machine(), "model": args.model, "dtype": lm.dtype, "kernels": lm.kernels,
           "invariant": bool(lm.invariant), "requests": len(prompts), "max_tokens": args.max_tokens,
           "summary": summary, "runs": runs,
           "command": command_line("scheduler_widths.py", args)}
    write_result(args.out, doc)


if __name__ == "__main__":
    main()

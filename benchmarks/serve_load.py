"""`hd serve` under load: throughput and latency at 1, 2, 4 and 8 concurrent clients, against the
same requests one at a time and against transformers' generate serving them one by one; whether
any answer changes under load; and acceptance over a stream of related requests with --learn,
before and after a restart.

    python benchmarks/serve_load.py --stats-db stats.lmdb --requests 16 -n 64 --out results.json

The server is `hd serve` as a user runs it, a process on a free loopback port, started afresh for
each level (so every level starts from the same drafting state: the recycled predictions are
shared by requests and would favour later levels); clients are threads of this process with the
official `openai` client. Levels run in the order given, --repeats times over (interleaved, so drift
hits all alike); a level's figures are the means over its passes. Requests are the first turns of Spec-Bench questions, one per
subcategory in file order.

  throughput   completion tokens of all requests / wall time of the level
  latency      per request, submit to last token (p50, p95)
  differ       answers unlike those of the one-at-a-time level (greedy: must be 0)
  hf-generate  transformers' generate on the stock model, the same prompts one by one, in this
               process while no server runs
  in-process   hd's Python API, the same prompts one by one in this process: what HTTP and the
               scheduler cost a token, and whether the server's answers are `hd generate`'s
  learning     (--learn-stream) a stream of related requests (each question asked twice, then all
               again after a restart of the server on the same model DB): the model layer's
               acceptance on the first and second half, and after the restart
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_questions, machine, requests_from  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.bench.baselines import hf_generate, stock_model  # noqa: E402


class Running:
    """`hd serve` in a process of its own on a free loopback port."""

    def __init__(self, args: list[str]):
        from hdcli.serve.spawn import spawn
        try:
            self.proc, self.url, self.log = spawn(args)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        import openai
        self.name = openai.OpenAI(base_url=self.url, api_key="none").models.list().data[0].id

    def stop(self) -> dict:
        import signal
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=300)
        return json.loads(out) if out.strip() else {}


_CLIENTS: dict = {}


def client_for(url: str):
    """One openai client per server, shared by the client threads (it is thread-safe and pools
    connections), as an application keeps one: building one took 17 ms of CPU (its TLS context),
    which per request ran on the server's 2 cores."""
    import openai
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    return _CLIENTS[url]


def ask(url: str, name: str, prompt: str, n: int) -> dict:
    client = client_for(url)
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=n, temperature=0)
    hd = r.usage.model_extra["hd"]
    return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
            "seconds": time.perf_counter() - t0, "steps": hd["steps"], "layers": hd["layers"]}


def level(url: str, name: str, prompts: list[str], n: int, clients: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda p: ask(url, name, p, n), prompts))
    wall = time.perf_counter() - t0
    lat = sorted(a["seconds"] for a in answers)
    tokens = sum(a["tokens"] for a in answers)
    steps = sum(a["steps"] for a in answers)
    return {"clients": clients, "requests": len(prompts), "tokens": tokens, "wall_seconds": wall,
            "tokens_per_second": tokens / wall, "latency_p50": statistics.median(lat),
            "latency_p95": lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))],
            "mean_accepted_tokens": tokens / steps if steps else None, "answers": [a["text"] for a in answers]}


def model_acceptance(answers: list[dict]) -> float | None:
    d = sum(a["layers"].get("model", {}).get("drafted", 0) for a in answers)
    a = sum(a["layers"].get("model", {}).get("accepted", 0) for a in answers)
    return a / d if d else None


def learn_stream(server_args: list[str], lm, prompts: list[str], n: int) -> dict:
    """Each prompt twice, in a stream, then all again after a restart, learning into a fresh
    model DB (seeded with one unrelated generation)."""
    from hdcli.db import modeldb
    tmp = Path(tempfile.mkdtemp())
    modeldb.sample(lm, ["Say hello."], tmp / "seed.jsonl", max_new_tokens=8, temperature=0.0, batch_size=1)
    modeldb.index(tmp / "seed.jsonl", tmp / "model.lmdb", lm.tokenizer, lm.name, min_count=1)
    args = server_args + ["--model-db", str(tmp / "model.lmdb"), "--learn"]
    stream = prompts + prompts
    r = Running(args)
    try:
        answers = [ask(r.url, r.name, p, n) for p in stream]
    finally:
        learned = r.stop().get("learned_generations")
    r = Running(args)
    try:
        after = [ask(r.url, r.name, p, n) for p in prompts]
    finally:
        r.stop()
    half = len(stream) // 2

    def mean_acc(a):
        return sum(x["tokens"] for x in a) / sum(x["steps"] for x in a)
    return {"requests": len(stream), "learned_generations": learned,
            "mean_accepted_first_half": mean_acc(answers[:half]),
            "mean_accepted_second_half": mean_acc(answers[half:]),
            "mean_accepted_after_restart": mean_acc(after),
            "model_acceptance_first_half": model_acceptance(answers[:half]),
            "model_acceptance_second_half": model_acceptance(answers[half:]),
            "model_acceptance_after_restart": model_acceptance(after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--stats-db", action="append", default=[])
    ap.add_argument("--data", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2, help="Passes over the levels (interleaved).")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--learn-stream", type=int, default=0, help="Prompts in the learning stream (0: skip).")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-hf", action="store_true",
                    help="Skip transformers' generate (a large GGUF: it dequantizes the whole model to fp32).")
    args = ap.parse_args()
    questions = requests_from(load_questions(args.data), args.requests)
    prompts = [q["turns"][0] for q in questions]
    server_args = ["--model", args.model, "--dtype", args.dtype, "--kernels", args.kernels, "--json",
                   "--max-batch", str(args.max_batch), "-n", str(args.max_tokens)]
    for db in args.stats_db:
        server_args += ["--stats-db", db]
    levels = [int(x) for x in args.levels.split(",")]
    results, served = [], {}
    for c in levels * args.repeats:
        print(f"level {c} clients ...", file=sys.stderr)
        r = Running(server_args)
        try:
            ask(r.url, r.name, "Say hello.", 8)  # warm
            results.append(level(r.url, r.name, prompts, args.max_tokens, c))
        finally:
            served = r.stop()
        results[-1]["decode_loop_seconds"] = served.get("decode_loop_seconds")
        print(f"  {results[-1]['tokens_per_second']:.1f} tok/s, decode loop {served.get('decode_loop_seconds')}",
              file=sys.stderr)
    name = r.name
    ref = results[0]["answers"]
    # the same requests through the Python API in this process, one after another, with the
    # server's dtype, kernels and drafting (recycled predictions shared, as in the server): what
    # the server's HTTP and scheduling cost, and whether its answers are hd generate's
    from hdcli import compose
    from hdcli.drafting import RecycledTable
    cfg = api.DecodingConfig(model=args.model, dtype=served["dtype"], kernels=served["kernels"],
                             stats_dbs=args.stats_db, max_new_tokens=args.max_tokens)
    run = api.prepare(cfg)
    compose.warm_up(run.lm)
    table = RecycledTable()
    t0, tokens, texts = time.perf_counter(), 0, []
    for p in prompts:
        res = api.generate(run.lm, p, config=cfg, drafter=compose.build_drafter(cfg, run.lm, run.dbs,
                                                                                 recycle_table=table))
        tokens += len(res.tokens)
        texts.append(res.text)
    inproc = {"tokens": tokens, "wall_seconds": time.perf_counter() - t0,
              "differ_from_server": sum(a != b for a, b in zip(texts, ref))}
    inproc["tokens_per_second"] = tokens / inproc["wall_seconds"]
    del run
    for res in results:
        res["differ"] = sum(a != b for a, b in zip(res.pop("answers"), ref))
    hf = {"tokens_per_second": float("nan"), "skipped": "--no-hf"}
    if not args.no_hf:
        lm = api.load_model(args.model, dtype=served.get("dtype", "auto"), kernels="torch", quiet=True,
                            invariant="off")
        # transformers' generate on the stock model, one request after another
        stock = stock_model(lm)   # transformers' forward and kernels, in the dtype the server used
        from hdcli.engine.text.prompts import encode_messages
        ids = [encode_messages(lm.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        hf_generate(stock, ids[0], 4)
        t0, tokens = time.perf_counter(), 0
        for i in ids:
            tokens += len(hf_generate(stock, i, args.max_tokens)[0])
        hf = {"tokens": tokens, "wall_seconds": time.perf_counter() - t0}
        hf["tokens_per_second"] = tokens / hf["wall_seconds"]
    runs = results
    results = []
    for c in levels:   # per level: the mean over its passes (each pass's row kept in "runs")
        mine = [x for x in runs if x["clients"] == c]
        row = {k: statistics.mean(x[k] for x in mine) for k in
               ("tokens_per_second", "latency_p50", "latency_p95", "mean_accepted_tokens")}
        row.update(clients=c, passes=len(mine), differ=sum(x["differ"] for x in mine),
                   tokens_per_second_each=[round(x["tokens_per_second"], 1) for x in mine])
        results.append(row)
    one = results[0]["tokens_per_second"]
    inproc["server_ms_per_token"] = 1e3 * (1 / one - 1 / inproc["tokens_per_second"])
    for res in results:
        res["vs_one_at_a_time"] = res["tokens_per_second"] / one
        res["vs_hf_generate"] = res["tokens_per_second"] / hf["tokens_per_second"]
    out = {"machine": machine(), "model": name, "server": served, "stats_dbs": args.stats_db,
           "requests": len(prompts), "max_tokens": args.max_tokens, "max_batch": args.max_batch,
           "levels": results, "runs": runs, "hf_generate": hf, "in_process": inproc,
           "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])}
    if args.learn_stream:
        out["learning"] = learn_stream(server_args, lm, prompts[: args.learn_stream], args.max_tokens)
    print(f"{'clients':>8} {'tok/s':>8} {'x one':>6} {'x hf':>6} {'p50 s':>7} {'p95 s':>7} {'acc':>5} {'differ':>6}")
    for res in results:
        print(f"{res['clients']:>8} {res['tokens_per_second']:>8.1f} {res['vs_one_at_a_time']:>6.2f} "
              f"{res['vs_hf_generate']:>6.2f} {res['latency_p50']:>7.2f} {res['latency_p95']:>7.2f} "
              f"{res['mean_accepted_tokens']:>5.2f} {res['differ']:>6}  {res['tokens_per_second_each']}")
    print(f"hf-generate one by one: {hf['tokens_per_second']:.1f} tok/s   (CPU: {out['machine']['cpu']})")
    print(f"hd in-process one by one: {inproc['tokens_per_second']:.1f} tok/s, {inproc['differ_from_server']} "
          f"answers unlike the server's; the server costs {inproc['server_ms_per_token']:.1f} ms a token more")
    if "learning" in out:
        print("learning:", json.dumps(out["learning"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

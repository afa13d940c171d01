"""`hd serve --prefix-cache-mb`: what the prefix cache saves, through the server as a user runs it.

    python benchmarks/prefix_cache.py --repeats 2 --out benchmarks/results/prefix_cache/bundled.json

Two workloads, each on a fresh `hd serve` process with the cache (--prefix-cache-mb 256) and
without (0), the two alternating, --repeats times:

  turn2    chats of two turns over a ~1,000-token history (a system prompt of reference text
           that differs per chat, and a question), one chat at a time: the second turn's prefill
           seconds (usage.hd.prefill_seconds, measured in the decode loop) and its latency,
           with and without the cache; the answers of both turns must be identical
  shared   4 clients at once, each asking distinct short questions under one shared
           ~1,000-token system prompt (max_tokens 64, greedy): completion tokens / wall seconds
           and requests / wall seconds, the first (cold) request included; answers identical

Each server answers one short warm-up request first. Greedy, the server's default drafting.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the first thing mentioned above?", "Summarise the reference in one sentence.",
             "Which programming language appears most often?", "Name one function defined above.",
             "What would you improve in the first answer?", "Is there anything about testing?",
             "Give a title for this material.", "What does the second answer explain?",
             "List three keywords from the text.", "Who is the intended reader?",
             "What is the tone of these answers?", "Which answer is the longest?",
             "Write a haiku about the reference.", "What error handling is shown?",
             "Translate the first sentence into French.", "What is missing from the material?"]


def reference_text(start: int, chars: int) -> str:
    """Assistant answers from sample_corpora, from the start-th on, up to `chars` characters."""
    rows = [json.loads(line) for line in open(ROOT / "sample_corpora" / "assistant_answers.jsonl")]
    out, i = "", start
    while len(out) < chars:
        r = rows[i % len(rows)]
        out += f"Q: {r['prompt']}\nA: {r['text']}\n\n"
        i += 1
    return out[:chars]


def system_prompt(start: int, chars: int) -> str:
    return ("You are a helpful assistant. Answer briefly, using the reference material below.\n\n"
            + reference_text(start, chars))


class Running:
    def __init__(self, args: list[str]):
        from hdcli.serve.spawn import spawn
        self.proc, self.url, self.log = spawn(args)
        import openai
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=600)
        self.name = self.client.models.list().data[0].id

    def ask(self, messages, n: int) -> dict:
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.name, messages=messages, max_tokens=n, temperature=0)
        hd = r.usage.model_extra["hd"]
        return {"text": r.choices[0].message.content, "seconds": time.perf_counter() - t0,
                "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                "prefill_seconds": hd.get("prefill_seconds")}

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=300)
        return json.loads(out) if out.strip() else {}


def turn2(r: Running, chats: int, chars: int, n: int) -> list[dict]:
    out = []
    for i in range(chats):
        msgs = [{"role": "system", "content": system_prompt(7 * i, chars)},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        one = r.ask(msgs, n)
        msgs += [{"role": "assistant", "content": one["text"]},
                 {"role": "user", "content": QUESTIONS[(i + 5) % len(QUESTIONS)]}]
        two = r.ask(msgs, n)
        out.append({"turn1": one, "turn2": two})
    return out


def shared(r: Running, clients: int, per_client: int, chars: int, n: int) -> dict:
    system = system_prompt(100, chars)

    def client(c: int) -> list[dict]:
        return [r.ask([{"role": "system", "content": system},
                       {"role": "user", "content": QUESTIONS[(c * per_client + k) % len(QUESTIONS)]}], n)
                for k in range(per_client)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for per in pool.map(client, range(clients)) for a in per]
    wall = time.perf_counter() - t0
    tokens = sum(a["completion_tokens"] for a in answers)
    return {"clients": clients, "requests": len(answers), "wall_seconds": wall, "completion_tokens": tokens,
            "tokens_per_second": tokens / wall, "requests_per_second": len(answers) / wall,
            "prompt_tokens_mean": statistics.mean(a["prompt_tokens"] for a in answers),
            "cached_tokens": [a["cached_tokens"] for a in answers],
            "prefill_seconds": [a["prefill_seconds"] for a in answers],
            "latency_p50": statistics.median(a["seconds"] for a in answers), "answers": [a["text"] for a in answers]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--chars", type=int, default=3600, help="Characters of reference text (~1,000 tokens).")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-client", type=int, default=4)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["turn2", "shared"], default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    base = ["--model", args.model, "--dtype", args.dtype, "--kernels", args.kernels, "--json"]
    runs = {"turn2": {0: [], args.cache_mb: []}, "shared": {0: [], args.cache_mb: []}}
    served = {}
    for rep in range(args.repeats):
        for work in [w for w in ("turn2", "shared") if args.only in (None, w)]:
            for mb in ((0, args.cache_mb) if rep % 2 == 0 else (args.cache_mb, 0)):
                print(f"pass {rep + 1}: {work}, --prefix-cache-mb {mb} ...", file=sys.stderr)
                r = Running(base + ["--prefix-cache-mb", str(mb)])
                try:
                    r.ask([{"role": "user", "content": "Say hello."}], 8)
                    load = os.getloadavg()[0]
                    if work == "turn2":
                        res = {"chats": turn2(r, args.chats, args.chars, args.max_tokens)}
                    else:
                        res = shared(r, args.clients, args.per_client, args.chars, args.max_tokens)
                    res["load_before"] = load
                finally:
                    served = r.stop()
                res["prefix_cache"] = served.get("prefix_cache")
                res["decode_loop_seconds"] = served.get("decode_loop_seconds")
                runs[work][mb].append(res)
    on, off = args.cache_mb, 0
    report = {"machine": machine(), "model": served.get("source"), "dtype": served.get("dtype"),
              "kernels": served.get("kernels"), "invariant": served.get("invariant"), "args": vars(args) | {"out": str(args.out)}}
    if runs["turn2"][on]:
        def t2(mb, key):
            return [c["turn2"][key] for res in runs["turn2"][mb] for c in res["chats"]]
        pre_on, pre_off = statistics.mean(t2(on, "prefill_seconds")), statistics.mean(t2(off, "prefill_seconds"))
        texts = {mb: [(c["turn1"]["text"], c["turn2"]["text"]) for res in runs["turn2"][mb] for c in res["chats"]]
                 for mb in (on, off)}
        report["turn2"] = {
            "prompt_tokens_mean": statistics.mean(t2(on, "prompt_tokens")),
            "cached_tokens_mean": statistics.mean(t2(on, "cached_tokens")),
            "prefill_seconds_cached": pre_on, "prefill_seconds_uncached": pre_off,
            "prefill_share": pre_on / pre_off,
            "prefill_seconds_cached_median": statistics.median(t2(on, "prefill_seconds")),
            "prefill_seconds_uncached_median": statistics.median(t2(off, "prefill_seconds")),
            "latency_cached": statistics.mean(t2(on, "seconds")), "latency_uncached": statistics.mean(t2(off, "seconds")),
            "answers_differ": sum(a != b for a, b in zip(texts[on], texts[off])),
            "runs": {str(mb): runs["turn2"][mb] for mb in (on, off)}}
        print(f"turn 2: prefill {pre_off * 1000:.1f} -> {pre_on * 1000:.1f} ms ({100 * pre_on / pre_off:.1f}%), "
              f"{report['turn2']['answers_differ']} answers differ", file=sys.stderr)
    if runs["shared"][on]:
        tps = {mb: [res["tokens_per_second"] for res in runs["shared"][mb]] for mb in (on, off)}
        rps = {mb: [res["requests_per_second"] for res in runs["shared"][mb]] for mb in (on, off)}
        differ = sum(a != b for x, y in zip(runs["shared"][on], runs["shared"][off])
                     for a, b in zip(x["answers"], y["answers"]))
        report["shared"] = {"tokens_per_second_cached": tps[on], "tokens_per_second_uncached": tps[off],
                            "requests_per_second_cached": rps[on], "requests_per_second_uncached": rps[off],
                            "speedup_tokens": statistics.mean(tps[on]) / statistics.mean(tps[off]),
                            "speedup_requests": statistics.mean(rps[on]) / statistics.mean(rps[off]),
                            "answers_differ": differ, "runs": {str(mb): runs["shared"][mb] for mb in (on, off)}}
        print(f"shared prompt, {args.clients} clients: {statistics.mean(tps[off]):.1f} -> "
              f"{statistics.mean(tps[on]):.1f} tok/s ({report['shared']['speedup_tokens']:.2f}x), "
              f"{differ} answers differ", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Projected speed of exact hd at real model sizes: acceptance recorded on the bundled model, forward
time measured on GGUFs of published shapes (random weights, written by synth_gguf.py).

    python benchmarks/projection.py --limit 10 --stats-db /tmp/stats.lmdb --models \
        /tmp/hd-synth-gguf/smollm2-1.7b-Q4_0.gguf /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf \
        /tmp/hd-synth-gguf/llama-3.1-8b-Q4_0.gguf /tmp/hd-synth-gguf/llama-3.1-8b-Q4_K_M.gguf \
        --out benchmarks/results/gguf/projection.json

Why: acceptance needs real weights, which only the bundled 135M model has here; forward time needs
the size, which the random-weight files have. Record: exact hd (`hd bench spec-bench`'s method
`hd`), greedy, on the first turn of Spec-Bench questions (--limit per category) and of a few corpus
records; at every step the UNCAPPED tree (up to --max-nodes) with its node estimates is verified
whole, and the accepted path kept (lossless: the output is plain greedy decoding's, checked).
Replay per model: cap each recorded tree with that model's own cost curve, as its decoder would;
the accepted length is the recorded path's kept prefix + 1. Every k-th step (--replay-steps in
all) the forward over the capped tree and a one-token forward are timed at the recorded cache
length (random context). Projected tok/s = accepted tokens / (those forwards' seconds + the
capped decoder's measured seconds a step outside the forward); its speed-up over the replayed
one-token forwards (one instrument) times hd's measured plain speed is the calibrated projection
compared with llama.cpp. It assumes the large model accepts as the small one does, so every such
figure is labelled "projection". Measured beside it: the bundled model's real
hd and plain speed (interleaved; its own replay checks the method), and per model hd's and
llama.cpp's plain decoding of --plain-tokens tokens (llama.cpp closed before the next curve is timed).
All tokens/s here exclude prefill.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import command_line, interleaved, load_questions, machine, write_result  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.bench import llamacpp, specbench  # noqa: E402
from hdcli.bench.runner import method_config  # noqa: E402
from hdcli.compose import build_drafter, open_dbs, warm_up  # noqa: E402
from hdcli.config import DecodingConfig  # noqa: E402
from hdcli.drafting import RecycledTable  # noqa: E402
from hdcli.engine import records  # noqa: E402
from hdcli.engine.decode import costs  # noqa: E402
from hdcli.engine.decode.loop import Decoder, first_difference  # noqa: E402
from hdcli.engine.text.prompts import encode_messages, encode_prompt  # noqa: E402
from hdcli.engine.decode.tree import Tree, cap_jointly, tree_forward  # noqa: E402

SYNTH = Path("/tmp/hd-synth-gguf")
DEFAULT_MODELS = [str(SYNTH / f"{s}-{m}.gguf") for s in ("smollm2-1.7b", "llama-3.1-8b") for m in ("Q4_0", "Q4_K_M")]
CORPORA = ("gsm8k_train.jsonl", "gpteacher_codegen.jsonl", "codealpaca_2k.jsonl", "gpteacher_roleplay.jsonl")
PLAIN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MARGIN = 64   # prefilled beyond the longest replayed context: no cache growth inside a timed forward


def log(msg: str) -> None:
    print(f"[projection {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(args) -> list[dict]:
    """Spec-Bench first turns (--limit per category), then the first --corpus-prompts user turns of
    each corpus file (they may be in the statistics DB's corpus: reported apart by `source`)."""
    qs = specbench.select(load_questions(), args.limit)
    out = [{"source": "spec_bench", "category": q["category"], "id": q["question_id"], "text": q["turns"][0]}
           for q in qs]
    folder = HERE.parent.parent / "shared" / "corpora"
    for name in CORPORA if args.corpus_prompts > 0 else ():
        with open(folder / name, encoding="utf-8") as f:
            for line, _ in zip(f, range(args.corpus_prompts)):
                r = json.loads(line)
                out.append({"source": "corpus", "category": r["source"], "id": r["id"], "text": r["prompt"]})
    return out


def record(lm, drafter, ids: list[int], new_tokens: int, max_nodes: int) -> tuple[list[int], list[dict]]:
    """Exact hd with every step's whole uncapped tree verified: (output, steps)."""
    s = Decoder(lm.model, lm.eos_ids, drafter, max_nodes=max_nodes).stream(ids, max_new_tokens=new_tokens)
    steps = []
    with torch.inference_mode():
        while not s.done:
            past, root = len(s.history) - 1, s.history[-1]      # the cache holds history[:-1]
            spent = s.stats.draft_seconds + s.stats.bookkeeping_seconds
            tree = s.propose(capped=False)
            est = list(s.estimates) if tree.size() else [1.0]
            new = s.accept(tree_forward(lm.model, tree, root, s.cache))
            path, node = [], 0   # the accepted nodes: children matching the new tokens in turn
            for t in new:
                node = next((c for c in tree.children[node] if tree.tokens[c] == t), None)
                if node is None:
                    break
                path.append(node)
            steps.append({"past": past, "root": root, "tree": tree, "est": est, "path": path,
                          "overhead": s.stats.draft_seconds + s.stats.bookkeeping_seconds - spent})
    return s.result().tokens, steps


def cap(step: dict, curve, max_nodes: int) -> tuple[list[int], int]:
    """(kept node ids, accepted length) when `curve` caps the step's tree as the decoder would
    (cap_by_cost, whose subtree renumbers the nodes: cap_jointly keeps the original ids)."""
    keep = cap_jointly([step["tree"]], [step["est"]], curve, max_nodes + 1)[0]
    kept, acc = set(keep), 1
    for n in step["path"]:
        if n not in kept:
            break
        acc += 1
    return keep, acc


def cap_summary(steps: list[dict], curve, max_nodes: int) -> dict:
    """Widths (kept nodes + the root) the cap picks over all recorded steps, and accepted lengths."""
    widths, accs = zip(*((len(k), a) for k, a in (cap(s, curve, max_nodes) for s in steps)))
    return {"histogram": dict(sorted(Counter(widths).items())), "mean_width": statistics.mean(widths),
            "median_width": statistics.median(widths), "mean_accepted_projection": statistics.mean(accs)}


@torch.inference_mode()
def replay(lm, steps: list[dict], curve, args, overhead: float) -> dict:
    """Time every k-th step's capped tree and a one-token forward on lm at the step's cache length."""
    m, vocab = lm.model, lm.model.config.vocab_size
    every = max(1, math.ceil(len(steps) / args.replay_steps))
    sample = sorted(steps[::every], key=lambda s: -s["past"])   # descending: each crop only shortens
    cache = m.new_cache()
    ctx = torch.randint(0, vocab, (1, sample[0]["past"] + MARGIN), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    if hasattr(m, "prefill"):   # hd's own forward: keys and values only
        m.prefill(ctx, cache)
    else:
        m.forward(ctx, cache)
    log(f"  prefilled {ctx.shape[1]} tokens in {time.perf_counter() - t0:.1f}s; replaying {len(sample)} steps")

    def timed(tree: Tree, root: int, past: int) -> float:
        cache.crop(past)
        t = time.perf_counter()
        tree_forward(m, tree, root % vocab, cache)
        t = time.perf_counter() - t
        cache.crop(past)
        return t

    rows = []
    for i, s in enumerate(sample):
        keep, acc = cap(s, curve, args.max_nodes)
        tree = s["tree"].subtree(keep)   # a copy: its token ids are made valid for this vocabulary
        tree.tokens = [t % vocab for t in tree.tokens]
        if i == 0:   # the first forwards of a shape set kernels up: not timed
            for t in (tree, Tree()):
                timed(t, s["root"], s["past"])
        # alternate which forward goes first, so neither always runs on a cache the other warmed
        first, second = (timed(t, s["root"], s["past"]) for t in ((tree, Tree()) if i % 2 == 0 else (Tree(), tree)))
        a, one = (first, second) if i % 2 == 0 else (second, first)
        rows.append((len(keep), acc, a, one, overhead))
    width, acc, fwd, one, over = (list(c) for c in zip(*rows))
    hd = sum(acc) / (sum(fwd) + sum(over))
    plain = 1 / statistics.mean(one)
    return {"steps": len(rows), "every": every, "mean_width": statistics.mean(width),
            "mean_accepted_projection": statistics.mean(acc), "forward_seconds": sum(fwd),
            "overhead_seconds": sum(over),
            "one_token_ms": 1000 * statistics.mean(one), "max_past": sample[0]["past"],
            "projection": {"hd_tokens_per_second": hd, "plain_tokens_per_second": plain,
                           "speedup": hd / plain}}


@torch.inference_mode()
def hd_plain(lm, n: int) -> float:
    """hd's plain decoding of n tokens, prefill excluded (no EOS: random weights may emit one)."""
    ids, dec = encode_prompt(lm.tokenizer, PLAIN_PROMPT), Decoder(lm.model, ())
    dec.generate(ids, max_new_tokens=2)   # its first call is not timed
    st = dec.generate(ids, max_new_tokens=n).stats
    return st.new_tokens / (st.wall_seconds - st.prefill_seconds)


def llama_plain(lm, n: int) -> dict:
    """llama.cpp's plain greedy decoding on the same file, same prompt ids, threads as torch's:
    (n - 1) tokens over the time from the first new token to the n-th (prefill excluded)."""
    if not llamacpp.available():
        return {"error": f"llama-cpp-python not installed: {llamacpp.INSTALL}"}
    ll = llamacpp.LlamaCppModel(lm)
    ids = encode_prompt(lm.tokenizer, PLAIN_PROMPT)
    for count in (2, n):   # the first run is not timed
        stamps = []
        ll.llm.reset()
        for _ in ll.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) >= count:
                break
    out = {**ll.settings(), "tokens_per_second": (n - 1) / (stamps[-1] - stamps[0])}
    ll.llm.close()   # its threads go now, not when the collector finds it: the next curve is timed alone
    del ll
    gc.collect()
    return out


def model_row(lm, steps: list[dict], args, overhead: float) -> dict:
    """overhead: seconds a step outside the forward, as the capped decoder spends it (the recording,
    which verifies whole trees, spends ~3x that on bookkeeping)."""
    curve = costs.curve_for(lm, remeasure=True, quiet=True)   # measured now, on a machine left alone
    log(f"  cost curve: {', '.join(f'{w}:{c:.2f}' for w, c in zip(curve.widths, curve.costs))}")
    row = {"model": lm.name, "source": lm.source, "kernels": lm.kernels, "numerics": lm.info.get("numerics"),
           "forward": lm.info.get("forward"), "invariant": lm.invariant,
           "cost_curve": {"points": curve.to_dict(), "one_token_ms": 1000 * (curve.one_token_seconds or 0),
                          "branch": curve.branch, "stream": curve.stream},
           "cap": cap_summary(steps, curve, args.max_nodes), "replay": replay(lm, steps, curve, args, overhead)}
    log("  measured plain decoding: hd, llama.cpp")
    proj = row["replay"]["projection"]["hd_tokens_per_second"]
    hd = hd_plain(lm, args.plain_tokens)
    ll = llama_plain(lm, args.plain_tokens)
    row["measured"] = {"hd_plain_tokens_per_second": hd, "llama_cpp_plain": ll}
    ll_tps = ll.get("tokens_per_second")
    # the replay's forwards run on a random context at the recorded lengths, plain decoding's on a
    # short prompt: the speed-up over plain in one instrument, applied to the measured plain speed,
    # is the projection compared with llama.cpp
    speedup = row["replay"]["projection"]["speedup"]
    row["projection_calibrated"] = {"hd_tokens_per_second": speedup * hd, "speedup_over_hd_plain": speedup,
                                    "over_llama_cpp_plain": speedup * hd / ll_tps if ll_tps else None}
    row["ratios"] = {"projection_over_measured_hd_plain": proj / hd,
                     "projection_over_llama_cpp_plain": proj / ll_tps if ll_tps else None}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=10, help="Spec-Bench questions per category")
    ap.add_argument("--corpus-prompts", type=int, default=1, help="first user turns per corpus file (0: none)")
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="GGUF files (or names) to project to")
    ap.add_argument("--max-nodes", type=int, default=31, help="drafted nodes a step at most (recorded and capped)")
    ap.add_argument("--replay-steps", type=int, default=120, help="steps timed per model")
    ap.add_argument("--plain-tokens", type=int, default=48, help="tokens of the measured plain decodings")
    ap.add_argument("--stats-db", action="append", default=[], help="statistics DB (repeatable)")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per recorded answer")
    ap.add_argument("--out", help="write the JSON here (else to stdout, the summary then to stderr)")
    args = ap.parse_args(argv)
    if args.plain_tokens < 2:
        ap.error("--plain-tokens must be >= 2 (llama.cpp's rate is timed from its first token)")
    items = prompts(args)

    log("loading the bundled model")
    lm = api.load_model()
    method = method_config("hd", DecodingConfig(stats_dbs=list(args.stats_db), max_new_tokens=args.new_tokens))
    dbs = open_dbs(method, lm)
    tables = {"record": RecycledTable(), "hd": RecycledTable()}   # each run's own, as hd bench's methods
    curve = costs.curve_for(lm)
    warm_up(lm)
    for it in items:
        it["ids"] = encode_messages(lm.tokenizer, [{"role": "user", "content": it["text"]}])
    steps: list[dict] = []

    def rec(it):
        out, st = record(lm, build_drafter(method, lm, dbs, recycle_table=tables["record"]), it["ids"],
                         args.new_tokens, args.max_nodes)
        for s in st:
            s["source"] = it["source"]
        steps.extend(st)
        return out

    def hd(it):
        drafter = build_drafter(method, lm, dbs, recycle_table=tables["hd"])
        return Decoder(lm.model, lm.eos_ids, drafter, cost=curve, max_nodes=args.max_nodes).generate(
            it["ids"], max_new_tokens=args.new_tokens)

    def plain(it):
        return Decoder(lm.model, lm.eos_ids).generate(it["ids"], max_new_tokens=args.new_tokens)

    def check(n, it, got):
        if n == 1 and got["record"] != got["plain"].tokens:   # lossless whatever is verified
            raise SystemExit(f"recorded output differs from plain decoding at token "
                             f"{first_difference(got['record'], got['plain'].tokens)}")
        log(f"{n}/{len(items)} {it['source']}/{it['category']}: {len(got['plain'].tokens)} tokens, "
            f"{len(steps)} steps recorded")

    log(f"recording and timing exact hd and plain on {len(items)} prompts")
    runs = interleaved(items, {"record": rec, "hd": hd, "plain": plain}, check)

    def pooled(gens):   # tokens over decode seconds, all questions together (as the projection)
        return sum(g.stats.new_tokens for g in gens) / sum(g.stats.wall_seconds - g.stats.prefill_seconds
                                                            for g in gens)

    def accepted(keep=lambda s: True):
        return statistics.mean(len(s["path"]) + 1 for s in steps if keep(s))

    hd_gens, plain_gens = runs["hd"], runs["plain"]
    hd_steps = sum(len(g.stats.accept_lengths) for g in hd_gens)
    bundled = {
        "model": lm.name, "source": lm.source, "kernels": lm.kernels, "numerics": lm.info.get("numerics"),
        "prompts": len(items), "steps": len(steps),
        "uncapped": {"mean_nodes": statistics.mean(s["tree"].size() for s in steps), "mean_accepted": accepted(),
                     "mean_accepted_by_source": {src: accepted(lambda s: s["source"] == src)
                                                 for src in sorted({it["source"] for it in items})},
                     "mean_overhead_ms": 1000 * statistics.mean(s["overhead"] for s in steps)},
        "measured": {"hd_tokens_per_second": pooled(hd_gens), "plain_tokens_per_second": pooled(plain_gens),
                     "speedup": pooled(hd_gens) / pooled(plain_gens),
                     "mean_accepted": sum(sum(g.stats.accept_lengths) for g in hd_gens) / hd_steps,
                     "mean_overhead_ms": 1000 * sum(g.stats.draft_seconds + g.stats.bookkeeping_seconds
                                                    for g in hd_gens) / hd_steps,
                     "hd_differ_from_plain": sum(g.tokens != p.tokens for g, p in zip(hd_gens, plain_gens)),
                     "recorded_differ_from_plain": sum(r != p.tokens for r, p in zip(runs["record"], plain_gens))}}
    log("replaying on the bundled model itself (a check of the method)")
    overhead = bundled["measured"]["mean_overhead_ms"] / 1000
    bundled["self_replay"] = model_row(lm, steps, args, overhead)
    rows = []
    for path in args.models:
        log(f"loading {path}")
        big = api.load_model(path)
        rows.append(model_row(big, steps, args, overhead))
        del big
        gc.collect()

    doc = {"command": command_line("projection.py", args), "machine": machine(), "cpu": records.cpu_name(),
           "note": "'projection' figures assume the large model accepts as the bundled one does",
           "bundled": bundled, "models": rows}
    write_result(Path(args.out) if args.out else None, doc)
    out = sys.stdout if args.out else sys.stderr
    if not args.out:
        print(json.dumps(doc, indent=1))
    b = bundled["measured"]
    print(f"bundled {lm.name}: measured hd {b['hd_tokens_per_second']:.1f} tok/s, plain "
          f"{b['plain_tokens_per_second']:.1f} ({b['speedup']:.2f}x); its self-replay projection "
          f"{bundled['self_replay']['replay']['projection']['hd_tokens_per_second']:.1f} tok/s", file=out)
    print(f"{'model':34s} {'1-tok ms':>8s} {'width mean/med':>14s} {'accepted':>8s} {'projection hd':>13s} "
          f"{'replay plain':>12s} {'hd plain':>8s} {'llama.cpp':>9s} {'speed-up':>8s} {'x llama':>7s}",
          file=out)
    nan = float("nan")
    for r in [bundled["self_replay"]] + rows:
        rp, ms, pc = r["replay"], r["measured"], r["projection_calibrated"]
        ll = ms["llama_cpp_plain"].get("tokens_per_second")
        name = "(self-replay) " * (r is bundled["self_replay"]) + Path(r["source"]).name
        print(f"{name[:34]:34s} {rp['one_token_ms']:8.1f} "
              f"{r['cap']['mean_width']:7.1f}/{r['cap']['median_width']:<6g} {r['cap']['mean_accepted_projection']:8.2f} "
              f"{rp['projection']['hd_tokens_per_second']:13.1f} {rp['projection']['plain_tokens_per_second']:12.1f} "
              f"{ms['hd_plain_tokens_per_second']:8.1f} {ll or nan:9.1f} "
              f"{pc['speedup_over_hd_plain']:8.2f} {pc['over_llama_cpp_plain'] or nan:7.2f}",
              file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""llguidance against xgrammar on this CPU: what a grammar costs hd (issue 48, item 1).

For each engine, at the bundled model's vocabulary (SmolLM2, 49,152 tokens) and at a 128k one
(128,256 tokens, Llama 3's size: a byte-level BPE trained here on ../shared/corpora, since the
hub is not reachable; cached under hd's cache folder):
  tokenizer   building the engine's view of the vocabulary (once per model);
  compile     a grammar from a JSON schema (a few BFCL functions' parameters mapped to JSON Schema,
              and json_object = {"type": "object"}): constructing the compiled grammar and matcher,
              then the first mask (llguidance compiles lazily, so its first mask is part of it);
  mask        per token, walking a JSON answer's tokens one by one (the BFCL question's accepted
              answer, json.dumps'd): the time of one next-token bitmask, median (and p90) over all
              tokens of all schemas; consume (advancing the matcher by one token) beside it;
  hd row      what hd pays per verified row (llguidance only: engine/text/constrain.py's masked(), the
              mask of each row's own path unpacked and applied to fp32 logits), over chains of 8
              drafted answer tokens, one chain per answer token: the issue's "grammar cost per
              verified row" target (<= 0.1 ms at the bundled vocabulary).
The engines run interleaved (llguidance, xgrammar, llguidance, ...; --repeats walks each), so
drift of a shared machine hits both alike; every walk checks that both engines accept every
token of the answer and then end.

xgrammar is measured only here (hd does not depend on it): without it, a line says so and
llguidance alone is measured.

    python benchmarks/grammar_engines.py --out benchmarks/results/grammar_engines.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import command_line, machine, write_result

BFCL = Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl"
CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
BIG_VOCAB = 128256
# a few BFCL questions of different shapes: flat, nested object, arrays, enums, many fields
QUESTIONS = ("simple_python_0", "simple_python_10", "multiple_0", "parallel_3", "simple_python_100")


def bfcl_cases() -> list[dict]:
    """{name, schema, answer}: each question's (first) function as JSON Schema and its first
    accepted call's arguments as the answer."""
    from hdcli.bench.agents import bfcl_schema, load_bfcl
    out = []
    for qid in QUESTIONS:
        q = next(q for q in load_bfcl(BFCL, qid.rsplit("_", 1)[0]) if q["id"] == qid)
        fn = q["functions"][0] if q["answer"] is None else next(
            f for f in q["functions"] if f["name"] == q["answer"][0]["name"])
        out.append({"name": f"{qid}:{fn['name']}", "schema": bfcl_schema(fn["parameters"]),
                    "answer": json.dumps(q["answer"][0]["arguments"])})
    out.append({"name": "json_object", "schema": {"type": "object"}, "answer": out[1]["answer"]})
    return out


def big_tokenizer(vocab_size: int = BIG_VOCAB):
    """A byte-level BPE of vocab_size tokens trained on ../shared/corpora, as a transformers fast
    tokenizer; trained once (a minute or two) and cached."""
    from transformers import PreTrainedTokenizerFast
    from hdcli.engine.environment import cache_dir
    path = cache_dir() / "bench" / f"bpe-{vocab_size}-max32.json"
    if not path.is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        texts = []
        for f in sorted(CORPORA.rglob("*.jsonl")):
            for line in f.read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 is text
                if not line.strip():
                    continue
                r = json.loads(line)
                texts += [r.get("prompt", ""), r.get("text", "")]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      # the corpora's degenerate answers would make tokens of
                                      # thousands of bytes, which llguidance refuses (a panic)
                                      max_token_length=32, show_progress=False)
        t0 = time.perf_counter()
        tok.train_from_iterator(texts, trainer)
        print(f"trained a {tok.get_vocab_size()}-token BPE on {len(texts)} texts in "
              f"{time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tok, n_vocab: int):
        import llguidance.hf
        import llguidance.numpy as lnp
        self.lnp, self.n_vocab = lnp, n_vocab
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=n_vocab)
        self.tokenizer_seconds = time.perf_counter() - t0
        self.mask = lnp.allocate_token_bitmask(1, n_vocab)

    def matcher(self, schema: dict):
        from llguidance import LLMatcher
        m = LLMatcher(self.tok, LLMatcher.grammar_from_json_schema(schema))
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, m) -> None:
        self.lnp.fill_next_token_bitmask(m, self.mask)

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)

    def accepting(self, m) -> bool:
        return m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tok, n_vocab: int):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=n_vocab)
        self.tokenizer_seconds = time.perf_counter() - t0
        self.mask = xgr.allocate_token_bitmask(1, n_vocab)

    def matcher(self, schema: dict):
        # a new compiler per grammar: its cache would make a second compile free
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        return self.xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.mask)

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)

    def accepting(self, m) -> bool:
        return m.accept_token(self.stop)  # xgrammar ends a grammar by accepting the stop token


def walk(engine, case: dict, ids: list[int]) -> dict:
    """Compile, first mask, then mask + consume per token; checks the answer is accepted whole."""
    t0 = time.perf_counter()
    m = engine.matcher(case["schema"])
    t1 = time.perf_counter()
    engine.fill(m)
    t2 = time.perf_counter()
    masks, consumes = [], []
    for i, t in enumerate(ids):
        if i:
            a = time.perf_counter()
            engine.fill(m)
            masks.append(time.perf_counter() - a)
        a = time.perf_counter()
        ok = engine.consume(m, t)
        consumes.append(time.perf_counter() - a)
        if not ok:
            raise RuntimeError(f"{engine.name} refused token {i} of {case['name']}'s answer")
    a = time.perf_counter()
    engine.fill(m)
    masks.append(time.perf_counter() - a)
    if not engine.accepting(m):
        raise RuntimeError(f"{engine.name}: {case['name']}'s answer does not end the grammar")
    return {"construct": t1 - t0, "first_mask": t2 - t1, "masks": masks, "consumes": consumes}


def measure(vocab_name: str, hf_tok, n_vocab: int, engines: list, cases: list[dict], repeats: int) -> dict:
    built = []
    for cls in engines:
        e = cls(hf_tok, n_vocab)
        e.stop = hf_tok.eos_token_id
        built.append(e)
    ids = {c["name"]: hf_tok.encode(c["answer"], add_special_tokens=False) for c in cases}
    runs: dict[str, dict[str, list]] = {e.name: {} for e in built}
    for _ in range(repeats):
        for c in cases:
            for e in built:  # interleaved: the same case, engine after engine
                runs[e.name].setdefault(c["name"], []).append(walk(e, c, ids[c["name"]]))
    out = {}
    for e in built:
        per = runs[e.name]
        masks = [x for rs in per.values() for r in rs for x in r["masks"]]
        consumes = [x for rs in per.values() for r in rs for x in r["consumes"]]
        ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
        out[e.name] = {
            "vocab": vocab_name, "n_vocab": n_vocab, "tokenizer_ms": 1000 * e.tokenizer_seconds,
            "compile_ms": {n: ms([r["construct"] + r["first_mask"] for r in rs]) for n, rs in per.items()},
            "construct_ms": {n: ms([r["construct"] for r in rs]) for n, rs in per.items()},
            "mask_ms_median": ms(masks), "mask_ms_p90": 1000 * statistics.quantiles(masks, n=10)[-1],
            "mask_ms_mean": 1000 * statistics.mean(masks), "consume_ms_median": ms(consumes),
            "tokens_walked": len(masks)}
    out["llguidance"].update(hd_rows(hf_tok, n_vocab, hf_tok.eos_token_id, cases, repeats))
    return out


def hd_rows(hf_tok, n_vocab: int, eos: int, cases: list[dict], repeats: int, chain: int = 8) -> dict:
    """What hd pays per verified row (engine/text/constrain.GrammarState.masked: llguidance's mask for
    each row's own path, unpacked and applied to fp32 logits): chains of `chain` drafted answer
    tokens, one per output token, as a step that verifies them would mask them."""
    import types
    import torch
    from hdcli.engine.text import constrain
    lm = types.SimpleNamespace(tokenizer=hf_tok, eos_ids={eos},
                               model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=n_vocab)))
    per_row = []
    logits = torch.zeros(chain + 1, n_vocab)
    for _ in range(repeats):
        for c in cases:
            g = constrain.compile(lm, "json_schema", c["schema"])
            state, ids = g.start(), hf_tok.encode(c["answer"], add_special_tokens=False)
            for i in range(len(ids)):
                path = ids[i:i + chain]
                t0 = time.perf_counter()
                state.masked(logits[:len(path) + 1], [-1] + list(range(len(path))), [0] + path)
                per_row.append((time.perf_counter() - t0) / (len(path) + 1))
                state.advance(ids[i:i + 1])
    return {"hd_row_ms_median": 1000 * statistics.median(per_row), "hd_row_ms_mean": 1000 * statistics.mean(per_row),
            "hd_chain": chain}


def table(results: list[dict]) -> str:
    head = (f"{'engine':11} {'vocab':>7} {'tokenizer':>10} {'compile (median over schemas)':>30} {'mask med':>9} "
            f"{'p90':>7} {'consume':>8} {'hd row':>7}")
    rows = [head, "-" * len(head)]
    for r in results:
        comp = statistics.median(r["compile_ms"].values())
        rng = f"{min(r['compile_ms'].values()):.1f}-{max(r['compile_ms'].values()):.1f}"
        rows.append(f"{r['engine']:11} {r['n_vocab']:>7} {r['tokenizer_ms']:>8.0f}ms "
                    f"{comp:>13.1f} ms ({rng:>11} ms) {r['mask_ms_median']:>7.3f}ms {r['mask_ms_p90']:>6.3f} "
                    f"{r['consume_ms_median']:>7.3f}  " + (f"{r['hd_row_ms_median']:.3f}" if "hd_row_ms_median" in r else "-"))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="walks of each answer per engine")
    ap.add_argument("--vocabs", default="bundled,128k", help="bundled, 128k or both")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    from importlib import metadata
    engines = [Llguidance]
    versions = {"llguidance": metadata.version("llguidance")}
    try:
        import xgrammar  # noqa: F401
        engines.append(Xgrammar)
        versions["xgrammar"] = metadata.version("xgrammar")
    except ImportError:
        print("xgrammar is not installed: measuring llguidance alone (pip install xgrammar to compare)",
              file=sys.stderr)
    cases = bfcl_cases()
    results = []
    for vocab in args.vocabs.split(","):
        if vocab == "bundled":
            from hdcli.engine import loader
            lm = loader.load(loader.DEFAULT_MODEL, quiet=True)
            tok, n = lm.tokenizer, int(lm.model.config.vocab_size)
        else:
            tok = big_tokenizer()
            n = BIG_VOCAB
        for name, r in measure(vocab, tok, n, engines, cases, args.repeats).items():
            results.append({"engine": name, **r})
    doc = {"command": command_line("grammar_engines.py", args), "machine": machine(), "versions": versions,
           "note": "2 cores shared with other jobs; engines interleaved per answer", "schemas": [c["name"] for c in cases],
           "results": results}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{machine()['cpu']} · {', '.join(f'{k} {v}' for k, v in versions.items())} · "
              f"{args.repeats} walks of {len(cases)} answers")
        print(table(results))
    write_result(args.out, doc)


if __name__ == "__main__":
    main()

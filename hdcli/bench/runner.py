"""Spec-Bench runs: several decoding methods on the same model, in one process, interleaved.

Definitions (Spec-Bench's, so figures compare with its published tables):
  tokens/s of a question = its new tokens / its wall time, over all its turns (prefill included);
  speedup of a method    = mean over questions of its tokens/s / the same mean for `ar`
                           (and, beside it, for `hf-ar`: transformers' generate on the stock
                           model, the baseline a user already has);
  mean accepted tokens   = mean accepted length over all decode steps, pooled over questions
                           (accepted length = drafted tokens kept + the target's own token);
  exactness              = for greedy and seeded runs, answers that differ from `ar`'s and where they first do.

Methods run one after another on each question (A B C, A B C, ...), so drift of the machine hits
all of them alike. Multi-turn questions run turn by turn; each method's own answer to a turn is
the history of the next, as in Spec-Bench.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..compose import DBs, build_drafter, warm_up
from ..config import DEFAULT_CANDIDATES, DEFAULT_POLICY, DecodingConfig
from ..drafting import LayerInputs, RecycledTable, registry
from ..drafting import model as model_layer
from ..engine import records
from ..engine.decode import costs
from ..engine.decode.loop import Decoder, first_difference
from ..engine.decode.request import Request, Speculation
from ..engine.text.prompts import encode_messages, encode_prompt
from ..engine.decode.verify import Sampling
from ..errors import HdError
from . import specbench
from .baselines import hf_generate, stock_model
from ..drafting import suffix
from . import llamacpp
from .llamacpp import LlamaCppModel
from . import llamaserver
from .llamaserver import LlamaServer

def _db_methods() -> dict[str, dict]:
    """hd's methods as changes to the run's DecodingConfig: plain decoding, each registered layer
    alone (first-hit, one chain), and the whole hierarchy with each policy."""
    single = {n: {"layers": [n], "policy": "first-hit", "candidates": 1} for n in registry.LAYERS}
    return {"ar": {"layers": []}, **single,
            "context+recycle": {"layers": ["context", "recycle"]},
            "context+stats": {"layers": ["context", "stats"]},
            "context+model+recycle": {"layers": ["context", "model", "recycle"]},
            "context+recycle+stats": {"layers": ["context", "recycle", "stats"]},
            "hd": {}, "hd-chain": {"candidates": 1}, "hd-first-hit": {"policy": "first-hit"},
            "hd-fill": {"policy": "fill"}, "hd-fill-tracked": {"policy": "fill-tracked"},
            "hd-adaptive": {"policy": "adaptive"}, "hd-governor": {"governor": True},
            # leave-one-out: the default hierarchy of the run's DBs without one layer (--ablate)
            **{f"hd-no-{n}": {"without": n} for n in registry.LAYERS}}


DB_METHODS = _db_methods()
PEERS = ("hf-ar", "hf-pld", "suffix", "llama-cpp", *llamaserver.METHODS)
# baselines every method's speed is also given against, where they ran: summary key suffix
BASELINES = {"hf-ar": "hf_ar", "llama-cpp": "llama_cpp"}
# the peers that sample with their own randomness: their sampled answers are not compared with ar's
OWN_SAMPLERS = ("hf-ar", "hf-pld", "llama-cpp", *llamaserver.METHODS)
METHODS = tuple(DB_METHODS) + PEERS
METHOD_HELP = {
    "ar": "plain autoregressive decoding, same model and KV cache (the baseline)",
    **{n: spec.help for n, spec in registry.LAYERS.items()},
    "context+recycle": "context DB, then recycled predictions, token trees (hd's default without DBs before 2026-12-07)",
    "context+stats": "context DB, then the statistics DB (hd's default with a statistics DB before 2026-12-07)",
    "context+model+recycle": "context DB, the model layer, then recycled predictions (an ablation of hd)",
    "context+recycle+stats": "context DB, recycled predictions, then the statistics DB (an ablation of hd)",
    "hd": f"the default hierarchy (context DB, then the model layer: the model DB's answers where given and the "
          f"run's own), {DEFAULT_POLICY} policy, token trees of up to "
          f"{DEFAULT_CANDIDATES} candidates",
    "hd-chain": "every layer, default policy, one candidate (single-chain verification)",
    "hd-first-hit": "every layer, first-hit policy, token trees",
    "hd-fill": "every layer, fill policy, token trees",
    "hd-fill-tracked": "every layer, fill-tracked policy (fill's order, trees cut by this answer's acceptance), token trees",
    "hd-adaptive": "every layer, adaptive policy, token trees",
    "hd-governor": "hd whose answers draft only while drafting pays on their own clock (--governor)",
    **{f"hd-no-{n}": f"hd without the {n} layer (an ablation; --ablate adds one for each default layer)"
       for n in registry.LAYERS},
    "hf-ar": "transformers' generate, greedy, on the stock model (torch's kernels): what users run today",
    "hf-pld": "transformers' generate(prompt_lookup_num_tokens=10) on the stock model",
    "suffix": "SuffixDecoding (arctic-inference, vLLM's suffix method) drafts, verified by hd",
    "llama-cpp": "llama.cpp (llama-cpp-python, optional) on the same GGUF, plain greedy, same prompt ids",
    "llama-server": "llama.cpp's llama-server (make llama-server, optional) on the same GGUF, plain greedy, "
                    "same prompt ids, its own timings",
    **{m: f"llama-server with its own --spec-type {t} (n-gram drafts, llama.cpp's defaults)"
       for m, t in llamaserver.METHODS.items() if t},
}


def single_layer_methods(cfg: DecodingConfig) -> list[str]:
    """Each layer alone (a bench default) whose DB the run gives."""
    return [n for n, spec in registry.LAYERS.items() if spec.bench_default and not spec.missing(cfg)]


def default_methods(cfg: DecodingConfig) -> list[str]:
    """ar and hf-ar, each layer alone whose DB is given, hd, hf-pld, suffix where installed, and
    llama-cpp where installed and the model is a GGUF file."""
    return (["ar", "hf-ar"] + single_layer_methods(cfg) + ["hd", "hf-pld"] + ["suffix"] * suffix.available()
            + ["llama-cpp"] * llamacpp.runs_model(cfg.model))


@dataclass
class Turn:
    text: str
    tokens: list[int]
    wall_time: float
    accept_lengths: list[int]        # empty where the method does not expose its steps (hf-pld)
    layers: dict = field(default_factory=dict)  # layer -> LayerStats.to_dict()
    forward_seconds: float = 0.0
    overhead_seconds: float = 0.0
    grammar_seconds: float = 0.0     # masking and cutting under a grammar, and the rows masked
    grammar_rows: int = 0
    timings: dict = field(default_factory=dict)  # a peer's own timings of the answer (llama-server's)


class Runner:
    """One method: answers a prompt (token ids) with new tokens and its timing. capped: the
    drafter's trees are cut to what pays for its forward (hd's cost cap); else sent whole.
    governed: each answer drafts only while drafting pays (engine/decode/governor.py)."""

    def __init__(self, name: str, lm, drafter_factory: Callable | None = None, capped: bool = True,
                 governed: bool = False):
        self.name, self.lm, self.factory, self.governed = name, lm, drafter_factory, governed
        self.cost = costs.curve_for(lm) if drafter_factory and capped else None

    def answer(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, seed: int | None,
               grammar=None, prediction: list[int] | None = None) -> Turn:
        """grammar (constrain.Grammar), prediction (token ids): as Decoder.generate takes them."""
        drafter = self.factory() if self.factory else None
        dec = Decoder(self.lm.model, self.lm.eos_ids, drafter, cost=self.cost)
        g = dec.generate(Request(prompt_ids, max_new_tokens, sampling, seed, grammar=grammar,
                                 prediction=prediction, speculation=Speculation(governed=self.governed)))
        s = g.stats
        return Turn(text=self.lm.tokenizer.decode(g.tokens, skip_special_tokens=True), tokens=g.tokens,
                    wall_time=s.wall_seconds, accept_lengths=list(s.accept_lengths),
                    layers={k: v.to_dict() for k, v in s.layers.items()},
                    forward_seconds=s.forward_seconds,
                    overhead_seconds=s.draft_seconds + s.bookkeeping_seconds,
                    grammar_seconds=s.grammar_seconds, grammar_rows=s.grammar_rows)

    def turn(self, tokens: list[int], wall: float) -> Turn:
        """A baseline's answer from its tokens and wall time (its steps are not exposed)."""
        return Turn(text=self.lm.tokenizer.decode(tokens, skip_special_tokens=True), tokens=tokens,
                    wall_time=wall, accept_lengths=[])

    def close(self) -> None:
        """Release what the method holds beyond this process (a server); nothing for most."""


class HfGenerate(Runner):
    """transformers' own generate() on the stock model (torch's kernels), greedy or with its
    prompt lookup decoding: what users run today, the baselines that count."""

    def __init__(self, name: str, stock_lm, prompt_lookup: int | None = None):
        super().__init__(name, stock_lm)
        self.prompt_lookup = prompt_lookup

    def answer(self, prompt_ids, max_new_tokens, sampling, seed):
        return self.turn(*hf_generate(self.lm, prompt_ids, max_new_tokens, sampling, seed,
                                      prompt_lookup=self.prompt_lookup))


class LlamaCpp(Runner):
    """llama.cpp on the same GGUF (hdcli/bench/llamacpp.py): the CPU yardstick."""

    def __init__(self, name: str, lm):
        super().__init__(name, lm)
        self.llama = LlamaCppModel(lm)

    def answer(self, prompt_ids, max_new_tokens, sampling, seed):
        return self.turn(*self.llama.answer(prompt_ids, max_new_tokens, sampling, seed))


class LlamaServerPeer(Runner):
    """llama-server on the same GGUF, plain or with one --spec-type (hdcli/bench/llamaserver.py):
    one server for the run; its speed by its own timings, its drafts and their acceptance as a layer."""

    TIMINGS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
               "draft_n", "draft_n_accepted")

    def __init__(self, name: str, lm):
        super().__init__(name, lm)
        self.server = LlamaServer(name, lm)

    def answer(self, prompt_ids, max_new_tokens, sampling, seed):
        tokens, wall, timings = self.server.answer(prompt_ids, max_new_tokens, sampling, seed)
        turn = self.turn(tokens, wall)
        turn.timings = {k: timings[k] for k in self.TIMINGS if k in timings}
        if self.server.spec:
            turn.layers = {self.server.spec: {"drafted": timings.get("draft_n", 0),
                                              "accepted": timings.get("draft_n_accepted", 0)}}
        return turn

    def close(self) -> None:
        self.server.close()


def unavailable(names) -> dict[str, str]:
    """The methods of `names` that cannot run here, each with its one-line reason (llama-server's
    without the binary, or without the --spec-type); the rest run."""
    reasons = {n: llamaserver.unavailable(n) for n in names if n in llamaserver.METHODS}
    return {n: why for n, why in reasons.items() if why}


def close(runners: dict[str, Runner]) -> None:
    """Every method's close(), the servers stopped."""
    for r in runners.values():
        r.close()


def check_methods(names, known: tuple[str, ...] = METHODS) -> None:
    """Known names, `ar` among them (checked before the model is loaded, and again here);
    known: the benchmark's methods (hd bench agents has its own)."""
    unknown = [m for m in names if m not in known]
    if unknown:
        raise HdError(f"unknown method '{unknown[0]}'; known methods: {', '.join(known)}")
    if "ar" not in names:
        raise HdError("--methods must include 'ar': every speedup is measured against it")


def method_help(helps: dict[str, str] = METHOD_HELP) -> str:
    """The methods' one-line descriptions for --methods' help."""
    return "; ".join(f"{k}: {v}" for k, v in helps.items())


def method_config(name: str, cfg: DecodingConfig) -> DecodingConfig:
    """The configuration of one of hd's methods, refusing one whose layer's DB is not given."""
    changes = dict(DB_METHODS[name])
    if "without" in changes:
        without = changes.pop("without")
        changes = {"layers": [n for n in default_layers(cfg) if n != without]}
    method = cfg.replace(**changes)
    for layer in method.layers or []:
        lacks = registry.LAYERS[layer].missing(cfg)
        if lacks:
            raise HdError(f"method '{name}' needs {lacks}")
    return method.validate()


def default_layers(cfg: DecodingConfig) -> list[str]:
    """The layers of `hd` (the default hierarchy) with the run's DBs."""
    return registry.default_layers(LayerInputs(stats_stores=cfg.stats_dbs, model_db=cfg.model_db))


def ablations(cfg: DecodingConfig) -> list[str]:
    """hd-no-<layer> for each layer of the default hierarchy with the run's DBs (--ablate)."""
    return [f"hd-no-{n}" for n in default_layers(cfg)]


def drafter_factory(name: str, lm, cfg: DecodingConfig, dbs: DBs) -> tuple[Callable | None, bool]:
    """(a factory of the method's drafter, one per answer, or None for `ar`; whether its trees are
    cut by cost) for hd's methods and `suffix`: what a method shares across answers (the recycle
    table, SuffixDecoding's global tree, the model DB's answers) is made here, once per run."""
    if name == "ar":
        return None, True
    if name == "suffix":
        cache = suffix.new_cache()  # one per run: its global tree learns across the questions
        return (lambda: suffix.SuffixDrafter(cache)), False   # sent whole, as vLLM does
    method = method_config(name, cfg)
    build_drafter(method, lm, dbs)  # fail now, not mid-run
    table = RecycledTable()  # one per method and run: the target's predictions carry across questions
    # and so do its answers: each method learns from its own (another method's answer to the
    # same question would draft this one's whole)
    layers = method.layers if method.layers is not None else default_layers(cfg)
    drafts_answers = "model" in layers and model_layer.drafts_answers(dbs.model)
    index = model_layer.new_answers(dbs.model) if drafts_answers else None
    return (lambda: build_drafter(method, lm, dbs, recycle_table=table, answer_index=index)), True


def make_runners(lm, names, cfg: DecodingConfig, dbs: DBs) -> dict[str, Runner]:
    check_methods(names)
    stock = stock_model(lm) if any(n.startswith("hf-") for n in names) else None
    runners = {}
    for name in names:
        if name in ("hf-ar", "hf-pld"):
            runners[name] = HfGenerate(name, stock, prompt_lookup=10 if name == "hf-pld" else None)
        elif name in ("suffix", "ar") or name in DB_METHODS:
            factory, capped = drafter_factory(name, lm, cfg, dbs)
            # suffix as vLLM runs it: every step drafts (hd's governor, where asked, is hd's)
            governed = name in DB_METHODS and method_config(name, cfg).governor
            runners[name] = Runner(name, lm, factory, capped, governed)
        elif name == "llama-cpp":
            runners[name] = LlamaCpp(name, lm)
        else:
            runners[name] = None  # a llama-server: started last, once every other method is known to build
    try:
        for name in [n for n in names if n in llamaserver.METHODS]:
            runners[name] = LlamaServerPeer(name, lm)
    except BaseException:  # the servers already started are stopped
        close({n: r for n, r in runners.items() if r is not None})
        raise
    return runners


def run_question(lm, q: dict, runner: Runner, max_new_tokens: int, sampling: Sampling,
                 seed: int | None) -> list[Turn]:
    """Every turn of a question, each with the method's own earlier answers as history."""
    messages, turns = [], []
    for text in q["turns"]:
        messages.append({"role": "user", "content": text})
        ids = encode_messages(lm.tokenizer, messages)
        room = lm.max_context - len(ids)
        if room < 2:
            raise HdError(f"question {q['question_id']}: prompt of {len(ids)} tokens leaves no room "
                          f"in the model's context of {lm.max_context}")
        turn = runner.answer(ids, min(max_new_tokens, room - 1), sampling, seed)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return turns


def run(lm, questions: list[dict], runners: dict[str, Runner], max_new_tokens: int,
        sampling: Sampling = Sampling(), seed: int | None = 0, progress=None) -> dict:
    """results[method] = list of (question, turns), questions in order, methods interleaved;
    progress(method, question, total answers) after each answer."""
    warm_up(lm)
    for r in runners.values():  # each method's own first call (kernels, caches) is not timed
        r.answer([int(t) for t in encode_prompt(lm.tokenizer, "Say hello.")], 8, sampling, seed)
    results: dict[str, list] = {m: [] for m in runners}
    total = len(questions) * len(runners)
    for q in questions:
        for name, r in runners.items():
            results[name].append((q, run_question(lm, q, r, max_new_tokens, sampling, seed)))
            if progress:
                progress(name, q, total)
    return results


def _first_difference(a: list[Turn], b: list[Turn]) -> int | None:
    """Token index (counted over all turns) of the first difference, None if identical."""
    offset = 0
    for x, y in zip(a, b):
        d = first_difference(x.tokens, y.tokens)
        if d is not None:
            return offset + d
        offset += len(x.tokens)
    return None


def summarize(results: dict, greedy: bool = True, seeded: bool = False) -> dict:
    """Per method: overall and per category figures (see the module docstring). Answers are
    compared with ar's where they must be equal: greedy, or sampled with a seed (the draws are
    keyed by output position, engine/decode/verify.coupled_choice), for hd's own runs; the
    baselines (transformers, llama.cpp) draw their own randomness, so only greedy compares them."""
    base = results["ar"]
    order = {c: i for i, c in enumerate(specbench.CATEGORIES)}
    cats = sorted({q["category"] for q, _ in base}, key=lambda c: (order.get(c, len(order)), c))

    bases = {m: results[m] for m in BASELINES if m in results}  # hf-ar, llama-cpp: where they ran

    def tps_of(rows) -> list[float]:
        return [sum(len(t.tokens) for t in turns) / sum(t.wall_time for t in turns) for _, turns in rows]

    def figures(method: str, keep) -> dict:
        rows = [(q, turns) for q, turns in results[method] if keep(q)]
        ref = [(q, turns) for q, turns in base if keep(q)]
        tps, ar_tps = tps_of(rows), tps_of(ref)
        steps = [a for _, turns in rows for t in turns for a in t.accept_lengths]
        step_time = sum(t.forward_seconds + t.overhead_seconds for _, turns in rows for t in turns)
        layers: dict[str, dict] = {}
        for _, turns in rows:
            for t in turns:
                for name, ls in t.layers.items():
                    agg = layers.setdefault(name, {"queries": 0, "hits": 0, "candidates": 0, "won": 0,
                                                   "drafted": 0, "accepted": 0, "seconds": 0.0})
                    for k in agg:
                        agg[k] += ls.get(k, 0)
        total_acc = sum(v["accepted"] for v in layers.values())
        for v in layers.values():
            v["hit_rate"] = v["hits"] / v["queries"] if v["queries"] else 0.0
            v["acceptance_rate"] = v["accepted"] / v["drafted"] if v["drafted"] else 0.0
            v["share_of_accepted"] = v["accepted"] / total_acc if total_acc else 0.0
            # its cost: time per decode step, and share of the steps' time (forward included)
            v["ms_per_step"] = 1000 * v["seconds"] / len(steps) if steps else 0.0
            v["share_of_time"] = v["seconds"] / step_time if step_time else 0.0
        diffs = [_first_difference(turns, r) for (_, turns), (_, r) in zip(rows, ref)]
        fwd = sum(t.forward_seconds for _, turns in rows for t in turns)
        over = sum(t.overhead_seconds for _, turns in rows for t in turns)
        out = {"questions": len(rows), "tokens_per_second": statistics.mean(tps),
               "speedup": statistics.mean(tps) / statistics.mean(ar_tps),
               "mean_accepted_tokens": sum(steps) / len(steps) if steps else None,
               "new_tokens": sum(len(t.tokens) for _, turns in rows for t in turns),
               "overhead_share": over / (over + fwd) if fwd else None,
               "layers": layers}
        timed = [t.timings for _, turns in rows for t in turns if t.timings]
        if timed:
            out["own_timings"] = own_timings(timed)
        if greedy or (seeded and method not in OWN_SAMPLERS):
            out["differ_from_ar"] = sum(d is not None for d in diffs)
            out["first_differences"] = [d for d in diffs if d is not None]
        for b, rows_b in bases.items():
            key = BASELINES[b]
            b_rows = [(q, turns) for q, turns in rows_b if keep(q)]
            out[f"speedup_over_{key}"] = statistics.mean(tps) / statistics.mean(tps_of(b_rows))
            if greedy:
                b_diffs = [_first_difference(turns, r) for (_, turns), (_, r) in zip(rows, b_rows)]
                out[f"differ_from_{key}"] = sum(d is not None for d in b_diffs)
                out[f"first_differences_from_{key}"] = [d for d in b_diffs if d is not None]
        return out

    summary = {}
    for m in results:
        summary[m] = {"overall": figures(m, lambda q: True),
                      "categories": {c: figures(m, lambda q, c=c: q["category"] == c) for c in cats}}
    return summary


def own_timings(timed: list[dict]) -> dict:
    """A peer's own timings summed over its answers; predicted_per_second its decode speed over them
    (as llama-server counts it per answer: tokens after the first, which prefill yields, per second)."""
    total = {k: sum(t.get(k, 0) for t in timed) for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                                           "draft_n", "draft_n_accepted")}
    steps = sum(max(t.get("predicted_n", 0) - 1, 0) for t in timed)
    total["predicted_per_second"] = 1000 * steps / total["predicted_ms"] if total["predicted_ms"] else 0.0
    return total


def machine() -> dict:
    import transformers
    return {"platform": platform.platform(), "cpu": records.cpu_name(),
            "processor": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def answer_records(results: dict, model_id: str) -> dict[str, list[dict]]:
    """Spec-Bench's answer schema, one record per question per method (its evaluation scripts
    read choices[0].new_tokens, wall_time and accept_lengths)."""
    out = {}
    for m, rows in results.items():
        recs = []
        for q, turns in rows:
            recs.append({"question_id": q["question_id"], "category": q["subcategory"],
                         "answer_id": uuid.uuid4().hex[:22], "model_id": f"{model_id}-{m}",
                         "choices": [{"index": 0, "turns": [t.text for t in turns],
                                      "decoding_steps": [len(t.accept_lengths) for t in turns],
                                      "new_tokens": [len(t.tokens) for t in turns],
                                      "wall_time": [t.wall_time for t in turns],
                                      "accept_lengths": [a for t in turns for a in t.accept_lengths]}],
                         "tstamp": time.time()})
        out[m] = recs
    return out


def save(out_dir: Path, summary: dict, results: dict, meta: dict, model_id: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    answers = out_dir / "answers"
    answers.mkdir(exist_ok=True)
    for m, recs in answer_records(results, model_id).items():
        with open(answers / f"{m}.jsonl", "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    (out_dir / "summary.json").write_text(json.dumps({**meta, "methods": summary}, indent=1))

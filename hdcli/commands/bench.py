"""`hd bench spec-bench` and `hd bench agents` as the CLI and the Python API call them: the
configuration checked, the questions read, the model loaded and the methods run (runner.py,
agents.py), the report put together and saved.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from ..compose import Status, check_tokenizers, load_model_for, open_dbs, resolved
from ..config import DecodingConfig
from ..drafting import suffix
from ..engine.decode import costs
from ..errors import HdError
from ..bench import agents, drafts, runner, specbench
from ..bench.report import chart


def _questions_and_model(cfg: DecodingConfig, data, limit, categories, on_status: Status):
    """The questions file and its selection, the run's DBs and its model, the DBs' tokenizer
    checked against the model's (the DBs open first: a bad path fails before the load)."""
    path = specbench.find(data)
    questions = specbench.select(specbench.load(path), limit, categories)
    dbs = open_dbs(cfg)
    on_status(f"loading {cfg.model} ...")
    lm = load_model_for(cfg.replace(layers=None))
    check_tokenizers(dbs, lm)
    return path, questions, dbs, lm


def bench_spec_bench(cfg: DecodingConfig, methods: Sequence[str] | None = None, *, data: Path | None = None,
                     limit: int | None = None, categories: Sequence[str] | None = None, ablate: bool = False,
                     out_dir: Path | None = None, progress=None, on_status: Status = lambda m: None) -> dict:
    """Spec-Bench with several methods on one model, interleaved (hdcli/bench/runner.py): the
    summary, with the configuration the methods were built from. progress(method, question,
    total answers) after each answer; out_dir: summary.json, answers/<method>.jsonl and speedup.png."""
    cfg.validate()
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    names = runner.default_methods(cfg) if methods is None else list(methods)
    names += runner.ablations(cfg) if ablate else []   # leave one default layer out, in the same run
    runner.check_methods(names)
    skipped = runner.unavailable(names)   # llama-server methods without their binary: said, not run
    for why in skipped.values():
        on_status(f"warning: {why}")
    names = [n for n in names if n not in skipped]
    path, questions, dbs, lm = _questions_and_model(cfg, data, limit, categories, on_status)
    runners = runner.make_runners(lm, names, cfg, dbs)
    try:
        results = runner.run(lm, questions, runners, cfg.max_new_tokens, cfg.sampling, cfg.seed,
                             progress)
    finally:
        runner.close(runners)
    summary = runner.summarize(results, greedy=cfg.sampling.greedy, seeded=cfg.seed is not None)
    meta = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
            "kernels": lm.kernels, "invariant": lm.invariant, "data": str(path), "questions": len(questions),
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
            "stats_dbs": cfg.stats_dbs, "model_db": cfg.model_db, "machine": runner.machine(),
            "forward": lm.info.get("forward"), "numerics": lm.info.get("numerics"), "methods_run": names,
            "config": resolved(cfg, lm, dbs).to_dict()}
    if "suffix" in names:
        meta["suffix"] = suffix.SuffixDrafter(None).settings()
    if "llama-cpp" in names:
        meta["llama_cpp"] = runners["llama-cpp"].llama.settings()
    servers = {n: r.server.settings() for n, r in runners.items() if isinstance(r, runner.LlamaServerPeer)}
    if servers:
        meta["llama_server"] = servers
    if skipped:
        meta["skipped"] = skipped
    meta["warnings"] = [f"warning: {why}" for why in skipped.values()]   # as said on stderr
    if out_dir is not None:
        runner.save(out_dir, summary, results, meta, lm.name)
        chart({**meta, "methods": summary}, out_dir / "speedup.png")
    return {**meta, "methods": summary}


def bench_agents(cfg: DecodingConfig, methods: Sequence[str] | None = None, *,
                 workloads: Sequence[str] | None = None, bfcl=None, corpora=None, limit: int | None = None,
                 max_new_tokens: int | None = None, out: Path | None = None, progress=None,
                 on_status: Callable = lambda m: None) -> dict:
    """hd bench agents: tools, JSON-schema output and edits with a prediction, several methods
    interleaved on one model (hdcli/bench/agents.py): the report (meta and per method its figures
    by workload and category); out: where summary.json and each method's answers go."""
    workloads = list(workloads or agents.WORKLOADS)
    cfg.validate()
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise HdError(f"--max-new-tokens must be >= 1, not {max_new_tokens}")
    if methods is not None:
        agents.check_methods(methods)
    items = agents.load(list(workloads), bfcl, corpora, limit)
    dbs = open_dbs(cfg)
    on_status(f"loading {cfg.model} ...")
    lm = load_model_for(cfg.replace(layers=None))
    check_tokenizers(dbs, lm)
    names = agents.default_methods(lm) if methods is None else list(methods)
    runners = agents.make_runners(lm, names, cfg, dbs)
    results, checks = agents.run(lm, items, runners, cfg.sampling, cfg.seed, max_new_tokens, progress)
    report = {"model": lm.name, "source": str(lm.source), "dtype": lm.dtype, "device": lm.device,
              "kernels": lm.kernels, "workloads": list(workloads), "questions": len(items),
              "max_new_tokens": max_new_tokens or {w: agents.MAX_NEW_TOKENS[w] for w in workloads},
              "temperature": cfg.temperature, "seed": cfg.seed, "machine": runner.machine(),
              "methods_run": names, "config": resolved(cfg, lm, dbs).to_dict(),
              "methods": agents.summarize(results, checks, cfg.sampling.greedy)}
    if "llama-cpp" in names:
        report["llama_cpp"] = runners["llama-cpp"].llama.settings()
    if out is not None:
        agents.save(out, report, results, checks, items)
    return report


def bench_drafts(cfg: DecodingConfig, methods: Sequence[str] | None = None, *, data: Path | None = None,
                 limit: int | None = None, categories: Sequence[str] | None = None, ablate: bool = False,
                 budgets: Sequence[int] = drafts.BUDGETS, cache: Path | None = None, record: bool = False,
                 prefill: bool = False, price_by: Path | None = None, out: Path | None = None, progress=None,
                 on_status: Status = lambda m: None) -> dict:
    """hd bench drafts: drafting configurations replayed over the target's recorded greedy answers
    (hdcli/bench/drafts.py): per configuration its mean accepted tokens, predicted speedup and
    per-layer share as this machine runs it, and its MAT per tree budget. methods: hd's methods of
    `hd bench spec-bench` and suffix (default: hd, each layer alone whose DB is given, suffix
    where installed); ablate adds hd-no-<layer> for each default layer. cache: the recording's
    file (default: under HD_CACHE_DIR, by its key); record: record again. price_by: an `hd costs
    --json` report of another model (a bigger one's, say): trees are cut and steps priced by its
    curve, so the predicted speedups are that model's with this one's acceptance (a prediction)."""
    cfg.validate()
    priced = None
    if price_by is not None:
        try:
            rep = json.loads(Path(price_by).read_text())
        except (OSError, ValueError) as e:
            raise HdError(f"--price-by {price_by}: cannot read it as JSON ({type(e).__name__}); "
                          "write it with `hd costs --model FILE --json > costs.json`") from None
        priced = costs.from_report(rep if isinstance(rep, dict) else {}, f"--price-by {price_by}")
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    bad = [b for b in budgets if not 2 <= b <= 64]
    if bad:
        raise HdError(f"--budgets: {bad[0]} is not a tree budget from 2 to 64 verified tokens")
    if methods is None:
        methods = ["hd"] + runner.single_layer_methods(cfg) + ["suffix"] * suffix.available()
    methods = list(methods) + (runner.ablations(cfg) if ablate else [])
    methods = [m for m in dict.fromkeys(methods) if m != "ar"]
    runner.check_methods(["ar", *methods])
    path, questions, dbs, lm = _questions_and_model(cfg, data, limit, categories, on_status)
    if priced is not None:
        costs.assume(lm, priced)
    makers = drafts.configurations(lm, cfg, dbs, methods)
    rec, where = drafts.recorded(lm, questions, cfg.max_new_tokens, cache, record,
                                 progress=lambda n, total: on_status(f"recorded {n}/{total} answers"))
    report = drafts.bench(lm, rec, makers, budgets, prefill,
                          progress=lambda name: progress(name) if progress else None)
    report = {"model": lm.name, "source": str(lm.source), "dtype": lm.dtype, "kernels": lm.kernels,
              "data": str(path), "max_new_tokens": cfg.max_new_tokens, "cache": str(where),
              "priced_by": None if priced is None else {"file": str(price_by), **priced.info},
              "machine": runner.machine(), "config": resolved(cfg, lm, dbs).to_dict(), **report}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report

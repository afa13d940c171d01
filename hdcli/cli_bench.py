"""`hd bench`: its commands' options and what they print; the runs are hdcli/commands/bench.py's
(as hdcli/cli.py, of which this is the `bench` group).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import bench, show
from .bench import agents as bench_agents_mod
from .bench import report as bench_report
from .commands import bench as bench_commands
from .config import DecodingConfig, split_list
from .errors import HdError
from .flags import MODEL, takes

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against plain decoding and peers.")
# the decoding options of the `hd bench` commands: seed 0 (a run repeats), no --config
BENCH = ["model", "temperature", "seed", "stats_dbs", "model_db", *MODEL[1:]]
BENCH_CHANGES = dict(model={"help": None}, temperature={"help": "0 = greedy (exactness is checked only then)."},
                     seed={"default": 0, "cli": int}, stats_dbs={"help": "Statistics DB (repeatable)."},
                     model_db={"help": "Model DB."})


@bench_app.command("spec-bench")
@takes(DecodingConfig, [*BENCH, "max_new_tokens"], into="cfg", **BENCH_CHANGES)
def bench_spec_bench(
    cfg: DecodingConfig,
    data: Optional[Path] = typer.Option(None, "--data", help="Spec-Bench question.jsonl (default: "
                                        "data/spec_bench/question.jsonl here or under ../shared/)."),
    methods: Optional[str] = typer.Option(None, "--methods",
                                          help="Comma-separated, 'ar' included (default: ar, the single layers "
                                          "whose DBs are given, hd, hf-ar, hf-pld, suffix where installed). "
                                          "Known: " + bench.method_help()),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per category (default: all)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated (default: all)."),
    ablate: bool = typer.Option(False, "--ablate", help="Add hd-no-<layer> for each layer of the default "
                                "hierarchy (leave one out, in the same run)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write summary.json, answers/<method>.jsonl "
                                           "(Spec-Bench's answer schema) and speedup.png here."),
    as_json: bool = typer.Option(False, "--json", help="Write the summary as JSON to stdout."),
):
    """Run Spec-Bench with several methods on one model, interleaved, and report speedups."""
    with show.answered(lambda q: q["category"]) as progress:   # on stderr under --json too
        report = bench_commands.bench_spec_bench(cfg, split_list(methods) if methods else None, data=data,
                                                 limit=limit,
                                                 categories=split_list(categories) if categories else None,
                                                 ablate=ablate, out_dir=out_dir, progress=progress, on_status=show.status(as_json))
    if as_json:
        typer.echo(json.dumps(report))
        return
    Console(highlight=False).print(bench_report.tables(report))
    if out_dir is not None:
        Console(stderr=True, highlight=False).print(
            f"wrote {out_dir}/summary.json, {out_dir}/answers/*.jsonl, {out_dir}/speedup.png")


@bench_app.command("drafts")
@takes(DecodingConfig, [*BENCH, "max_new_tokens"], into="cfg", **BENCH_CHANGES)
def bench_drafts(
    cfg: DecodingConfig,
    data: Optional[Path] = typer.Option(None, "--data", help="Questions in Spec-Bench's format (default: "
                                        "data/spec_bench/question.jsonl here or under ../shared/)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated hd methods of `hd bench "
                                          "spec-bench` and suffix (default: hd, each layer alone whose DB is "
                                          "given, suffix where installed)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per category (default: all)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated (default: all)."),
    ablate: bool = typer.Option(False, "--ablate", help="Add hd-no-<layer> for each default layer."),
    budgets: str = typer.Option("4,8,16,32,64", "--budgets", help="Tree budgets (most tokens verified a "
                                "step, the root included; 64 at most) at which every drafted node is sent."),
    cache: Optional[Path] = typer.Option(None, "--cache", help="The recording's file (default: under "
                                         "HD_CACHE_DIR, by model, tokenizer and questions)."),
    record: bool = typer.Option(False, "--record", help="Record the answers again."),
    price_by: Optional[Path] = typer.Option(None, "--price-by", help="Another model's `hd costs --json` "
                                            "(a bigger model's, say): trees cut and steps priced by its curve, "
                                            "a prediction of that model's speedup with this one's acceptance."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the report here (JSON)."),
    as_json: bool = typer.Option(False, "--json", help="Write the report as JSON to stdout."),
):
    """Replay drafting configurations over the target's recorded greedy answers: MAT, predicted
    speedup and each layer's share, without running the model (after one recording)."""
    try:
        sizes = [int(b) for b in split_list(budgets)]
    except ValueError:
        raise HdError(f"--budgets: {budgets!r} is not a comma-separated list of integers") from None
    say = show.status(False)   # progress on stderr, --json included
    report = bench_commands.bench_drafts(cfg, split_list(methods) if methods else None, data=data, limit=limit,
                                         categories=split_list(categories) if categories else None,
                                         ablate=ablate, budgets=sizes, cache=cache, record=record, price_by=price_by, out=out,
                                         progress=lambda name: say(f"replayed {name}"), on_status=say)
    if as_json:
        typer.echo(json.dumps(report))
        return
    Console(highlight=False).print(bench.drafts.table(report))


@bench_app.command("agents")
@takes(DecodingConfig, [n for n in BENCH if n != "invariant"], into="cfg", **BENCH_CHANGES)
def bench_agents(
    cfg: DecodingConfig,
    workloads: str = typer.Option("tools,json,edits", "--workloads",
                                  help="Comma-separated: tools (BFCL calls, tool_choice auto and required), json "
                                  "(JSON-schema output), edits (code edits with the file as the prediction)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated, 'ar' included (default: ar, "
                                          "hd, suffix where installed, llama-cpp where installed and the model "
                                          "is a GGUF file). Known: " + bench_agents_mod.method_help()),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per workload, taken in turn from its "
                                        "categories (default: all)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Default per workload: " + ", ".join(
        f"{k} {v}" for k, v in bench_agents_mod.MAX_NEW_TOKENS.items()) + "."),
    bfcl: Optional[Path] = typer.Option(None, "--bfcl", help="BFCL data folder (default: ../shared/data/bfcl)."),
    corpora: Optional[Path] = typer.Option(None, "--corpora", help="Code corpora folder (default: ../shared/corpora)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write summary.json and answers/<method>.jsonl here."),
    as_json: bool = typer.Option(False, "--json", help="Write the report as JSON to stdout."),
):
    """Tool calls, JSON-schema output and edits: each method under the same constraint, interleaved."""
    with show.answered(lambda item: item.category) as progress:   # on stderr under --json too
        report = bench_commands.bench_agents(cfg, split_list(methods) if methods else None,
                                             workloads=split_list(workloads), bfcl=bfcl, corpora=corpora,
                                             limit=limit, max_new_tokens=max_new_tokens, out=out_dir,
                                             progress=progress, on_status=show.status(as_json))
    if as_json:
        typer.echo(json.dumps(report))
        return
    Console(highlight=False).print(bench_agents_mod.table(report))


@bench_app.command("report")
def bench_report_cmd(
    run_dir: Path = typer.Argument(..., help="A folder written by `hd bench spec-bench --out`."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Re-render a saved Spec-Bench run: the tables, and speedup.png again."""
    report = bench_report.load(run_dir)
    if as_json:
        typer.echo(json.dumps(report))
        return
    bench_report.chart(report, run_dir / "speedup.png")
    Console(highlight=False).print(bench_report.tables(report))

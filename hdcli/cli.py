"""`hd`: the command line, a thin layer over hdcli.api.

Every error the user can fix is an HdError: printed as one line on stderr, exit code 2.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich import box
from rich.table import Table
from rich.text import Text

from . import __version__, api, bench

from .bench import specbench
from .errors import HdError
from .db.stores import check_output_path
from .engine.verify import Sampling

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hd: lossless speculative decoding from a hierarchy of drafting sources.")

# Colour of accepted drafted tokens, by the layer that drafted them.
LAYER_STYLES = {"context": "green", "recycle": "yellow", "model": "cyan", "stats": "magenta"}
LAYER_SHORT = {"context": "ctx", "recycle": "rec", "model": "mdl", "stats": "st", "suffix": "sfx"}  # 80-column tables


def _version(value: bool):
    if value:
        typer.echo(f"hd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    pass


def _read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> str:
    if prompt is not None and prompt_file is not None:
        raise HdError("pass either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise HdError(f"cannot read --prompt-file {prompt_file}: {exc}") from None
    if prompt is None:
        raise HdError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompt


def _stats_table(title: str, runs: dict) -> Table:
    """runs: label -> RunStats. One row per drafting layer of each run, then each run's speed.
    Fits 80 columns; --json has every field, the draft/bookkeeping split included."""
    t = Table(title=f"{title} · hit = queries answered · kept = accepted / drafted",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("run", "layer", "queries", "hit", "candidates", "won", "drafted", "accepted", "kept"):
        t.add_column(col, justify="left" if col in ("run", "layer") else "right")
    for label, st in runs.items():
        for ls in st.layers.values():
            t.add_row(label, ls.name, str(ls.queries), f"{ls.hit_rate:.0%}", str(ls.candidates),
                      str(ls.won), str(ls.drafted), str(ls.accepted), f"{ls.acceptance_rate:.0%}")
    s = Table(title="speed: prefill and forward in seconds; outside = share of decode time spent "
              "outside the target's forward", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("run", "tokens", "steps", "tok/step", "tree", "tok/s", "prefill", "forward", "outside"):
        s.add_column(col, justify="left" if col == "run" else "right")
    for label, st in runs.items():
        s.add_row(label, str(st.new_tokens), str(st.steps), f"{st.mean_accepted:.2f}",
                  f"{st.mean_tree_size:.1f}", f"{st.tokens_per_second:.1f}", f"{st.prefill_seconds:.2f}",
                  f"{st.forward_seconds:.2f}", f"{st.overhead_share:.1%}")
    grid = Table.grid()
    grid.add_row(t)
    grid.add_row(s)
    return grid


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    model: str = typer.Option("smollm2-135m", "--model", "-m",
                              help="Bundled name, .gguf file, model folder or Hugging Face id."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = no top-k truncation."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Apply the model's chat template or not."),
    system: Optional[str] = typer.Option(None, help="System message for the chat template."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    layers: Optional[str] = typer.Option(None, help="Drafting layers, most local first, comma-separated "
                                         "(context, recycle, model, stats); 'none' for plain decoding. "
                                         "Default: context, recycle (the target's own earlier "
                                         "predictions), then model and stats when their DBs are given."),
    policy: str = typer.Option(api.DEFAULT_POLICY, help="How layers share a step: first-hit (first "
                               "layer that matches), fill (slots in layer order), adaptive (by "
                               "each layer's acceptance in this request)."),
    candidates: int = typer.Option(api.DEFAULT_CANDIDATES, "--candidates", "-C", help="Most "
                                   "candidate continuations per step, verified as one token tree "
                                   "(1: a single chain)."),
    model_db: Optional[Path] = typer.Option(None, "--model-db", help="Model DB from `hd build-model-db`."),
    learn: bool = typer.Option(False, "--learn", help="Add what was generated to the model DB."),
    stats_db: List[Path] = typer.Option([], "--stats-db", help="Statistics DB from `hd build-stats` "
                                        "(repeatable; asked in the order given)."),
    stats_min_prob: Optional[float] = typer.Option(None, "--stats-min-prob", help="Least estimated "
                                                   "probability of a stats/model draft (default 0.2 fp32, 0.1 bf16)."),
    stats_min_expected: Optional[float] = typer.Option(None, "--stats-min-expected", help="Least "
                                                       "expected accepted tokens of a stats/model draft "
                                                       "(default 1.0 fp32, 0 bf16)."),
    draft_len: str = typer.Option("16", "--draft-len", help="Most tokens per candidate: a number, "
                                  "or per layer as context=16,model=8,stats=8."),
    min_n: Optional[int] = typer.Option(None, "--min-n", help="Shortest n-gram the context DB "
                                        "matches (default: 2 in fp32, 1 in bf16/fp16)."),
    max_n: int = typer.Option(4, "--max-n", help="Longest n-gram the context DB matches."),
    draft_models: Optional[str] = typer.Option(None, "--draft-models", help="Draft models, smallest "
                                               "first, comma-separated, stacked above the DB layers "
                                               "(self:layers=K, self:int8, or any model with the "
                                               "target's tokenizer)."),
    level_tokens: Optional[str] = typer.Option(None, "--level-tokens", help="T per draft model: tokens "
                                               "a level holds before handing them up (e.g. 2,6)."),
    no_db: bool = typer.Option(False, "--no-db", help="With --draft-models: no DB level; the smallest "
                               "model drafts alone."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Use the hierarchy chosen by `hd plan`."),
    dtype: str = typer.Option("auto", help="auto|bf16|fp16|fp32 (auto: fp32 on CPU, bf16 on CUDA)."),
    device: str = typer.Option("auto", help="auto|cpu|cuda."),
    kernels: str = typer.Option("auto", help="auto|onednn|torch: auto keeps whichever of torch's "
                                "and oneDNN-packed kernels measures faster here (hd costs; docs/dtype.md)."),
    compare: bool = typer.Option(False, help="Also run plain decoding and report speedup and identity."),
    as_json: bool = typer.Option(False, "--json", help="Write one JSON object to stdout, nothing else."),
    color: bool = typer.Option(True, "--color/--no-color", help="Colour drafted tokens by layer."),
):
    """Generate text with lossless speculative decoding and report per-layer statistics."""
    text = _read_prompt(prompt, prompt_file)
    if not text.strip():
        raise HdError("the prompt is empty: pass --prompt TEXT or --prompt-file FILE")
    if max_new_tokens < 1:
        raise HdError(f"--max-new-tokens must be >= 1, not {max_new_tokens}")
    try:
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    except ValueError as exc:
        raise HdError(f"invalid sampling option: {exc}") from None
    api.check_seed(seed)
    plan_data = api.read_plan_file(plan) if plan is not None else None
    if plan_data is not None:  # the plan's DBs and layers: what its figures were measured with
        stats_db, model_db = api.plan_dbs(plan, plan_data, stats_db, model_db)
        if layers is None and plan_data.get("db_layers"):
            layers = ",".join(plan_data["db_layers"])
    if learn and model_db is None:
        raise HdError("--learn adds to a model DB: pass --model-db PATH")
    if layers is None:
        layers = ",".join(api.default_layers(stats_db, model_db))
    layer_list = [] if layers.strip() == "none" else [x.strip() for x in layers.split(",") if x.strip()]
    dbs = api.open_stats_dbs([str(p) for p in stats_db])  # fail before loading the model
    mdb = api.open_stats_dbs([str(model_db)], writable=learn)[0] if model_db else None
    draft_lens = api.parse_draft_len(draft_len)
    api.make_drafter(layer_list, draft_len=draft_lens, min_n=min_n or 1, max_n=max_n, stats_dbs=dbs,
                     model_db=mdb, policy=policy, candidates=candidates)
    out = Console(highlight=False, no_color=not color, soft_wrap=True)
    err = Console(stderr=True, highlight=False)
    if not as_json:
        err.print(f"[dim]loading {model} ...[/dim]")
    lm = api.load_model(model, dtype=dtype, device=device, kernels=kernels,
                        drafting=bool(layer_list or draft_models or plan))
    if not as_json:
        err.print(f"[dim]loaded {lm.source} ({lm.dtype}, {lm.device}, {lm.kernels} kernels) in "
                  f"{lm.load_seconds:.1f}s{' from cache' if lm.from_cache else ''}[/dim]")
    for db in dbs + ([mdb] if mdb else []):
        db.check_tokenizer(lm.tokenizer, lm.name)
        planned = (plan_data or {}).get("db_digests", {}).get(str(db.path.resolve()))
        if planned and planned != db.header.get("content_digest") and not as_json:
            err.print(f"[yellow]warning:[/yellow] {db.path} changed since plan {plan} was measured "
                      "(learned or rebuilt): its predictions may be off; run `hd plan` again")
    cheap = api.cheap_verification(lm)
    drafter = api.make_drafter(layer_list, draft_len=draft_lens, min_n=min_n, max_n=max_n, cheap_verify=cheap,
                               stats_dbs=dbs, stats_min_prob=stats_min_prob,
                               stats_min_expected=stats_min_expected, model_db=mdb, policy=policy,
                               candidates=candidates)
    stack = None
    if plan is not None:
        if draft_models:
            raise HdError("pass either --plan or --draft-models, not both")
        chosen = api.read_plan(plan, lm)
        draft_models = ",".join(lv["model"] for lv in chosen["levels"]) or None
        level_tokens = ",".join(str(lv["T"]) for lv in chosen["levels"]) or None
        no_db = chosen["bottom"] == "none"
        if not draft_models:
            drafter = None if no_db else api.make_drafter(
                layer_list, draft_len=draft_lens, min_n=min_n, max_n=max_n, cheap_verify=cheap,
                stats_dbs=dbs, model_db=mdb, policy=policy, candidates=1)
    if draft_models:
        Ts = _int_list(level_tokens, "--level-tokens") if level_tokens else []
        base = None if no_db else api.make_drafter(
            layer_list, draft_len=draft_lens, min_n=min_n, max_n=max_n, cheap_verify=cheap, stats_dbs=dbs,
            stats_min_prob=stats_min_prob, stats_min_expected=stats_min_expected, model_db=mdb,
            policy=policy, candidates=1)
        drafter = stack = api.make_stack(lm, draft_models.split(","), Ts, base, sampling, seed or 0)
    elif (no_db or level_tokens) and plan is None:
        raise HdError("--no-db and --level-tokens go with --draft-models")
    if compare:
        api.warm_up(lm)

    def show(piece: str, layer: Optional[str]) -> None:
        out.print(piece, end="", style=LAYER_STYLES.get(layer or "", None), markup=False)

    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
                  system=system, stop=stop)
    res = api.generate(lm, text, drafter=drafter, on_text=None if as_json else show, **common)
    runs = {"hd": res.stats}
    report = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
              "kernels": lm.kernels,
              "load_seconds": lm.load_seconds, "layers": layer_list, "draft_len": draft_lens,
              "policy": policy, "candidates": candidates,
              "stats_dbs": [str(p) for p in stats_db], "model_db": str(model_db) if model_db else None,
              "plan": str(plan) if plan else None,
              "sampling": vars(sampling) | {"seed": seed}, **res.to_dict()}
    if stack is not None:
        report["levels"] = stack.level_stats()
    if learn:
        report["learned_keys"] = api.learn(mdb, res.prompt_ids, res.tokens)
    if compare:
        base = api.generate(lm, text, drafter=None, **common)
        runs["plain"] = base.stats
        stock = api.stock_model(lm)
        n = len(base.tokens)  # transformers' generate makes as many tokens (stop strings aside)
        api.hf_generate(stock, res.prompt_ids, 4, sampling, seed)  # its first call is not timed
        hf_tokens, hf_wall = api.hf_generate(stock, res.prompt_ids, n, sampling, seed)
        hf_tps = len(hf_tokens) / hf_wall if hf_wall else 0.0
        diff = api.first_difference(res.tokens, base.tokens)
        hf_diff = api.first_difference(res.tokens, hf_tokens)
        speedup = (res.stats.tokens_per_second / base.stats.tokens_per_second
                   if base.stats.tokens_per_second else 0.0)
        report["compare"] = {"plain": base.to_dict(), "speedup": speedup,
                             "identical": diff is None, "first_difference": diff,
                             "hf_ar": {"tokens": hf_tokens, "tokens_per_second": hf_tps,
                                       "kernels": stock.kernels},
                             "speedup_over_hf_ar": res.stats.tokens_per_second / hf_tps if hf_tps else 0.0,
                             "identical_to_hf_ar": hf_diff is None, "first_difference_from_hf_ar": hf_diff}
    if as_json:
        typer.echo(json.dumps(report))
        return
    out.print()
    out.print(_stats_table(f"{lm.name} · {lm.dtype} · {lm.device}", runs))
    if stack is not None:
        lt = Table(title="draft hierarchy (bottom first; 'accepted' = kept by the level above)")
        for col in ("level", "calls", "forwards", "proposed", "accepted", "accept rate", "seconds"):
            lt.add_column(col, justify="left" if col == "level" else "right")
        for lv in report["levels"]:
            lt.add_row(lv["name"], str(lv["calls"]), str(lv["forwards"]), str(lv["proposed"]),
                       str(lv["accepted"]), f"{lv['acceptance_rate']:.1%}", f"{lv['seconds']:.2f}")
        out.print(lt)
    if compare:
        c = report["compare"]
        same = "identical" if c["identical"] else f"DIFFERENT from token {c['first_difference']}"
        note = "" if sampling.greedy else " (sampling: outputs differ by chance, not by error)"
        out.print(f"speedup over plain decoding: [bold]{c['speedup']:.2f}x[/bold]; output {same}{note}")
        hf_same = ("identical" if c["identical_to_hf_ar"]
                   else f"different from token {c['first_difference_from_hf_ar']}")
        out.print(f"speedup over transformers' generate (stock model, {c['hf_ar']['tokens_per_second']:.1f} "
                  f"tok/s): [bold]{c['speedup_over_hf_ar']:.2f}x[/bold]; output {hf_same}")


@app.command("costs")
def costs_cmd(
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    dtype: str = typer.Option("auto", help="auto|bf16|fp16|fp32 (auto: fp32 on CPU, bf16 on CUDA)."),
    device: str = typer.Option("auto", help="auto|cpu|cuda."),
    kernels: str = typer.Option("auto", help="auto shows both CPU kernel sets and which one is kept."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Drop the cached curves and measure again."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show the measured forward cost by width (what caps draft trees and picks the kernels)."""
    rep = api.cost_report(model, dtype=dtype, device=device, kernels=kernels, remeasure=remeasure)
    if as_json:
        typer.echo(json.dumps(rep))
        return
    shown = [w for w in (2, 4, 8, 16, 32, 64)
             if any(str(w) in c["cost"] for c in rep["curves"].values())]  # --json has every width
    t = Table(title=f"forward cost by width, one token = 1 · {rep['model']} · {rep['dtype']} · "
                    f"{rep['threads']} threads · {rep['cpu']}", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("kernels", no_wrap=True)
    t.add_column("1 token", justify="right", no_wrap=True)
    for w in shown:
        t.add_column(f"{w}", justify="right", no_wrap=True)
    for k, c in rep["curves"].items():
        mark = "*" if k == rep["kernels"] else ""
        t.add_row(k + mark, "-" if c["one_token_ms"] is None else f"{c['one_token_ms']:.1f} ms",
                  *[f"{c['cost'][str(w)]:.2f}" if str(w) in c["cost"] else "-" for w in shown])
    con = Console(highlight=False)
    con.print(t)
    ch = rep["choice"]
    if ch:
        con.print(f"kept: [bold]{ch['chosen']}[/bold] (* above), lower {ch['by']}: " +
                  ", ".join(f"{k} {ch[k]['score_ms']:.1f} ms" for k in ("torch", "onednn")))
    when = [c["measured_at"] for c in rep["curves"].values() if c.get("measured_at")]
    if when:
        age = (time.time() - min(when)) / 86400
        con.print(f"measured {age:.1f} days ago; cached under {api.costs.cache_root()} "
                  f"(re-measured after {api.costs.MAX_AGE_DAYS} days, or with --remeasure)")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HdError(f"{flag} takes comma-separated numbers, not '{text}'") from None


def _parse_shard(shard: Optional[str]) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise HdError(f"--shard must look like I/N (e.g. 0/4), not '{shard}'") from None
    if not (n >= 1 and 0 <= i < n):
        raise HdError(f"--shard {shard}: need 0 <= I < N")
    return i, n


def _print_header(header: dict, extra: Optional[dict] = None) -> None:
    t = Table(show_header=False)
    for k, v in {**header, **(extra or {})}.items():
        t.add_row(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
    Console(highlight=False).print(t)


@app.command("build-stats")
def build_stats(
    corpus: List[str] = typer.Argument(..., help="Files, globs or folders: jsonl, json, txt, parquet, "
                                       "csv, or a folder saved by `datasets`."),
    out: Path = typer.Option(..., "--out", "-o", help="The LMDB file to create."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Whose tokenizer to count with."),
    field: str = typer.Option("text", help="Record field holding the text."),
    with_prompt: bool = typer.Option(False, "--with-prompt", help="Prepend the `prompt` field."),
    min_n: int = typer.Option(1, "--min-n", help="Shortest key, in tokens."),
    max_n: int = typer.Option(4, "--max-n", help="Longest key, in tokens."),
    draft_len: int = typer.Option(1, "--draft-len", help="Continuation length stored per entry "
                                  "(1: next-token counts, drafted by a greedy walk; docs/stats-db.md)."),
    top_k: int = typer.Option(4, "--top-k", help="Continuations kept per key (0: all)."),
    min_count: int = typer.Option(2, "--min-count", help="Least count of a kept continuation."),
    shard: Optional[str] = typer.Option(None, help="Build shard I/N only (unpruned, for merge-stats)."),
    limit: Optional[int] = typer.Option(None, help="Read at most this many documents."),
    strict: bool = typer.Option(False, help="Fail on a malformed json line instead of skipping it."),
    num_proc: int = typer.Option(1, "--num-proc", help="Tokeniser processes."),
    chunk_tokens: int = typer.Option(4_000_000, "--chunk-tokens", help="Tokens counted in memory "
                                     "before spilling to disk (bounds memory)."),
    overwrite: bool = typer.Option(False, help="Replace an existing output."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Run the build as tasks of a Dask "
                                          "cluster: a scheduler address (tcp://host:8786) or local:N "
                                          "(N worker processes here); docs/stats-db.md."),
    tasks: Optional[int] = typer.Option(None, "--tasks", help="With --cluster: shard tasks (default: "
                                        "2 per worker)."),
    as_json: bool = typer.Option(False, "--json", help="Write the header and read report as JSON."),
):
    """Count n-gram continuations of a corpus into a statistics DB (LMDB)."""
    from tqdm import tqdm
    check_output_path(out, overwrite)
    params = dict(min_n=min_n, max_n=max_n, draft_len=draft_len, top_k=top_k, min_count=min_count)
    read_opts = dict(field=field, with_prompt=with_prompt, strict=strict)
    if cluster is not None:
        from .db import cluster as cluster_mod
        if shard is not None or limit is not None:
            raise HdError("--cluster splits the corpus itself: drop --shard and --limit")
        header, read = cluster_mod.build_stats(corpus, out, model, address=cluster, tasks=tasks,
                                               overwrite=overwrite, quiet=as_json, **read_opts, **params)
    else:
        bar = tqdm(unit=" tok", unit_scale=True, desc="counting", disable=as_json, mininterval=0.5)
        docs = 0

        def progress(n_docs: int, n_tokens: int) -> None:
            nonlocal docs
            docs += n_docs
            bar.update(n_tokens)
            bar.set_postfix(docs=docs, refresh=False)

        try:
            header, read = api.build_stats(corpus, out, model, limit=limit, shard=_parse_shard(shard),
                                           num_proc=num_proc, chunk_tokens=chunk_tokens,
                                           overwrite=overwrite, progress=progress, **read_opts, **params)
        finally:
            bar.close()
    if as_json:
        typer.echo(json.dumps({"path": str(out), "header": header, "read": read}))
        return
    for what, n in read.items():
        if n and what != "first_malformed":
            first = f" (first: {read['first_malformed']})" if what == "skipped_malformed" else ""
            Console(stderr=True, highlight=False, soft_wrap=True).print(
                Text.assemble(("warning: ", "yellow"), f"{n} records {what.replace('_', ' ')}{first}"))
    _print_header(header, {"file_bytes": out.stat().st_size})


@app.command("merge-stats")
def merge_stats(
    inputs: List[Path] = typer.Argument(..., help="Statistics DBs (e.g. the shards of one build)."),
    out: Path = typer.Option(..., "--out", "-o"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Default: the inputs' K (4 for shards)."),
    min_count: Optional[int] = typer.Option(None, "--min-count", help="Default: the inputs' (2 for shards)."),
    overwrite: bool = typer.Option(False),
    as_json: bool = typer.Option(False, "--json"),
):
    """Sum the counts of several statistics DBs and prune again. Each input's content digest is
    checked as it is read; the same DB twice, DBs of different kinds, and pruned DBs mixed with
    unpruned shards are refused (their sum would be wrong counts)."""
    from .db import statsdb
    check_output_path(out, overwrite)
    header = statsdb.merge([str(p) for p in inputs], out, top_k=top_k, min_count=min_count,
                           overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps({"path": str(out), "header": header}))
    else:
        _print_header(header, {"file_bytes": out.stat().st_size})


@app.command("build-model-db")
def build_model_db(
    out: Path = typer.Option(..., "--out", "-o", help="The LMDB file to create."),
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    prompts: Optional[Path] = typer.Option(None, help="jsonl with `prompt`, `turns` or `text` "
                                           "(default: sample_corpora/model_db_prompts.jsonl)."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.8, help="0 = greedy."),
    top_p: float = typer.Option(0.95, "--top-p"),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per forward pass "
                                   "(benchmarks/model_db_bench.py measured 1/4/8/16)."),
    seed: int = typer.Option(0),
    samples: Optional[Path] = typer.Option(None, help="Where raw generations are appended "
                                           "(default: OUT.samples.jsonl)."),
    resume: bool = typer.Option(False, help="Continue an interrupted sampling run."),
    from_samples: Optional[Path] = typer.Option(None, "--from-samples", help="Only index this "
                                                "samples file (no generation)."),
    min_n: int = typer.Option(1, "--min-n"),
    max_n: int = typer.Option(4, "--max-n"),
    top_k: int = typer.Option(4, "--top-k"),
    min_count: int = typer.Option(1, "--min-count", help="Least count kept (the samples are few)."),
    dtype: str = typer.Option("bf16", help="Sampling needs no bit-exactness, so the fast dtype "
                              "is the default here (fp16/fp32/auto also work)."),
    device: str = typer.Option("auto"),
    kernels: str = typer.Option("auto", help="auto|onednn|torch: auto keeps whichever of torch's "
                                "and oneDNN-packed kernels measures faster here (hd costs; docs/dtype.md)."),
    overwrite: bool = typer.Option(False),
    as_json: bool = typer.Option(False, "--json"),
):
    """Sample the target model on a prompt set and index what it wrote into a model DB."""
    from tqdm import tqdm
    from .engine import models
    from .db import modeldb
    api.check_seed(seed)
    check_output_path(out, overwrite)
    result = {"path": str(out)}
    params = dict(min_n=min_n, max_n=max_n, top_k=top_k, min_count=min_count)
    if from_samples is not None:
        tok = models.load_tokenizer(model)
        header = modeldb.index(from_samples, out, tok, model, overwrite=overwrite, **params)
    else:
        prompt_list, source = modeldb.load_prompts(prompts, num_prompts)
        samples = samples or out.with_name(out.name + ".samples.jsonl")
        if overwrite and not resume and samples.exists():
            samples.unlink()  # --overwrite starts the whole build afresh
        lm = api.load_model(model, dtype=dtype, device=device, kernels=kernels)
        bar = tqdm(total=len(prompt_list), unit=" prompts", desc="sampling", disable=as_json)
        last = {"done": 0}

        def progress(done: int, tokens: int) -> None:
            bar.update(done - last["done"])
            last["done"] = done
            bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")

        try:
            run = modeldb.sample(lm, prompt_list, samples, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, batch_size=batch_size,
                                 seed=seed, resume=resume, progress=progress)
        finally:
            bar.close()
        result["sampling"] = run
        sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                    "batch_size": batch_size, "seed": seed, "dtype": lm.dtype}
        header = modeldb.index(samples, out, lm.tokenizer, model, overwrite=overwrite,
                               header={"sampling": sampling, "prompt_source": source,
                                       "prompts": len(prompt_list)}, **params)
    result["header"] = header
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_header(header, {"file_bytes": out.stat().st_size})


db_app = typer.Typer(help="Inspect DBs.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("info")
def db_info(path: Path, as_json: bool = typer.Option(False, "--json"),
            verify: bool = typer.Option(False, "--verify", help="Also read every record and check "
                                        "the content digest (as `hd db verify`).")):
    """Print a DB's header and size figures (content_digest identifies its counts)."""
    from .db.stores import Store
    db = Store(path)
    # content_digest identifies the counts whatever the page layout or build time (a cluster
    # build and a local build of one corpus have the same one)
    info = {"header": db.header, "size": db.size_info(), "content_digest": db.header.get("content_digest")}
    if verify:
        info["verify"] = db.verify()
    if as_json:
        typer.echo(json.dumps(info))
    else:
        _print_header(db.header, db.size_info())
        if verify:
            _print_verify(info["verify"])
        else:
            Console(stderr=True, highlight=False).print(
                f"[dim]records not read: `hd db verify {path}` checks them against content_digest[/dim]")
    if verify and not info["verify"]["ok"]:
        raise typer.Exit(1)


def _print_verify(report: dict) -> None:
    con = Console(highlight=False, soft_wrap=True)
    if report["ok"]:
        stored = "matches the header" if report["header_digest"] else "(no digest in the header: built by an older hd; shapes and count checked)"
        con.print(f"{report['path']}: [green]OK[/green], {report['records']} records, content digest "
                  f"{report['content_digest']} {stored}")
    else:
        con.print(f"{report['path']}: [red]DAMAGED[/red]: " + "; ".join(report["problems"]))


@db_app.command("verify")
def db_verify(paths: List[Path] = typer.Argument(..., help="DB files to check."),
              as_json: bool = typer.Option(False, "--json")):
    """Read every record of each DB: shapes, key count and content digest against the header.
    Exit code 1 when any is damaged (2 when one cannot be opened at all)."""
    from .db.stores import Store
    reports = [Store(p).verify() for p in paths]
    if as_json:
        typer.echo(json.dumps({"ok": all(r["ok"] for r in reports), "dbs": reports}))
    else:
        for r in reports:
            _print_verify(r)
    if not all(r["ok"] for r in reports):
        raise typer.Exit(1)


@db_app.command("query")
def db_query(
    path: Path,
    text: str = typer.Option(..., "--text", help="The history whose continuation to look up."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Tokenizer (default: the DB's model)."),
    max_len: int = typer.Option(16, "--max-len", help="Longest draft shown."),
    min_prob: float = typer.Option(0.0, "--min-prob"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show which key of the text's end matches and what the DB would draft."""
    from .engine import models
    from .drafting import StatsDB
    from .db.stores import Store
    db = Store(path)
    tok = models.load_tokenizer(model or db.header.get("model", "smollm2-135m"))
    db.check_tokenizer(tok, model or db.header.get("model", ""))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise HdError("--text is empty")
    keys = []
    for n in range(min(db.max_n, len(ids)), db.min_n - 1, -1):
        got = db.get(ids[-n:])
        keys.append({"n": n, "key": tok.decode(ids[-n:]), "key_ids": ids[-n:], "found": got is not None,
                     "total": got[0] if got else 0,
                     "continuations": [{"text": tok.decode(c), "ids": c, "count": k}
                                       for c, k in (got[1] if got else [])]})
    draft = StatsDB(db, min_prob=min_prob).propose(ids, max_len, 1)
    result = {"keys": keys, "draft": tok.decode(draft[0]) if draft else "", "draft_ids": draft[0] if draft else []}
    if as_json:
        typer.echo(json.dumps(result))
        return
    con = Console(highlight=False)
    t = Table("n", "key", "total", "continuations (count)")
    for k in keys:
        conts = "  ".join(f"{c['text']!r} ({c['count']})" for c in k["continuations"]) if k["found"] else "-"
        t.add_row(str(k["n"]), repr(k["key"]), str(k["total"]), conts)
    con.print(t)
    con.print(Text.assemble("draft: ", (repr(result["draft"]), "magenta")))


def _calibration_prompts(lm, prompts: Optional[Path], count: int) -> list[list[int]]:
    """Token ids of the calibration prompts: a jsonl (field prompt, text or turns) or text file
    (one prompt per blank-line-separated block), else the first question of Spec-Bench's
    categories (round-robin) when its file is found."""
    texts = []
    if prompts is not None:
        try:
            raw = prompts.read_text(encoding="utf-8-sig")  # -sig: a BOM is not data
        except (OSError, UnicodeDecodeError) as exc:
            raise HdError(f"cannot read --prompts {prompts}: {exc}") from None
        if prompts.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                        texts.append(rec.get("prompt") or rec.get("text") or rec["turns"][0])
                    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                        raise HdError(f"{prompts}:{n}: need a JSON object with 'prompt', 'text' or 'turns'") from None
        else:
            texts = [b.strip() for b in raw.split("\n\n") if b.strip()]
    else:
        qs = specbench.select(specbench.load(specbench.find(None)), 1)
        texts = [q["turns"][0] for q in qs]
    if not texts:
        raise HdError(f"no prompts in {prompts}")
    return [api.encode_prompt(lm.tokenizer, t) for t in texts[:count]]


@app.command("plan")
def plan_cmd(
    draft_models: str = typer.Option(..., "--draft-models", help="Candidate draft models, smallest "
                                     "first (self:layers=K, self:int8, or models with the target's tokenizer)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="The target."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Calibration prompts (jsonl or "
                                           "text); default: Spec-Bench's first question per category."),
    count: int = typer.Option(6, "--count", help="Calibration prompts used."),
    tokens: int = typer.Option(64, "--tokens", help="Target tokens per prompt to read acceptance on."),
    t_max: int = typer.Option(12, "--t-max", help="Largest batch size T a level may get."),
    stats_db: List[Path] = typer.Option([], "--stats-db", help="Statistics DB for the DB level."),
    model_db: Optional[Path] = typer.Option(None, "--model-db", help="Model DB for the DB level."),
    no_db: bool = typer.Option(False, "--no-db", help="Plan without the DB level."),
    measure_top: int = typer.Option(3, "--measure-top", help="Run the best N hierarchies (and plain "
                                    "decoding) on the prompts and print measured beside predicted tokens/s."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens per measured run."),
    dtype: str = typer.Option("auto"),
    device: str = typer.Option("auto"),
    kernels: str = typer.Option("auto", help="auto|onednn|torch: auto keeps whichever of torch's "
                                "and oneDNN-packed kernels measures faster here (hd costs; docs/dtype.md)."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Save the chosen plan (for hd generate --plan)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure costs and acceptance, predict every hierarchy's speed, choose the fastest (DP)."""
    from .hsd import draft_models as draftmodels, planner as plan_mod
    from .engine.decode import Decoder
    err = Console(stderr=True, highlight=False)
    say = (lambda m: None) if as_json else (lambda m: err.print(f"[dim]{m}[/dim]"))
    if t_max < 1 or count < 1 or tokens < 2:
        raise HdError("--t-max and --count must be >= 1, --tokens >= 2")
    names = api.draft_model_names(draft_models)
    dbs = api.open_stats_dbs([str(p) for p in stats_db])
    mdb = api.open_stats_dbs([str(model_db)])[0] if model_db else None
    say(f"loading {model} ...")
    lm = api.load_model(model, dtype=dtype, device=device, kernels=kernels)
    for db in dbs + ([mdb] if mdb else []):
        db.check_tokenizer(lm.tokenizer, lm.name)
    layers = ["context"] + ["model"] * (mdb is not None) + ["stats"] * bool(dbs)
    cheap = api.cheap_verification(lm)

    def db_factory():
        return api.make_drafter(layers, cheap_verify=cheap, stats_dbs=dbs, model_db=mdb, candidates=1)
    ids = _calibration_prompts(lm, prompts, count)
    loaded = {}
    for n in names:
        say(f"loading draft {n} ...")
        loaded[n] = draftmodels.load(n, lm)
    say("measuring forward costs and acceptance ...")
    params, info = plan_mod.measure(lm, [loaded[n] for n in names], None if no_db else db_factory, ids,
                                    tokens=tokens, t_max=t_max, progress=say)
    best, best_v = plan_mod.dp(params, t_max)
    table = plan_mod.ranked(params, t_max)
    plain_tps = params.cost["target"](1) ** -1
    rows = [{"hierarchy": c.describe(), "chain": c.to_dict(), "predicted_tokens_per_second": v,
             "predicted_speedup": v * params.cost["target"](1)} for c, v in table]
    # the best N, plus the references: plain decoding and the best single drafting level
    single = [r for r in rows if len(r["chain"]["levels"]) + (r["chain"]["bottom"] == "db") == 1]
    plain_row = [r for r in rows if not r["chain"]["levels"] and r["chain"]["bottom"] == "none"]
    to_measure = []
    for r in rows[:measure_top] + single[:1] + plain_row:
        if r not in to_measure:
            to_measure.append(r)
    if measure_top > 0:
        api.warm_up(lm)
        for r in rows:
            r["single_level"] = r in single[:1]
        for r in to_measure:
            ch = r["chain"]
            if ch["levels"]:
                base = db_factory() if ch["bottom"] == "db" else None
                drafter = api.make_stack(lm, [lv["model"] for lv in ch["levels"]],
                                         [lv["T"] for lv in ch["levels"]], base, loaded=loaded)
            else:
                drafter = db_factory() if ch["bottom"] == "db" else None
            say(f"measuring {r['hierarchy']} ...")
            toks = secs = 0.0
            for p in ids:
                g = Decoder(lm.model, lm.eos_ids, drafter).generate(p, max_new_tokens)
                toks += g.stats.new_tokens
                secs += g.stats.wall_seconds
            r["measured_tokens_per_second"] = toks / secs
    assert abs(best_v - table[0][1]) < 1e-9 * max(1.0, best_v), "DP and enumeration disagree"
    result = {"kind": "hd-plan", "target": lm.name, "dtype": lm.dtype, "device": lm.device,
              "kernels": lm.kernels,
              "draft_models": names, "db_layers": [] if no_db else layers,
              # absolute: `hd generate --plan` opens these DBs from wherever it runs
              "stats_dbs": [str(p.resolve()) for p in stats_db],
              "model_db": str(model_db.resolve()) if model_db else None,
              "db_digests": {str(db.path.resolve()): db.header.get("content_digest")
                             for db in dbs + ([mdb] if mdb else [])},
              "chain": best.to_dict(), "hierarchy": best.describe(), "predicted_tokens_per_second": best_v,
              "plain_tokens_per_second_predicted": plain_tps, "t_max": t_max,
              "calibration": {"prompts": len(ids), **info,
                              "draft_params": {n: loaded[n].params for n in names}},
              "candidates": rows}
    if out_path is not None:
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out_path)
    if as_json:
        typer.echo(json.dumps(result))
        return
    t = Table(title=f"hierarchies for {lm.name} ({lm.dtype}, {lm.device}), best T per chain")
    for col in ("hierarchy", "predicted tok/s", "predicted speedup", "measured tok/s"):
        t.add_column(col, justify="left" if col == "hierarchy" else "right")
    for r in rows:
        m = r.get("measured_tokens_per_second")
        t.add_row(r["hierarchy"], f"{r['predicted_tokens_per_second']:.1f}", f"{r['predicted_speedup']:.2f}x",
                  "-" if m is None else f"{m:.1f}")
    con = Console(highlight=False)
    con.print(t)
    acc = "  ".join(f"{k} {v:.2f}" for k, v in info["accept"].items())
    con.print(f"acceptance: {acc}")
    con.print(f"chosen: [bold]{best.describe()}[/bold]"
              + (f"; saved to {out_path} (hd generate --plan {out_path})" if out_path else ""))


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against plain decoding and peers.")
app.add_typer(bench_app, name="bench")


def _bench_tables(summary: dict, meta: dict) -> Table:
    """The overall table, then speedup per category per method, over ar and over hf-ar."""
    methods = summary["methods"]
    hf = any("speedup_over_hf_ar" in f["overall"] for f in methods.values())
    t = Table(title=f"Spec-Bench · {meta['model']} · {meta['dtype']} · {meta['device']} · "
                    f"{meta['questions']} questions · {meta['max_new_tokens']} new tokens",
              caption="acc: mean accepted tokens per step · out: share of step time outside the "
                      "target's forward · differ: answers unlike ar's",
              box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ["method", "vs ar"] + ["vs hf-ar"] * hf + ["tok/s", "acc", "out", "differ", "accepted by layer"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "accepted by layer") else "right",
                     no_wrap=col == "method")
    for m, f in methods.items():
        o = f["overall"]
        differ = (f"{o['differ_from_ar']}/{o['questions']}" if "differ_from_ar" in o else "n/a (sampling)")
        share = " ".join(f"{LAYER_SHORT.get(k, k)}:{v['share_of_accepted']:.0%}"
                         for k, v in o["layers"].items() if v["accepted"])
        t.add_row(m, f"{o['speedup']:.2f}x", *([f"{o['speedup_over_hf_ar']:.2f}x"] if hf else []),
                  f"{o['tokens_per_second']:.1f}",
                  "-" if o["mean_accepted_tokens"] is None else f"{o['mean_accepted_tokens']:.2f}",
                  "-" if o["overhead_share"] is None else f"{o['overhead_share']:.1%}", differ, share)
    cats = list(next(iter(methods.values()))["categories"])
    grid = Table.grid()
    grid.add_row(t)
    for key, base in [("speedup", "ar")] + [("speedup_over_hf_ar", "hf-ar")] * hf:
        c = Table(title=f"speedup over {base} by category", box=box.SIMPLE_HEAD, pad_edge=False)
        c.add_column("method")
        for cat in cats:
            c.add_column(specbench.SHORT_NAMES.get(cat, cat), justify="right")
        for m, f in methods.items():
            c.add_row(m, *[f"{f['categories'][cat][key]:.2f}x" for cat in cats])
        grid.add_row(c)
    return grid


def _bench_chart(summary: dict, meta: dict, path: Path) -> None:
    """Grouped bars: speedup per category (and overall) per method, over ar and over hf-ar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = summary["methods"]
    cats = list(next(iter(methods.values()))["categories"]) + ["overall"]
    panels = [("speedup", "ar")]
    if any("speedup_over_hf_ar" in f["overall"] for f in methods.values()):
        panels.append(("speedup_over_hf_ar", "hf-ar (transformers' generate, stock model)"))
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.4 * len(cats)), 4.2 * len(panels)),
                             squeeze=False)
    for ax, (key, base) in zip(axes[:, 0], panels):
        for i, (m, f) in enumerate(methods.items()):
            vals = [f["categories"][c][key] if c != "overall" else f["overall"][key] for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats))], cats, rotation=20)
        ax.set_ylabel(f"speedup over {base.split(' ')[0]}")
        ax.set_title(f"Spec-Bench, {meta['model']} ({meta['dtype']}, {meta['device']}), "
                     f"{meta['max_new_tokens']} new tokens: speedup over {base}", fontsize=10)
        ax.legend(fontsize=8, ncol=min(len(methods), 5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@bench_app.command("spec-bench")
def bench_spec_bench(
    data: Optional[Path] = typer.Option(None, "--data", help="Spec-Bench question.jsonl (default: "
                                        "data/spec_bench/question.jsonl here or under ../shared/)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    methods: Optional[str] = typer.Option(None, "--methods",
                                help="Comma-separated, 'ar' included (default: ar, context, stats and "
                                "model where their DBs are given, hd, hf-ar, hf-pld, suffix where installed). Known: " + "; ".join(
                                    f"{k}: {v}" for k, v in bench.METHOD_HELP.items())),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per category (default: all)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated (default: all)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy (exactness is checked only then)."),
    seed: int = typer.Option(0, help="Seed for sampling."),
    stats_db: List[Path] = typer.Option([], "--stats-db", help="Statistics DB (repeatable)."),
    model_db: Optional[Path] = typer.Option(None, "--model-db", help="Model DB."),
    dtype: str = typer.Option("auto", help="auto|bf16|fp16|fp32 (auto: fp32 on CPU, bf16 on CUDA)."),
    device: str = typer.Option("auto", help="auto|cpu|cuda."),
    kernels: str = typer.Option("auto", help="auto|onednn|torch: auto keeps whichever of torch's "
                                "and oneDNN-packed kernels measures faster here (hd costs; docs/dtype.md)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write summary.json, answers/<method>.jsonl "
                                           "(Spec-Bench's answer schema) and speedup.png here."),
    as_json: bool = typer.Option(False, "--json", help="Write the summary as JSON to stdout."),
):
    """Run Spec-Bench with several methods on one model, interleaved, and report speedups."""
    from .bench import specbench
    if max_new_tokens < 1:
        raise HdError(f"--max-new-tokens must be >= 1, not {max_new_tokens}")
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    try:
        sampling = Sampling(temperature=temperature)
    except ValueError as exc:
        raise HdError(f"invalid sampling option: {exc}") from None
    api.check_seed(seed)
    if methods is None:
        from .drafting import suffix
        names = [m for m in bench.DEFAULT_METHODS
                 if (m != "stats" or stats_db) and (m != "model" or model_db)
                 and (m != "suffix" or suffix.available())]
    else:
        names = [m.strip() for m in methods.split(",") if m.strip()]
    bench.check_methods(names)
    path = specbench.find(data)
    cats = [c.strip() for c in categories.split(",")] if categories else None
    questions = specbench.select(specbench.load(path), limit, cats)
    dbs = api.open_stats_dbs([str(p) for p in stats_db])
    mdb = api.open_stats_dbs([str(model_db)])[0] if model_db else None
    err = Console(stderr=True, highlight=False)
    if not as_json:
        err.print(f"[dim]loading {model} ...[/dim]")
    lm = api.load_model(model, dtype=dtype, device=device, kernels=kernels)
    for db in dbs + ([mdb] if mdb else []):
        db.check_tokenizer(lm.tokenizer, lm.name)
    runners = bench.make_runners(lm, names, dbs, mdb)
    from tqdm import tqdm
    # tqdm, not a rich live display: progress must show when stderr is a file or a pipe too
    with tqdm(total=len(questions) * len(runners), desc="warming up", unit=" answers", file=sys.stderr,
              disable=as_json, mininterval=1.0) as bar:
        def progress(method, q):
            bar.set_description(f"{q['category']} · {method}")
            bar.update()
        results = bench.run(lm, questions, runners, max_new_tokens, sampling, seed, progress)
    summary = bench.summarize(results, greedy=sampling.greedy)
    meta = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
            "kernels": lm.kernels,
            "data": str(path), "questions": len(questions), "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "stats_dbs": [str(p) for p in stats_db],
            "model_db": str(model_db) if model_db else None, "machine": bench.machine(),
            "kernel_choice": lm.info.get("kernel_choice"), "methods_run": names}
    if "suffix" in names:
        from .drafting import suffix
        meta["suffix"] = suffix.SuffixDrafter(None).settings()
    report = {**meta, "methods": summary}
    if out_dir is not None:
        bench.save(out_dir, summary, results, meta, lm.name)
        _bench_chart(report, meta, out_dir / "speedup.png")
    if as_json:
        typer.echo(json.dumps(report))
        return
    Console(highlight=False).print(_bench_tables(report, meta))
    if out_dir is not None:
        err.print(f"wrote {out_dir}/summary.json, {out_dir}/answers/*.jsonl, {out_dir}/speedup.png")


@bench_app.command("report")
def bench_report(
    run_dir: Path = typer.Argument(..., help="A folder written by `hd bench spec-bench --out`."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Re-render a saved Spec-Bench run: the tables, and speedup.png again."""
    f = run_dir / "summary.json"
    try:
        report = json.loads(f.read_text())
        meta = {k: report[k] for k in ("model", "dtype", "device", "questions", "max_new_tokens")}
        report["methods"]
    except FileNotFoundError:
        raise HdError(f"{f} not found: pass a folder written by `hd bench spec-bench --out DIR`") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HdError(f"{f} is not an hd bench summary ({exc})") from None
    if as_json:
        typer.echo(json.dumps(report))
        return
    _bench_chart(report, meta, run_dir / "speedup.png")
    Console(highlight=False).print(_bench_tables(report, meta))


# errno values that mean "the disk/file system refused the write": a user-fixable condition
_DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES}


def _disk_error(exc: BaseException) -> Optional[str]:
    """A one-line message for a write refused by the disk, or None for anything else."""
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return (f"cannot write{where}: {os.strerror(exc.errno)}. Nothing was replaced: outputs are "
                "written to a temporary file and renamed only when complete; free space or choose "
                "another output path")
    text = str(exc)
    if type(exc).__module__ == "lmdb" and any(k in text for k in ("No space", "too large", "Read-only", "Disk quota")):
        return (f"cannot write the DB: {text.splitlines()[0]}. Nothing was replaced; free space or "
                "choose another output path")
    return None


def _fail(message: str, code: int = 2) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        Text.assemble(("error: ", "red"), " ".join(message.split())))  # one line, always
    sys.exit(code)


def main() -> None:
    # click's exceptions, wherever this typer takes click from (recent ones vendor it)
    cx = sys.modules[typer.BadParameter.__module__]
    no_args = getattr(cx, "NoArgsIsHelpError", ())
    try:
        # standalone_mode=False: click hands usage errors to us instead of printing its boxed
        # multi-line form, so they are one line like every other error
        code = app(standalone_mode=False)
    except no_args as exc:  # bare `hd` or `hd db`: the help (rich has printed it already)
        exc.show()
        sys.exit(exc.exit_code)
    except cx.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "hd"
        _fail(f"{exc.format_message()} (see `{where} --help`)", exc.exit_code)
    except cx.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except typer.Abort:
        _fail("interrupted", 130)
    except HdError as exc:
        _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - only disk refusals are turned into one line
        msg = _disk_error(exc)
        if msg is None:
            raise
        _fail(msg)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

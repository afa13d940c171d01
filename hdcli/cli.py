"""`hd`: the command line, a thin layer over the Python API (hdcli/api.py and each command's function
in its package).

The decoding options are DecodingConfig's fields (hdcli/config.py) and `hd serve`'s own are
ServeOptions' (hdcli/serve/options.py): each is declared once there, and a command here names
the fields it takes (hdcli/flags.py makes their options). A command's options of its own work
(build-stats' counting, a benchmark's data) are declared with the command, named apart from
the decoding options: --min-key, --max-key, --continuation-len, --keep (their older spellings
--min-n, --max-n, --draft-len, --top-k still taken). What a command shows a person is
hdcli/show.py's. Every error the user can fix is an HdError: printed as one line on stderr,
exit code 2. Ctrl-C and SIGTERM end any command at once, in one line (hdcli/interrupts.py).
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m hdcli.cli`: a signal during the imports below ends hd cleanly too
    from hdcli import interrupts
    interrupts.install()

import dataclasses
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from . import __version__, interrupts, show
from .commands import db as db_commands
from .commands import generate as generate_commands
from .commands import plan as plan_commands
from .config import DecodingConfig
from .db.atomic import check_output_path
from .db.modeldb import SAMPLE_TOP_P
from .engine import environment, local_models
from .engine.cost_report import cost_report
from .engine.loader import DEFAULT_MODEL
from .errors import HdError, disk_error
from .cli_bench import bench_app
from .flags import MODEL, groups, takes
from .serve.options import ServeOptions

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hd: lossless speculative decoding from a hierarchy of drafting sources.")


def _version(value: bool):
    if value:
        typer.echo(f"hd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    pass


@app.command()
@takes(DecodingConfig, groups(), into="cfg", config_file=True)
def generate(
    cfg: DecodingConfig,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="The answer is JSON valid "
                                               "under this JSON Schema file (docs/structured.md)."),
    json_object: bool = typer.Option(False, "--json-object", help="The answer is a JSON object."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="The answer follows this grammar "
                                           "file: Lark (.lark), GBNF (.gbnf) or a regex (.regex)."),
    grammar_format: Optional[str] = typer.Option(None, "--grammar-format", help="lark|gbnf|regex: "
                                                 "the --grammar file's format where its suffix does not say."),
    prediction: Optional[Path] = typer.Option(None, "--prediction", help="A file the answer is "
                                              "expected to repeat much of (the text being edited): drafted first."),
    compare: bool = typer.Option(False, help="Also run plain decoding and report speedup and identity."),
    as_json: bool = typer.Option(False, "--json", help="Write one JSON object to stdout, nothing else."),
    color: bool = typer.Option(True, "--color/--no-color", help="Colour drafted tokens by layer."),
):
    """Generate text with lossless speculative decoding and report per-layer statistics."""
    text = generate_commands.read_prompt(prompt, prompt_file)
    out = Console(highlight=False, no_color=not color, soft_wrap=True)

    def on_text(piece: str, layer: Optional[str]) -> None:
        out.print(piece, end="", style=show.layer_style(layer), markup=False)

    output = generate_commands.output_from_files(json_schema, json_object, grammar, grammar_format, prediction)
    rep = generate_commands.generate_report(cfg, text, compare=compare, on_text=None if as_json else on_text,
                                            on_status=show.status(as_json), output=output)
    if as_json:
        typer.echo(json.dumps(rep.data))
    else:
        show.generate(out, rep)
    if rep.data.get("learn_error"):   # after the answer: a full disk loses the learning, not the answer
        raise HdError(rep.data["learn_error"])


@app.command()
@takes(DecodingConfig, groups(leave_out=["logprobs"]), into="cfg", config_file=True)
@takes(ServeOptions, groups(cls=ServeOptions), into="options")
def serve(cfg: DecodingConfig, options: ServeOptions,
          as_json: bool = typer.Option(False, "--json", help="At exit, write one JSON object (what was "
                                       "served) to stdout.")):
    """Serve the model over an OpenAI-compatible HTTP API (docs/serve.md)."""
    from .serve.server import Server
    say = show.status(False)
    given = {**dataclasses.asdict(options), "api_key": _api_keys(options.api_key), "name": options.name or cfg.model}
    server = Server(cfg, on_status=say, **given)
    show.serve_banner(server, server.bind(), say)
    summary = server.run()
    show.serve_stopped(say, summary, server.forced_by, cfg.learn, quiet=as_json)
    if as_json:
        typer.echo(json.dumps(summary))
    if server.forced_by is not None:
        raise typer.Exit(128 + server.forced_by)


def _api_keys(given: List[str]) -> List[str]:
    """--api-key values, HD_API_KEY first; set but empty is a mistake, not an open server."""
    key = environment.api_key()
    if key is None:
        return list(given)
    if not key.strip():
        raise HdError("HD_API_KEY is set but empty: give a key, or unset it for an open server")
    return [key] + list(given)


@app.command("models")
def models_cmd(as_json: bool = typer.Option(False, "--json", help="Write the list as JSON.")):
    """List the GGUF models in Ollama's and LM Studio's stores, by the --model name that runs them."""
    rep = local_models.report()
    if as_json:
        show.warnings(rep["warnings"])
        typer.echo(json.dumps(rep))
    else:
        show.local_models(rep)


@app.command("costs")
@takes(DecodingConfig, MODEL, into="cfg", kernels={"help": "auto shows both CPU kernel sets and which one is kept."})
def costs_cmd(
    cfg: DecodingConfig,
    remeasure: bool = typer.Option(False, "--remeasure", help="Drop the cached curves and measure again."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show the measured forward cost by width (what caps draft trees)."""
    rep = cost_report(cfg.model, dtype=cfg.dtype, device=cfg.device, kernels=cfg.kernels, remeasure=remeasure,
                      invariant=cfg.invariant)
    if as_json:
        typer.echo(json.dumps(rep))
    else:
        show.costs(rep)


@app.command("build-stats")
def build_stats(
    corpus: List[str] = typer.Argument(..., help="Files, globs or folders: jsonl, json, txt, parquet, "
                                       "csv, or a folder saved by `datasets`."),
    out: Path = typer.Option(..., "--out", "-o", help="The LMDB file to create."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Whose tokenizer to count with."),
    field: str = typer.Option("text", help="Record field holding the text."),
    with_prompt: bool = typer.Option(False, "--with-prompt", help="Prepend the `prompt` field."),
    min_n: int = typer.Option(1, "--min-key", "--min-n", help="Shortest key, in tokens."),
    max_n: int = typer.Option(4, "--max-key", "--max-n", help="Longest key, in tokens."),
    draft_len: int = typer.Option(1, "--continuation-len", "--draft-len", help="Tokens of each stored "
                                  "continuation (1: next-token counts, drafted by a greedy walk; docs/stats-db.md)."),
    top_k: int = typer.Option(4, "--keep", "--top-k", help="Continuations kept per key (0: all)."),
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
    check_output_path(out, overwrite)
    params = dict(min_n=min_n, max_n=max_n, draft_len=draft_len, top_k=top_k, min_count=min_count,
                  field=field, with_prompt=with_prompt, strict=strict, overwrite=overwrite)
    if cluster is not None:
        from .db import cluster as cluster_mod
        if shard is not None or limit is not None:
            raise HdError("--cluster splits the corpus itself: drop --shard and --limit")
        header, read = cluster_mod.build_stats(corpus, out, model, address=cluster, tasks=tasks, quiet=as_json,
                                               **params)
    else:
        with show.bar(as_json, unit=" tok", unit_scale=True, desc="counting", mininterval=0.5) as made:
            header, read = db_commands.build_stats(corpus, out, model, limit=limit,
                                                   shard=db_commands.parse_shard(shard),
                                                   num_proc=num_proc, chunk_tokens=chunk_tokens,
                                                   progress=show.counted(made), **params)
    if as_json:
        typer.echo(json.dumps({"path": str(out), "header": header, "read": read}))
        return
    show.read_warnings(read)
    show.header(header, {"file_bytes": out.stat().st_size})


@app.command("merge-stats")
def merge_stats(
    inputs: List[Path] = typer.Argument(..., help="Statistics DBs (e.g. the shards of one build)."),
    out: Path = typer.Option(..., "--out", "-o"),
    top_k: Optional[int] = typer.Option(None, "--keep", "--top-k", help="Continuations kept per key. "
                                        "Default: the inputs' (4 for shards)."),
    min_count: Optional[int] = typer.Option(None, "--min-count", help="Default: the inputs' (2 for shards)."),
    overwrite: bool = typer.Option(False),
    allow_same_sources: bool = typer.Option(False, "--allow-same-sources", help="Sum inputs counted "
                                            "from the same corpus file anyway (its documents then "
                                            "count twice)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Sum the counts of several statistics DBs and prune again. Each input's content digest is
    checked as it is read; the same DB twice, DBs of different kinds, pruned DBs mixed with
    unpruned shards, and builds of the same corpus file that are not shards of one build are
    refused (their sum would be wrong counts)."""
    from .db import statsdb
    check_output_path(out, overwrite)
    header = statsdb.merge([str(p) for p in inputs], out, top_k=top_k, min_count=min_count,
                           overwrite=overwrite, allow_same_sources=allow_same_sources)
    if as_json:
        typer.echo(json.dumps({"path": str(out), "header": header}))
    else:
        show.header(header, {"file_bytes": out.stat().st_size})


@app.command("build-model-db")
@takes(DecodingConfig, ["model", "max_new_tokens", "temperature", "top_p", "seed", *MODEL[1:]], into="cfg",
       temperature={"help": "0 = greedy (the default: a greedy run verifies the target's greedy answers); > 0 samples."},
       top_p={"default": SAMPLE_TOP_P}, seed={"default": 0, "cli": int, "help": None},
       dtype={"help": "The dtype you decode with (auto, as `hd generate`): the DB then holds exactly the answers "
                      "your runs will verify."}, device={"help": None})
def build_model_db(
    cfg: DecodingConfig,
    out: Path = typer.Option(..., "--out", "-o", help="The LMDB file to create."),
    prompts: Optional[List[Path]] = typer.Option(None, help="jsonl with `prompt`, `turns` or `text`; "
                                                 "repeat for several files (default: the 320 prompts shipped "
                                                 "with hd, hdcli/data/model_db_prompts.jsonl). Prompts like "
                                                 "your users' make the DB draft best."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per forward pass "
                                   "(benchmarks/model_db_bench.py measured 1/4/8/16)."),
    samples: Optional[Path] = typer.Option(None, help="Where raw generations are appended "
                                           "(default: OUT.samples.jsonl)."),
    resume: bool = typer.Option(False, help="Continue an interrupted sampling run."),
    from_samples: Optional[Path] = typer.Option(None, "--from-samples", help="Only index this "
                                                "samples file (no generation)."),
    min_n: int = typer.Option(1, "--min-key", "--min-n", help="Shortest key, in tokens."),
    max_n: int = typer.Option(4, "--max-key", "--max-n", help="Longest key, in tokens."),
    top_k: int = typer.Option(4, "--keep", "--top-k", help="Continuations kept per key."),
    min_count: int = typer.Option(1, "--min-count", help="Least count kept (the samples are few)."),
    overwrite: bool = typer.Option(False),
    as_json: bool = typer.Option(False, "--json"),
):
    """Sample the target model on a prompt set and index what it wrote into a model DB."""
    with show.bar(as_json or from_samples is not None, unit=" prompts", desc="sampling") as made:
        result = db_commands.build_model_db(out, cfg, prompts=prompts, num_prompts=num_prompts,
                                            batch_size=batch_size, samples=samples, resume=resume,
                                            from_samples=from_samples, overwrite=overwrite,
                                            progress=show.sampled(made), min_n=min_n, max_n=max_n,
                                            top_k=top_k, min_count=min_count)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        show.header(result["header"], {"file_bytes": out.stat().st_size})


db_app = typer.Typer(help="Inspect DBs.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("info")
def db_info(path: Path, as_json: bool = typer.Option(False, "--json"),
            verify: bool = typer.Option(False, "--verify", help="Also read every record and check "
                                        "the content digest (as `hd db verify`).")):
    """Print a DB's header and size figures (content_digest identifies its counts)."""
    info = db_commands.db_info(path, verify)
    if as_json:
        typer.echo(json.dumps(info))
    else:
        show.db_info(path, info)
    if verify and not info["verify"]["ok"]:
        raise typer.Exit(1)


@db_app.command("verify")
def db_verify(paths: List[Path] = typer.Argument(..., help="DB files to check."),
              as_json: bool = typer.Option(False, "--json")):
    """Read every record of each DB: shapes, entry lengths, token ids against the vocabulary, key
    count and content digest against the header, and the header's fields. Exit code 1 when any is
    damaged (2 when one cannot be opened at all)."""
    from .db.stores import verify_file
    reports = [verify_file(p) for p in paths]
    if as_json:
        typer.echo(json.dumps({"ok": all(r["ok"] for r in reports), "dbs": reports}))
    else:
        for r in reports:
            show.verify(r)
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
    result = db_commands.db_query(path, text, model, max_len=max_len, min_prob=min_prob)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        show.db_query(result["keys"], result)


@app.command("plan")
@takes(DecodingConfig, [*MODEL, "stats_dbs", "model_db"], into="cfg", model={"help": "The target."},
       dtype={"help": None}, device={"help": None}, stats_dbs={"help": "Statistics DB for the DB level."},
       model_db={"help": "Model DB for the DB level."})
def plan_cmd(
    cfg: DecodingConfig,
    draft_models: str = typer.Option(..., "--draft-models", help="Candidate draft models, smallest "
                                     "first (self:blocks=K, self:int8, or models with the target's tokenizer)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Calibration prompts (jsonl or "
                                           "text); default: Spec-Bench's first question per category."),
    count: int = typer.Option(6, "--count", help="Calibration prompts used."),
    tokens: int = typer.Option(64, "--tokens", help="Target tokens per prompt to read acceptance on."),
    t_max: int = typer.Option(12, "--t-max", help="Largest batch size T a level may get."),
    no_db: bool = typer.Option(False, "--no-db", help="Plan without the DB level."),
    measure_top: int = typer.Option(3, "--measure-top", help="Run the best N hierarchies (and plain "
                                    "decoding) on the prompts and print measured beside predicted tokens/s."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens per measured run."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Save the chosen plan (for hd generate --plan)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure costs and acceptance, predict every hierarchy's speed, choose the fastest (DP)."""
    result = plan_commands.plan(cfg, draft_models, prompts=prompts, count=count, tokens=tokens, t_max=t_max,
                                no_db=no_db, measure_top=measure_top, max_new_tokens=max_new_tokens,
                                out_path=out_path, on_status=show.status(as_json))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        show.plan(result, out_path)


app.add_typer(bench_app, name="bench")


def _fail(message: str, code: int = 2) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        Text.assemble(("error: ", "red"), " ".join(message.split())))  # one line, always
    return code


def _finish_layout_cache() -> None:
    """A first start's layout cache (engine/model/layouts.py) still being written: waited for with
    a bar, as the process would wait silently at exit; Ctrl-C abandons it (the next start writes
    it). Nothing where no model was loaded."""
    layouts = sys.modules.get("hdcli.engine.model.layouts")
    if layouts is not None:
        try:
            layouts.wait(progress=True)
        except KeyboardInterrupt:
            raise typer.Abort() from None


def _run() -> int:
    """The command's exit code, its errors said in one line."""
    # click's exceptions, wherever this typer takes click from (recent ones vendor it)
    cx = sys.modules[typer.BadParameter.__module__]
    no_args = getattr(cx, "NoArgsIsHelpError", ())
    try:
        # standalone_mode=False: click hands usage errors to us instead of printing its boxed
        # multi-line form, so they are one line like every other error
        code = app(standalone_mode=False)
    except no_args as exc:  # bare `hd` or `hd db`: the help (rich has printed it already)
        exc.show()
        return exc.exit_code
    except cx.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "hd"
        return _fail(f"{exc.format_message()} (see `{where} --help`)", exc.exit_code)
    except cx.ClickException as exc:
        return _fail(exc.format_message(), exc.exit_code)
    except typer.Abort:
        return _fail("interrupted", 130)
    except HdError as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - only disk refusals are turned into one line
        msg = disk_error(exc)
        if msg is None:
            raise
        return _fail(msg)
    return code if isinstance(code, int) else 0


def main() -> None:
    previous = interrupts.install()   # the console script's entry (hdcli/__main__.py) did it before the imports
    try:
        code = _run()
        try:   # on every path: the writer is waited for by the interpreter otherwise, silently
            _finish_layout_cache()
        except typer.Abort:
            code = _fail("interrupted", 130)
        interrupts.finish()
    finally:
        interrupts.restore(previous)
    sys.exit(code)


if __name__ == "__main__":
    interrupts.run(main)

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
from rich.markup import escape
from rich.text import Text

from . import __version__, api, bench
from . import config as config_mod
from .bench import report as bench_report
from .bench import agents as bench_agents_mod
from .config import DEFAULT_CANDIDATES, DEFAULT_POLICY, DecodingConfig
from .db.stores import check_output_path
from .drafting import registry
from .errors import HdError

KERNELS_HELP = ("auto|gguf|gguf-int8|onednn|torch (int4: an alias of gguf). auto: a GGUF's own blocks where "
                "hd has a kernel for their type, by int8 activations (gguf-int8) where this CPU has AVX512-VNNI "
                "and measured them faster (once, cached), else by bf16 ones (gguf); else oneDNN-packed dense "
                "layers where oneDNN is usable, else torch's (docs/dtype.md).")
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


def _read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> str:
    if prompt is not None and prompt_file is not None:
        raise HdError("pass either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8-sig")   # a BOM is no part of the prompt
        except (OSError, UnicodeDecodeError) as exc:
            raise HdError(f"cannot read --prompt-file {prompt_file}: {exc}") from None
    if prompt is None:
        raise HdError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompt


GRAMMAR_SUFFIXES = {".lark": "lark", ".gbnf": "gbnf", ".regex": "regex", ".re": "regex"}


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise HdError(f"cannot read {flag} {path}: {exc}") from None


def _output_spec(json_schema: Optional[Path], json_object: bool, grammar: Optional[Path],
                 grammar_format: Optional[str], prediction: Optional[Path]) -> api.OutputSpec:
    """hd generate's grammar and prediction flags as one api.OutputSpec (files read here)."""
    given = [f for f, v in (("--json-schema", json_schema), ("--json-object", json_object),
                            ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise HdError(f"pass one of {', '.join(given)}: an answer follows one grammar")
    if grammar_format is not None and grammar is None:
        raise HdError("--grammar-format goes with --grammar FILE")
    kind, source, origin = None, None, "the grammar"
    if json_schema is not None:
        kind, source, origin = "json_schema", _read_text(json_schema, "--json-schema"), f"--json-schema {json_schema}"
    elif json_object:
        kind, origin = "json_object", "--json-object"
    elif grammar is not None:
        kind = grammar_format or GRAMMAR_SUFFIXES.get(grammar.suffix.lower())
        if kind not in ("lark", "gbnf", "regex"):
            raise HdError(f"--grammar {grammar}: say its format with --grammar-format lark|gbnf|regex "
                          f"(its suffix {grammar.suffix or '(none)'!r} does not)")
        source, origin = _read_text(grammar, "--grammar"), f"--grammar {grammar}"
    text = _read_text(prediction, "--prediction") if prediction is not None else None
    return api.OutputSpec(kind, source, text, origin, f"--prediction {prediction}")


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


# `hd generate` options that are DecodingConfig fields under another name
_PARAM_OF_FIELD = {"stats_dbs": "stats_db"}
DTYPE_HELP = ("auto|bf16|fp16|fp32. auto: bf16 for a GGUF, on CUDA and on a CPU with native bf16; "
              "else fp32. hd's own forward runs in bf16 or fp32 (docs/dtype.md).")
INVARIANT_HELP = ("auto|on|off: the M-invariant forward, in which every verified row is bit-identical "
                  "to a one-token forward (auto: where it holds on this machine; docs/dtype.md).")


def _config(ctx: typer.Context, config_file: Optional[Path], **fields) -> DecodingConfig:
    """The run's DecodingConfig from the command line. With --config FILE: the file's, with the
    options given on the command line taking precedence."""
    base = DecodingConfig.from_file(config_file) if config_file is not None else None
    given = {}
    for name, value in fields.items():
        source = ctx.get_parameter_source(_PARAM_OF_FIELD.get(name, name))
        if base is None or getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP"):
            given[name] = value
    return DecodingConfig.from_dict({**(base.to_dict() if base else {}), **given}, where="options")


def _run_config(ctx: typer.Context, params: dict) -> DecodingConfig:
    """_config from a command's _RUN options (its locals(): `hd generate`, `hd serve`)."""
    inv = {v: k for k, v in _PARAM_OF_FIELD.items()}
    return _config(ctx, params["config"], **{inv.get(n, n): params[n] for n in _RUN if n != "config"})


def _status(as_json: bool):
    """Where progress and warnings go: dim lines on stderr, nothing under --json."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(message: str) -> None:
        if message.startswith("warning:"):
            err.print(Text.assemble(("warning:", "yellow"), message[len("warning:"):]))
        else:
            err.print(Text(message, style="dim"))
    return (lambda m: None) if as_json else say


_ALWAYS = [n for n, spec in registry.LAYERS.items() if spec.in_default(registry.LayerInputs())]
_DEFAULT_LAYERS_HELP = (", ".join(_ALWAYS) + ", then " +
                        " and ".join(n for n in registry.LAYERS if n not in _ALWAYS) + " when their DBs are given")


# Options of a run, shared by `hd generate` and `hd serve` (typer reads each default when it
# builds a command, so one OptionInfo can serve both).
_RUN = {
    "config": typer.Option(None, "--config", help="A run's configuration (JSON): a "
    "bare one, the --json output of a run (its \"config\"), or "
    "a plan from `hd plan --out`. Options given here override it."),
    "model": typer.Option("smollm2-135m", "--model", "-m",
    help="Bundled name, .gguf file, model folder or Hugging Face id."),
    "max_new_tokens": typer.Option(256, "--max-new-tokens", "-n"),
    "temperature": typer.Option(0.0, help="0 = greedy."),
    "top_p": typer.Option(1.0, "--top-p"),
    "top_k": typer.Option(0, "--top-k", help="0 = no top-k truncation."),
    "seed": typer.Option(None, help="Seed for sampling."),
    "frequency_penalty": typer.Option(0.0, "--frequency-penalty", help="OpenAI's, -2..2: lowers a "
    "token's logit by this times its count in the output so far."),
    "presence_penalty": typer.Option(0.0, "--presence-penalty", help="OpenAI's, -2..2: lowers the "
    "logit of every token already in the output by this."),
    "logit_bias": typer.Option([], "--logit-bias", help="TOKEN_ID=BIAS added to that token's logit "
    "(-100..100; repeatable)."),
    "chat": typer.Option(True, "--chat/--raw", help="Apply the model's chat template or not."),
    "system": typer.Option(None, help="System message for the chat template."),
    "stop": typer.Option([], "--stop", help="Stop string (repeatable)."),
    "layers": typer.Option(None, help=f"Drafting layers, most local first, comma-separated "
    f"({', '.join(registry.names())}); 'none' for plain decoding. "
    f"Default: {_DEFAULT_LAYERS_HELP}."),
    "policy": typer.Option(DEFAULT_POLICY, help="How layers share a step: first-hit (first "
    "layer that matches), fill (slots in layer order), fill-tracked (fill, trees cut by each "
    "layer's acceptance in this request), adaptive (layers ordered by it too)."),
    "candidates": typer.Option(DEFAULT_CANDIDATES, "--candidates", "-C", help="Most "
    "candidate continuations per step, verified as one token tree "
    "(1: a single chain)."),
    "model_db": typer.Option(None, "--model-db", help="Model DB from `hd build-model-db`."),
    "learn": typer.Option(False, "--learn", help="Add what was generated to the model DB."),
    "stats_db": typer.Option([], "--stats-db", help="Statistics DB from `hd build-stats` "
    "(repeatable; asked in the order given)."),
    "stats_min_prob": typer.Option(None, "--stats-min-prob", help="Least estimated "
    "probability of a stats/model draft (default 0.2 fp32, 0.1 bf16)."),
    "stats_min_expected": typer.Option(None, "--stats-min-expected", help="Least "
    "expected accepted tokens of a stats/model draft "
    "(default 1.0 fp32, 0 bf16)."),
    "draft_len": typer.Option("16", "--draft-len", help="Most tokens per candidate: a number, "
    "or per layer as context=16,model=8,stats=8."),
    "min_n": typer.Option(None, "--min-n", help="Shortest n-gram the context DB "
    "matches (default: 2 in fp32, 1 in bf16/fp16)."),
    "max_n": typer.Option(4, "--max-n", help="Longest n-gram the context DB matches."),
    "draft_models": typer.Option(None, "--draft-models", help="Draft models, smallest "
    "first, comma-separated, stacked above the DB layers "
    "(self:layers=K, self:int8, or any model with the "
    "target's tokenizer)."),
    "level_tokens": typer.Option(None, "--level-tokens", help="T per draft model: tokens "
    "a level holds before handing them up (e.g. 2,6)."),
    "no_db": typer.Option(False, "--no-db", help="With --draft-models: no DB level; the smallest "
    "model drafts alone."),
    "plan": typer.Option(None, "--plan", help="Use the hierarchy chosen by `hd plan`."),
    "dtype": typer.Option("auto", help=DTYPE_HELP),
    "device": typer.Option("auto", help="auto|cpu|cuda."),
    "kernels": typer.Option("auto", help=KERNELS_HELP),
    "invariant": typer.Option("auto", help=INVARIANT_HELP),
    "attention": typer.Option("auto", help="auto|fused|torch: the M-invariant attention's kernel (auto: the "
                              "faster here, timed once; runs record it, and --config repeats it)."),
}


@app.command()
def generate(
    ctx: typer.Context,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    config: Optional[Path] = _RUN["config"],
    model: str = _RUN["model"],
    max_new_tokens: int = _RUN["max_new_tokens"],
    temperature: float = _RUN["temperature"],
    top_p: float = _RUN["top_p"],
    top_k: int = _RUN["top_k"],
    seed: Optional[int] = _RUN["seed"],
    frequency_penalty: float = _RUN["frequency_penalty"],
    presence_penalty: float = _RUN["presence_penalty"],
    logit_bias: List[str] = _RUN["logit_bias"],
    chat: bool = _RUN["chat"],
    system: Optional[str] = _RUN["system"],
    stop: List[str] = _RUN["stop"],
    layers: Optional[str] = _RUN["layers"],
    policy: str = _RUN["policy"],
    candidates: int = _RUN["candidates"],
    model_db: Optional[Path] = _RUN["model_db"],
    learn: bool = _RUN["learn"],
    stats_db: List[Path] = _RUN["stats_db"],
    stats_min_prob: Optional[float] = _RUN["stats_min_prob"],
    stats_min_expected: Optional[float] = _RUN["stats_min_expected"],
    draft_len: str = _RUN["draft_len"],
    min_n: Optional[int] = _RUN["min_n"],
    max_n: int = _RUN["max_n"],
    draft_models: Optional[str] = _RUN["draft_models"],
    level_tokens: Optional[str] = _RUN["level_tokens"],
    no_db: bool = _RUN["no_db"],
    plan: Optional[Path] = _RUN["plan"],
    dtype: str = _RUN["dtype"],
    device: str = _RUN["device"],
    kernels: str = _RUN["kernels"],
    invariant: str = _RUN["invariant"],
    attention: str = _RUN["attention"],
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="With --json: each token's "
                                           "log-probability and this many best alternatives (0-20)."),
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
    text = _read_prompt(prompt, prompt_file)
    cfg = _run_config(ctx, locals())
    if logprobs is not None:
        cfg = cfg.replace(logprobs=logprobs).validate()
    out = Console(highlight=False, no_color=not color, soft_wrap=True)

    def show(piece: str, layer: Optional[str]) -> None:
        out.print(piece, end="", style=_layer_style(layer), markup=False)

    output = _output_spec(json_schema, json_object, grammar, grammar_format, prediction)
    rep = api.generate_report(cfg, text, compare=compare, on_text=None if as_json else show,
                              on_status=_status(as_json), output=output)
    if as_json:
        typer.echo(json.dumps(rep.data))
    else:
        _print_generate(out, rep)
    if rep.data.get("learn_error"):   # after the answer: a full disk loses the learning, not the answer
        raise HdError(rep.data["learn_error"])


# Options of `hd serve` alone (beside _RUN's).
_SERVE = {
    "host": typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    "port": typer.Option(8000, "--port", help="Port (0: any free one; the chosen port is printed)."),
    "api_key": typer.Option([], "--api-key", help="Bearer token the /v1 routes require, one "
    "per tenant (repeatable; also HD_API_KEY). Default: none, an open server."),
    "api_keys_file": typer.Option(None, "--api-keys-file", help="More keys, one a line "
    "(KEY or NAME KEY; # comments)."),
    "learn_scope": typer.Option(None, "--learn-scope", help="shared|key|user: whose "
    "learned drafts and cached prefixes a request may use "
    "(default: key with several keys, else shared; docs/serve.md)."),
    "protect_metrics": typer.Option(False, "--protect-metrics", help="/metrics takes the API key "
    "too (one key; default: open, like /health)."),
    "metrics_key": typer.Option(None, "--metrics-key", envvar="HD_METRICS_KEY", help="The only "
    "bearer token /metrics takes, no tenant's key (also HD_METRICS_KEY). With several API keys "
    "/metrics answers to nothing else: it shows every tenant's requests."),
    "max_batch": typer.Option(8, "--max-batch", help="Requests decoded at once; their "
    "verification forwards are batched into one."),
    "max_queue": typer.Option(64, "--max-queue", help="Requests waiting beyond those (then 503)."),
    "served_name": typer.Option(None, "--served-model-name", help="The model id clients "
    "send (default: the --model given)."),
    "drain_timeout": typer.Option(60.0, "--drain-timeout", help="Seconds SIGTERM waits for "
    "running requests before cancelling them."),
    "body_timeout": typer.Option(30.0, "--body-timeout", help="Seconds a request has to send its "
    "whole body once its header arrived (then 408)."),
    "max_connections": typer.Option(512, "--max-connections", help="Open connections at most; "
    "one beyond gets 503 (keep it under `ulimit -n`)."),
    "prefix_cache_mb": typer.Option(256, "--prefix-cache-mb", help="MiB of prompts' keys and "
    "values kept for later requests that start the same way "
    "(chat turns, shared system prompts); answers stay "
    "bit-identical. 0: off."),
}


@app.command()
def serve(
    ctx: typer.Context,
    config: Optional[Path] = _RUN["config"],
    model: str = _RUN["model"],
    max_new_tokens: int = _RUN["max_new_tokens"],
    temperature: float = _RUN["temperature"],
    top_p: float = _RUN["top_p"],
    top_k: int = _RUN["top_k"],
    seed: Optional[int] = _RUN["seed"],
    frequency_penalty: float = _RUN["frequency_penalty"],
    presence_penalty: float = _RUN["presence_penalty"],
    logit_bias: List[str] = _RUN["logit_bias"],
    chat: bool = _RUN["chat"],
    system: Optional[str] = _RUN["system"],
    stop: List[str] = _RUN["stop"],
    layers: Optional[str] = _RUN["layers"],
    policy: str = _RUN["policy"],
    candidates: int = _RUN["candidates"],
    model_db: Optional[Path] = _RUN["model_db"],
    learn: bool = _RUN["learn"],
    stats_db: List[Path] = _RUN["stats_db"],
    stats_min_prob: Optional[float] = _RUN["stats_min_prob"],
    stats_min_expected: Optional[float] = _RUN["stats_min_expected"],
    draft_len: str = _RUN["draft_len"],
    min_n: Optional[int] = _RUN["min_n"],
    max_n: int = _RUN["max_n"],
    draft_models: Optional[str] = _RUN["draft_models"],
    level_tokens: Optional[str] = _RUN["level_tokens"],
    no_db: bool = _RUN["no_db"],
    plan: Optional[Path] = _RUN["plan"],
    dtype: str = _RUN["dtype"],
    device: str = _RUN["device"],
    kernels: str = _RUN["kernels"],
    invariant: str = _RUN["invariant"],
    attention: str = _RUN["attention"],
    host: str = _SERVE["host"],
    port: int = _SERVE["port"],
    api_key: List[str] = _SERVE["api_key"],
    api_keys_file: Optional[Path] = _SERVE["api_keys_file"],
    learn_scope: Optional[str] = _SERVE["learn_scope"],
    protect_metrics: bool = _SERVE["protect_metrics"],
    metrics_key: Optional[str] = _SERVE["metrics_key"],
    max_batch: int = _SERVE["max_batch"],
    max_queue: int = _SERVE["max_queue"],
    served_name: Optional[str] = _SERVE["served_name"],
    drain_timeout: float = _SERVE["drain_timeout"],
    max_connections: int = _SERVE["max_connections"],
    body_timeout: float = _SERVE["body_timeout"],
    prefix_cache_mb: float = _SERVE["prefix_cache_mb"],
    as_json: bool = typer.Option(False, "--json", help="At exit, write one JSON object (what was "
                                 "served) to stdout."),
):
    """Serve the model over an OpenAI-compatible HTTP API (docs/serve.md)."""
    from .serve.server import Server
    cfg = _run_config(ctx, locals())
    say = _status(False)
    server = Server(cfg, host=host, port=port, api_key=_api_keys(api_key), api_keys_file=api_keys_file,
                    learn_scope=learn_scope, protect_metrics=protect_metrics, metrics_key=metrics_key,
                    max_batch=max_batch, max_queue=max_queue,
                    name=served_name or model, drain_timeout=drain_timeout, max_connections=max_connections,
                    body_timeout=body_timeout,
                    prefix_cache_mb=prefix_cache_mb, on_status=say)
    _serve_banner(server, server.bind(), say)
    summary = server.run()
    if server.forced_by is not None:
        say(f"stopped at once by a second signal: running requests cancelled; {summary['requests']} served")
        if as_json:
            typer.echo(json.dumps(summary))
        raise typer.Exit(128 + server.forced_by)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        say(f"stopped: {summary['requests']} requests, {summary['completion_tokens']} tokens"
            + (f", {summary['learned_generations']} generations learned" if cfg.learn else ""))


def _api_keys(given: List[str]) -> List[str]:
    """--api-key values, HD_API_KEY first; set but empty is a mistake, not an open server."""
    if "HD_API_KEY" not in os.environ:
        return list(given)
    if not os.environ["HD_API_KEY"].strip():
        raise HdError("HD_API_KEY is set but empty: give a key, or unset it for an open server")
    return [os.environ["HD_API_KEY"]] + list(given)


def _serve_banner(server, port: int, say) -> None:
    mode = ("exact under load: M-invariant, requests verified together" if server.scheduler.batched else
            "requests stepped together, each in its own forward (M-invariant batching not available here)")
    cached = f"; prefix cache {server.prefix.max_bytes / (1 << 20):g} MiB" if server.prefix is not None else ""
    say(f"serving {server.name} at http://{server.host}:{port}/v1 ({mode}; max batch "
        f"{server.scheduler.max_batch}{cached})")
    n_keys = len(server.keys) if server.keys else 0
    say(f"{n_keys or 'no'} API key{'s' if n_keys != 1 else ''}" + ("" if n_keys else " (an open server)")
        + f"; learned drafts and cached prefixes scoped: {server.learn_scope}"
        + f"; {server.metrics_readers.describe()}")


def _layer_style(layer: Optional[str]) -> Optional[str]:
    spec = registry.LAYERS.get((layer or "").split(":")[0])
    return spec.style or None if spec else None


def _print_generate(out: Console, rep) -> None:
    d = rep.data
    out.print()
    out.print(_stats_table(f"{d['model']} · {d['dtype']} · {d['device']}", rep.runs))
    if "levels" in d:
        lt = Table(title="draft hierarchy (bottom first; 'accepted' = kept by the level above)")
        for col in ("level", "calls", "forwards", "proposed", "accepted", "accept rate", "seconds"):
            lt.add_column(col, justify="left" if col == "level" else "right")
        for lv in d["levels"]:
            lt.add_row(lv["name"], str(lv["calls"]), str(lv["forwards"]), str(lv["proposed"]),
                       str(lv["accepted"]), f"{lv['acceptance_rate']:.1%}", f"{lv['seconds']:.2f}")
        out.print(lt)
    c = d.get("compare")
    if c:
        same = "identical" if c["identical"] else f"DIFFERENT from token {c['first_difference']}"
        note = "" if d["config"]["temperature"] == 0 else " (sampling: outputs differ by chance, not by error)"
        out.print(f"speedup over plain decoding: [bold]{c['speedup']:.2f}x[/bold]; output {same}{note}")
        hf_same = ("identical" if c["identical_to_hf_ar"]
                   else f"different from token {c['first_difference_from_hf_ar']}")
        out.print(f"speedup over transformers' generate (stock model, {c['hf_ar']['tokens_per_second']:.1f} "
                  f"tok/s): [bold]{c['speedup_over_hf_ar']:.2f}x[/bold]; output {hf_same}")


@app.command("costs")
def costs_cmd(
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help="auto|cpu|cuda."),
    kernels: str = typer.Option("auto", help="auto shows both CPU kernel sets and which one is kept."),
    invariant: str = typer.Option("auto", help=INVARIANT_HELP),
    remeasure: bool = typer.Option(False, "--remeasure", help="Drop the cached curves and measure again."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show the measured forward cost by width (what caps draft trees)."""
    rep = api.cost_report(model, dtype=dtype, device=device, kernels=kernels, remeasure=remeasure,
                          invariant=invariant)
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
    t.add_column("tree+", justify="right", no_wrap=True)
    t.add_column("stream+", justify="right", no_wrap=True)
    for k, c in rep["curves"].items():
        mark = "*" if k == rep["kernels"] else ""
        t.add_row(k + mark, "-" if c["one_token_ms"] is None else f"{c['one_token_ms']:.1f} ms",
                  *[f"{c['cost'][str(w)]:.2f}" if str(w) in c["cost"] else "-" for w in shown],
                  f"{c['branch']:.3f}", f"{c['stream']:.2f}")
    con = Console(highlight=False)
    con.print(t)
    con.print("tree+: added per row of a tree that branches; stream+: added per request beyond the first "
              "in one batched forward (hd serve)")
    con.print("M-invariant forward: " + ("on (verified rows bit-equal one-token rows)" if rep["invariant"] else "off"))
    choice = rep.get("activation_choice")
    if choice:
        us = choice.get("us") or {}
        times = "; ".join(f"{a}: " + ", ".join(f"{r} row{'' if r == '1' else 's'} {t:.0f} us" for r, t in v.items()) for a, v in us.items())
        con.print(f"GGUF GEMM activations on this CPU: [bold]{choice['activations']}[/bold]"
                  + (f" (measured once, cached: {times})" if times else f" ({choice.get('why', '')})"))
    att = rep.get("attention")
    if att:
        why = (f"measured: fused {att['ms']['fused']:.1f} ms, torch ops {att['ms']['torch']:.1f} ms"
               if "ms" in att else att.get("why") or att.get("by", ""))
        con.print(f"its attention: [bold]{att['attention']}[/bold] ({why}; HD_FUSED_ATTENTION=0/1 overrides)")
    when = [c["measured_at"] for c in rep["curves"].values() if c.get("measured_at")]
    if when:
        age = (time.time() - min(when)) / 86400
        con.print(f"measured {age:.1f} days ago; cached under {api.records.cache_root()} "
                  f"(re-measured after {api.costs.MAX_AGE_DAYS} days, or with --remeasure)")


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
        _print_header(header, {"file_bytes": out.stat().st_size})


@app.command("build-model-db")
def build_model_db(
    out: Path = typer.Option(..., "--out", "-o", help="The LMDB file to create."),
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    prompts: Optional[List[Path]] = typer.Option(None, help="jsonl with `prompt`, `turns` or `text`; "
                                                 "repeat for several files (default: the 320 prompts shipped "
                                                 "with hd, hdcli/data/model_db_prompts.jsonl). Prompts like "
                                                 "your users' make the DB draft best."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy (the default: a greedy run verifies "
                                      "the target's greedy answers); > 0 samples."),
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
    dtype: str = typer.Option("auto", help="The dtype you decode with (auto, as `hd generate`): "
                              "the DB then holds exactly the answers your runs will verify."),
    device: str = typer.Option("auto"),
    kernels: str = typer.Option("auto", help=KERNELS_HELP),
    invariant: str = typer.Option("auto", help=INVARIANT_HELP),
    overwrite: bool = typer.Option(False),
    as_json: bool = typer.Option(False, "--json"),
):
    """Sample the target model on a prompt set and index what it wrote into a model DB."""
    from tqdm import tqdm
    cfg = DecodingConfig(model=model, dtype=dtype, device=device, kernels=kernels, invariant=invariant, seed=seed,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    bar = tqdm(unit=" prompts", desc="sampling", disable=as_json or from_samples is not None)

    def progress(done: int, tokens: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    try:
        result = api.build_model_db(out, cfg, prompts=prompts, num_prompts=num_prompts, batch_size=batch_size,
                                    samples=samples, resume=resume, from_samples=from_samples,
                                    overwrite=overwrite, progress=progress, min_n=min_n, max_n=max_n,
                                    top_k=top_k, min_count=min_count)
    finally:
        bar.close()
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_header(result["header"], {"file_bytes": out.stat().st_size})


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
        con.print(f"{report['path']}: [red]DAMAGED[/red]: " + escape("; ".join(report["problems"])))
    for note in report.get("notes", []):
        con.print(f"[dim]{report['path']}: {note}[/dim]")


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
    from .engine import loader as models
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
    kernels: str = typer.Option("auto", help=KERNELS_HELP),
    invariant: str = typer.Option("auto", help=INVARIANT_HELP),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Save the chosen plan (for hd generate --plan)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure costs and acceptance, predict every hierarchy's speed, choose the fastest (DP)."""
    cfg = DecodingConfig(model=model, dtype=dtype, device=device, kernels=kernels, invariant=invariant, stats_dbs=stats_db,
                         model_db=model_db)
    result = api.plan(cfg, draft_models, prompts=prompts, count=count, tokens=tokens, t_max=t_max,
                      no_db=no_db, measure_top=measure_top, max_new_tokens=max_new_tokens,
                      out_path=out_path, on_status=_status(as_json))
    if as_json:
        typer.echo(json.dumps(result))
        return
    t = Table(title=f"hierarchies for {result['target']} ({result['dtype']}, {result['device']}), best T per chain")
    for col in ("hierarchy", "predicted tok/s", "predicted speedup", "measured tok/s"):
        t.add_column(col, justify="left" if col == "hierarchy" else "right")
    for r in result["candidates"]:
        m = r.get("measured_tokens_per_second")
        t.add_row(r["hierarchy"], f"{r['predicted_tokens_per_second']:.1f}", f"{r['predicted_speedup']:.2f}x",
                  "-" if m is None else f"{m:.1f}")
    con = Console(highlight=False)
    con.print(t)
    acc = "  ".join(f"{k} {v:.2f}" for k, v in result["calibration"]["accept"].items())
    con.print(f"acceptance: {acc}")
    con.print(f"chosen: [bold]{result['hierarchy']}[/bold]"
              + (f"; saved to {out_path} (hd generate --plan {out_path})" if out_path else ""))


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against plain decoding and peers.")
app.add_typer(bench_app, name="bench")


# Options shared by the `hd bench` commands (as _RUN is by generate and serve).
_BENCH = {
    "temperature": typer.Option(0.0, help="0 = greedy (exactness is checked only then)."),
    "seed": typer.Option(0, help="Seed for sampling."),
    "stats_db": typer.Option([], "--stats-db", help="Statistics DB (repeatable)."),
    "model_db": typer.Option(None, "--model-db", help="Model DB."),
    "dtype": typer.Option("auto", help=DTYPE_HELP),
    "device": typer.Option("auto", help="auto|cpu|cuda."),
    "kernels": typer.Option("auto", help=KERNELS_HELP),
}


@bench_app.command("spec-bench")
def bench_spec_bench(
    data: Optional[Path] = typer.Option(None, "--data", help="Spec-Bench question.jsonl (default: "
                                        "data/spec_bench/question.jsonl here or under ../shared/)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    methods: Optional[str] = typer.Option(None, "--methods",
                                help="Comma-separated, 'ar' included (default: ar, the single layers "
                                "whose DBs are given, hd, hf-ar, hf-pld, suffix where installed). Known: " + bench.method_help()),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per category (default: all)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated (default: all)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = _BENCH["temperature"],
    seed: int = _BENCH["seed"],
    stats_db: List[Path] = _BENCH["stats_db"],
    model_db: Optional[Path] = _BENCH["model_db"],
    dtype: str = _BENCH["dtype"],
    device: str = _BENCH["device"],
    kernels: str = _BENCH["kernels"],
    invariant: str = typer.Option("auto", help=INVARIANT_HELP),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write summary.json, answers/<method>.jsonl "
                                           "(Spec-Bench's answer schema) and speedup.png here."),
    as_json: bool = typer.Option(False, "--json", help="Write the summary as JSON to stdout."),
):
    """Run Spec-Bench with several methods on one model, interleaved, and report speedups."""
    from tqdm import tqdm
    cfg = DecodingConfig(model=model, dtype=dtype, device=device, kernels=kernels, invariant=invariant, stats_dbs=stats_db,
                         model_db=model_db, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    # tqdm, not a rich live display: progress must show when stderr is a file or a pipe too
    bar = tqdm(desc="warming up", unit=" answers", file=sys.stderr, disable=as_json, mininterval=1.0)

    def progress(method: str, q: dict, total: int) -> None:
        bar.total = total
        bar.set_description(f"{q['category']} · {method}")
        bar.update()
    try:
        report = api.bench_spec_bench(cfg, config_mod.split_list(methods) if methods else None, data=data,
                                      limit=limit, categories=config_mod.split_list(categories) if categories else None,
                                      out_dir=out_dir, progress=progress, on_status=_status(as_json))
    finally:
        bar.close()
    if as_json:
        typer.echo(json.dumps(report))
        return
    Console(highlight=False).print(bench_report.tables(report))
    if out_dir is not None:
        Console(stderr=True, highlight=False).print(
            f"wrote {out_dir}/summary.json, {out_dir}/answers/*.jsonl, {out_dir}/speedup.png")


@bench_app.command("agents")
def bench_agents(
    workloads: str = typer.Option("tools,json,edits", "--workloads",
                                  help="Comma-separated: tools (BFCL calls, tool_choice auto and required), json "
                                  "(JSON-schema output), edits (code edits with the file as the prediction)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m"),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated, 'ar' included (default: ar, "
                                          "hd, suffix where installed, llama-cpp where installed and the model "
                                          "is a GGUF file). Known: " + bench_agents_mod.method_help()),
    limit: Optional[int] = typer.Option(None, "--limit", help="Questions per workload, taken in turn from its "
                                        "categories (default: all)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Default per workload: " + ", ".join(
        f"{k} {v}" for k, v in bench_agents_mod.MAX_NEW_TOKENS.items()) + "."),
    bfcl: Optional[Path] = typer.Option(None, "--bfcl", help="BFCL data folder (default: ../shared/data/bfcl)."),
    corpora: Optional[Path] = typer.Option(None, "--corpora", help="Code corpora folder (default: ../shared/corpora)."),
    temperature: float = _BENCH["temperature"],
    seed: int = _BENCH["seed"],
    stats_db: List[Path] = _BENCH["stats_db"],
    model_db: Optional[Path] = _BENCH["model_db"],
    dtype: str = _BENCH["dtype"],
    device: str = _BENCH["device"],
    kernels: str = _BENCH["kernels"],
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write summary.json and answers/<method>.jsonl here."),
    as_json: bool = typer.Option(False, "--json", help="Write the report as JSON to stdout."),
):
    """Tool calls, JSON-schema output and edits: each method under the same constraint, interleaved."""
    from tqdm import tqdm
    cfg = DecodingConfig(model=model, dtype=dtype, device=device, kernels=kernels, stats_dbs=stats_db,
                         model_db=model_db, temperature=temperature, seed=seed)
    bars = []   # made at the first answer: an error before it stays one line on stderr

    def progress(method: str, item, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit=" answers", file=sys.stderr, disable=as_json, mininterval=1.0))
        bars[0].set_description(f"{item.category} · {method}")
        bars[0].update()
    try:
        report = api.bench_agents(cfg, config_mod.split_list(methods) if methods else None,
                                  workloads=config_mod.split_list(workloads), bfcl=bfcl, corpora=corpora,
                                  limit=limit, max_new_tokens=max_new_tokens, out=out_dir,
                                  progress=progress, on_status=_status(as_json))
    finally:
        for bar in bars:
            bar.close()
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

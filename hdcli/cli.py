"""`hd`: the command line, a thin layer over hdcli.api.

Every error the user can fix is an HdError: printed as one line on stderr, exit code 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import __version__, api
from .errors import HdError
from .verify import Sampling

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="hd: lossless speculative decoding from a hierarchy of drafting sources.")

# Colour of accepted drafted tokens, by the layer that drafted them.
LAYER_STYLES = {"context": "green", "model": "cyan", "stats": "magenta"}


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
    """runs: label -> RunStats. One row per drafting layer of each run, then its totals."""
    t = Table(title=title)
    for col in ("run", "layer", "queries", "hit rate", "drafted", "accepted", "accept rate"):
        t.add_column(col, justify="left" if col in ("run", "layer") else "right")
    for label, st in runs.items():
        for ls in st.layers.values():
            t.add_row(label, ls.name, str(ls.queries), f"{ls.hit_rate:.1%}", str(ls.drafted),
                      str(ls.accepted), f"{ls.acceptance_rate:.1%}")
    s = Table(title="speed")
    for col in ("run", "new tokens", "steps", "mean accepted", "tok/s", "draft s", "verify s",
                "prefill s"):
        s.add_column(col, justify="left" if col == "run" else "right")
    for label, st in runs.items():
        s.add_row(label, str(st.new_tokens), str(st.steps), f"{st.mean_accepted:.2f}",
                  f"{st.tokens_per_second:.1f}", f"{st.draft_seconds:.3f}", f"{st.verify_seconds:.2f}",
                  f"{st.prefill_seconds:.2f}")
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
    layers: str = typer.Option("context", help="Drafting layers in order, comma-separated; "
                               "'none' for plain decoding."),
    draft_len: int = typer.Option(16, "--draft-len", help="Most tokens drafted per step."),
    min_n: Optional[int] = typer.Option(None, "--min-n", help="Shortest n-gram the context DB "
                                        "matches (default: 2 in fp32, 1 in bf16/fp16)."),
    max_n: int = typer.Option(4, "--max-n", help="Longest n-gram the context DB matches."),
    dtype: str = typer.Option("auto", help="auto|bf16|fp16|fp32 (auto: fp32 on CPU, bf16 on CUDA)."),
    device: str = typer.Option("auto", help="auto|cpu|cuda."),
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
    layer_list = [] if layers.strip() == "none" else [x.strip() for x in layers.split(",") if x.strip()]
    api.make_drafter(layer_list, draft_len=draft_len, min_n=min_n or 1, max_n=max_n)  # fail early
    out = Console(highlight=False, no_color=not color, soft_wrap=True)
    err = Console(stderr=True, highlight=False)
    if not as_json:
        err.print(f"[dim]loading {model} ...[/dim]")
    lm = api.load_model(model, dtype=dtype, device=device)
    if not as_json:
        err.print(f"[dim]loaded {lm.source} ({lm.dtype}, {lm.device}) in {lm.load_seconds:.1f}s"
                  f"{' from cache' if lm.from_cache else ''}[/dim]")
    drafter = api.make_drafter(layer_list, draft_len=draft_len, min_n=min_n, max_n=max_n, dtype=lm.dtype)
    if compare:
        api.warm_up(lm)

    def show(piece: str, layer: Optional[str]) -> None:
        out.print(piece, end="", style=LAYER_STYLES.get(layer or "", None), markup=False)

    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
                  system=system, stop=stop)
    res = api.generate(lm, text, drafter=drafter, on_text=None if as_json else show, **common)
    runs = {"hd": res.stats}
    report = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
              "load_seconds": lm.load_seconds, "layers": layer_list, "draft_len": draft_len,
              "sampling": vars(sampling) | {"seed": seed}, **res.to_dict()}
    if compare:
        base = api.generate(lm, text, drafter=None, **common)
        runs["plain"] = base.stats
        diff = api.first_difference(res.tokens, base.tokens)
        speedup = (res.stats.tokens_per_second / base.stats.tokens_per_second
                   if base.stats.tokens_per_second else 0.0)
        report["compare"] = {"plain": base.to_dict(), "speedup": speedup,
                             "identical": diff is None, "first_difference": diff}
    if as_json:
        typer.echo(json.dumps(report))
        return
    out.print()
    out.print(_stats_table(f"{lm.name} · {lm.dtype} · {lm.device}", runs))
    if compare:
        c = report["compare"]
        same = "identical" if c["identical"] else f"DIFFERENT from token {c['first_difference']}"
        note = "" if sampling.greedy else " (sampling: outputs differ by chance, not by error)"
        out.print(f"speedup over plain decoding: [bold]{c['speedup']:.2f}x[/bold]; output {same}{note}")


def main() -> None:
    try:
        app()
    except HdError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            Text.assemble(("error: ", "red"), str(exc)))
        sys.exit(2)


if __name__ == "__main__":
    main()

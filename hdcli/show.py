"""What the `hd` commands show a person: rich tables and status lines (--json shows none of it;
hd bench's progress, on stderr, shows all the same).

Each function renders one command's result; hdcli/cli.py parses the options, calls the
command's function (hdcli/api.py, or its package's), and hands the result here.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Optional

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .drafting import registry
from .engine import records
from .engine.decode import costs as costs_mod
from .engine.progress import LINE_SECONDS, bar as progress_bar


@contextlib.contextmanager
def bar(quiet: bool, **kw):
    """A tqdm progress bar on stderr, closed at the end (tqdm, not a rich live display: progress
    must show when stderr is a file or a pipe too: engine/progress.py)."""
    made = progress_bar(disable=quiet, **kw)
    try:
        yield made
    finally:
        made.close()


def sampled(made):
    """progress(done, tokens, total) for hd build-model-db's bar of prompts sampled."""
    def progress(done: int, tokens: int, total: int) -> None:
        made.total = total
        made.update(done - made.n)
        made.set_postfix(tokens=tokens, tok_s=f"{tokens / max(made.format_dict['elapsed'], 1e-9):.0f}")
    return progress


def counted(made):
    """progress(documents, tokens) for hd build-stats' bar of tokens counted."""
    docs = 0

    def progress(n_docs: int, n_tokens: int) -> None:
        nonlocal docs
        docs += n_docs
        made.update(n_tokens)
        made.set_postfix(docs=docs, refresh=False)
    return progress


class Answered:
    """progress(method, question, total answers) for the hd bench commands, on stderr whatever
    --json says: a run takes minutes, and stdout holds the report alone. On a terminal a tqdm
    bar, as the builds show, made at the first answer so that an error before it stays one line;
    elsewhere plain lines, not a bar's carriage returns. Elapsed counts from the command's start
    (the model's load and each method's warm-up included)."""

    def __init__(self, category_of, err=None):
        self.category_of = category_of          # a question -> its category
        self.err = err if err is not None else sys.stderr
        self.started = time.time()
        self.done = 0
        self.bar = None
        self.said_at = 0.0

    def __call__(self, method: str, question, total: int) -> None:
        from tqdm import tqdm
        self.done += 1
        where = f"{self.category_of(question)} · {method}"
        if self.err.isatty():
            if self.bar is None:
                self.bar = tqdm(total=total, unit=" answers", file=self.err, mininterval=1.0)
                self.bar.start_t = self.started
            self.bar.set_description(where)
            self.bar.update()
        elif self.done in (1, total) or time.time() - self.said_at >= LINE_SECONDS:
            elapsed = tqdm.format_interval(time.time() - self.started)
            print(f"{self.done}/{total} answers · {where} · {elapsed} elapsed", file=self.err, flush=True)
            self.said_at = time.time()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def answered(category_of):
    """An Answered for one hd bench run, its bar closed at the end."""
    progress = Answered(category_of)
    try:
        yield progress
    finally:
        progress.close()


def warnings(lines) -> None:
    """Lines "warning: ..." on stderr (under --json too: stdout carries them in its `warnings`)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in lines:
        err.print(Text.assemble(("warning:", "yellow"), line.removeprefix("warning:")))


def status(as_json: bool):
    """Where progress and warnings go: dim lines on stderr; under --json only the warnings (what
    was changed of the request is said on stderr whatever stdout carries; --json lists it too)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(message: str) -> None:
        if message.startswith("warning:"):
            warnings([message])
        elif not as_json:
            err.print(Text(message, style="dim"))
    return say



def stats_table(title: str, runs: dict) -> Table:
    """runs: label -> RunStats. One row per drafting layer of each run, then each run's speed.
    Fits 80 columns; --json has every field, the draft/bookkeeping split included."""
    t = Table(title=f"{title} · hit = queries answered · kept = accepted / drafted · ms = its time "
              "drafting and learning", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("run", "layer", "queries", "hit", "cands", "won", "drafted", "accepted", "kept", "ms"):
        t.add_column(col, justify="left" if col in ("run", "layer") else "right")
    for label, st in runs.items():
        for ls in st.layers.values():
            t.add_row(label, ls.name, str(ls.queries), f"{ls.hit_rate:.0%}", str(ls.candidates),
                      str(ls.won), str(ls.drafted), str(ls.accepted), f"{ls.acceptance_rate:.0%}",
                      f"{1e3 * ls.seconds:.0f}")
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



def layer_style(layer: Optional[str]) -> Optional[str]:
    spec = registry.LAYERS.get((layer or "").split(":")[0])
    return spec.style or None if spec else None


def generate(out: Console, rep) -> None:
    d = rep.data
    out.print()
    out.print(stats_table(f"{d['model']} · {d['dtype']} · {d['device']}", rep.runs))
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
        # transformers' stock forward is another computation (its own kernels' rounding): a
        # difference from it says nothing about drafting, whose reference is plain decoding above
        hf_same = ("identical" if c["identical_to_hf_ar"]
                   else f"differs from token {c['first_difference_from_hf_ar']}, by numerics, not drafting: "
                        f"transformers' {c['hf_ar'].get('dtype', d['dtype'])} kernels round otherwise than hd's "
                        "forward, and greedy follows the rounding (the exact reference is plain decoding, above)")
        out.print(f"speedup over transformers' generate (stock model, {c['hf_ar']['tokens_per_second']:.1f} "
                  f"tok/s): [bold]{c['speedup_over_hf_ar']:.2f}x[/bold]; output {hf_same}")


def local_models(rep: dict) -> None:
    """hd models: the GGUFs of the local stores, one row each; a skipped entry, one line on stderr."""
    con = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for bad in rep.get("skipped", []):
        err.print(Text.assemble(("warning: ", "yellow"), f"skipped {bad['name']}: " + " ".join(bad["problem"].split())))
    warnings(rep.get("warnings", []))
    if not rep["models"]:
        where = rep["searched"]
        con.print(f"no models found in Ollama's store ({where['ollama']}) or LM Studio's "
                  f"({', '.join(where['lmstudio'])}); set $OLLAMA_MODELS or $LMSTUDIO_MODELS to look elsewhere")
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("--model", "architecture", "quantization", "size", "forward"):
        t.add_column(col, no_wrap=col in ("--model", "size"))
    for m in rep["models"]:
        quants = ", ".join(f"{k} {v}" for k, v in sorted(m["quants"].items(), key=lambda kv: -kv[1])[:3])
        forward = {"hd": "hd (exact)", "transformers": "transformers (exactness off)"}.get(m["forward"], m["forward"])
        t.add_row(m["name"], m["architecture"] or "-", quants or "-", f"{m['size_bytes'] / 2**30:.2f} GiB", forward)
    con.print(t)


def costs(rep: dict) -> None:
    """hd costs: the forward cost by width of each kernel set, and what was chosen."""
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
    layers = rep.get("layers")
    if layers:
        con.print("its decoder blocks: " + ("[bold]one compiled call a forward[/bold]" if layers["compiled"]
                                            else f"the Python blocks ({layers['why']})"))
    when = [c["measured_at"] for c in rep["curves"].values() if c.get("measured_at")]
    if when:
        age = (time.time() - min(when)) / 86400
        con.print(f"measured {age:.1f} days ago; cached under {records.cache_root()} "
                  f"(re-measured after {costs_mod.MAX_AGE_DAYS} days, or with --remeasure)")


def header(fields: dict, extra: Optional[dict] = None) -> None:
    """A DB's header (and size figures) as a two-column table."""
    t = Table(show_header=False)
    for k, v in {**fields, **(extra or {})}.items():
        t.add_row(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
    Console(highlight=False).print(t)


def verify(report: dict) -> None:
    con = Console(highlight=False, soft_wrap=True)
    if report["ok"]:
        stored = "matches the header" if report["header_digest"] else "(no digest in the header: built by an older hd; shapes and count checked)"
        con.print(f"{report['path']}: [green]OK[/green], {report['records']} records, content digest "
                  f"{report['content_digest']} {stored}")
    else:
        con.print(f"{report['path']}: [red]DAMAGED[/red]: " + escape("; ".join(report["problems"])))
    for note in report.get("notes", []):
        con.print(f"[dim]{report['path']}: {note}[/dim]")


def serve_banner(server, port: int, say) -> None:
    mode = ("exact under load: M-invariant, requests verified together" if server.scheduler.batched else
            "requests stepped together, each in its own forward (M-invariant batching not available here)")
    cached = f"; prefix cache {server.prefix.max_bytes / (1 << 20):g} MiB" if server.prefix is not None else ""
    say(f"serving {server.name} at http://{server.host}:{port}/v1 ({mode}; max batch "
        f"{server.scheduler.max_batch}{cached})")
    n_keys = len(server.keys) if server.keys else 0
    say(f"{n_keys or 'no'} API key{'s' if n_keys != 1 else ''}" + ("" if n_keys else " (an open server)")
        + f"; learned drafts and cached prefixes scoped: {server.learn_scope}"
        + f"; {server.metrics_readers.describe()}")


def serve_stopped(say, summary: dict, forced_by: Optional[int], learned: bool, quiet: bool) -> None:
    """hd serve's last line: how it stopped and what it served (under --json, only a forced stop)."""
    if forced_by is not None:
        say(f"stopped at once by a second signal: running requests cancelled; {summary['requests']} served")
    elif not quiet:
        say(f"stopped: {summary['requests']} requests, {summary['completion_tokens']} tokens"
            + (f", {summary['learned_generations']} generations learned" if learned else ""))


def plan(result: dict, out_path) -> None:
    """hd plan: every hierarchy's predicted (and measured) speed, and the choice."""
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


def db_query(keys: list, result: dict) -> None:
    """hd db query: each key of the text's end, what it holds, and the draft."""
    con = Console(highlight=False)
    t = Table("n", "key", "total", "continuations (count)")
    for k in keys:
        conts = "  ".join(f"{c['text']!r} ({c['count']})" for c in k["continuations"]) if k["found"] else "-"
        t.add_row(str(k["n"]), repr(k["key"]), str(k["total"]), conts)
    con.print(t)
    con.print(Text.assemble("draft: ", (repr(result["draft"]), "magenta")))


def read_warnings(read: dict) -> None:
    """hd build-stats: the records a corpus read skipped or replaced, as warnings on stderr."""
    for what, n in read.items():
        if n and what != "first_malformed":
            first = f" (first: {read['first_malformed']})" if what == "skipped_malformed" else ""
            Console(stderr=True, highlight=False, soft_wrap=True).print(
                Text.assemble(("warning: ", "yellow"), f"{n} records {what.replace('_', ' ')}{first}"))


def db_info(path, info: dict) -> None:
    """hd db info: the header and size figures, and the verification where one was asked for."""
    header(info["header"], info["size"])
    if "verify" in info:
        verify(info["verify"])
    else:
        Console(stderr=True, highlight=False).print(
            f"[dim]records not read: `hd db verify {path}` checks them against content_digest[/dim]")

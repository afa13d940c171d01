"""How a Spec-Bench run is shown: the tables (80 columns), the speedup chart, a saved run read back."""
from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.table import Table

from ..drafting import registry
from .. import inputs
from ..errors import HdError
from . import specbench
from .runner import BASELINES

# per baseline: its column in 80-column tables, its name in the chart
LABELS = {"hf-ar": ("vs hf-ar", "hf-ar (transformers' generate, stock model)"),
          "llama-cpp": ("vs lcpp", "llama-cpp (same GGUF)")}


def _bases(methods: dict) -> list[tuple[str, str]]:
    """(summary key, baseline) of the baselines beside `ar` that ran."""
    keys = [(f"speedup_over_{suffix}", b) for b, suffix in BASELINES.items()]
    return [(k, b) for k, b in keys if any(k in f["overall"] for f in methods.values())]


def short_name(layer: str) -> str:
    """A layer's label in 80-column tables (peers' and 'stats:NAME' layers as named)."""
    spec = registry.LAYERS.get(layer)
    return spec.short if spec and spec.short else {"suffix": "sfx"}.get(layer, layer)


def load(run_dir: Path) -> dict:
    """The summary saved by `hd bench spec-bench --out run_dir`."""
    f = run_dir / "summary.json"
    if inputs.kind_of(f) == "missing":
        raise HdError(f"{f} not found: pass a folder written by `hd bench spec-bench --out DIR`")
    text = inputs.read_text(f, "bench summary", inputs.DOCUMENT_BYTES, "pass a folder written by `hd bench spec-bench --out DIR`")
    try:
        report = json.loads(text)
        for key in ("model", "dtype", "device", "questions", "max_new_tokens", "methods"):
            report[key]  # a KeyError: not a summary
    except (ValueError, KeyError, TypeError) as exc:
        raise HdError(f"{f} is not an hd bench summary ({exc})") from None
    return report


def tables(report: dict) -> Table:
    """The overall table, then speedup per category per method, over ar and the baselines that ran."""
    meta, methods = report, report["methods"]
    bases = _bases(methods)
    exact = " (M-invariant)" if meta.get("invariant") else ""
    t = Table(title=f"Spec-Bench · {meta['model']} · {meta['dtype']}{exact} · {meta['device']} · "
                    f"{meta['questions']} questions · {meta['max_new_tokens']} new tokens",
              caption="acc: mean accepted tokens per step · out: share of step time outside the "
                      "target's forward · differ: answers unlike ar's"
                      + (" · lcpp: llama-cpp" if any(b == "llama-cpp" for _, b in bases) else "")
                      + (f" · not run here: {', '.join(meta['skipped'])} (summary.json: skipped)"
                         if meta.get("skipped") else ""),
              box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ["method", "vs ar"] + [LABELS[b][0] for _, b in bases] + ["tok/s", "acc", "out", "differ",
                                                                  "accepted by layer"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("method", "accepted by layer") else "right",
                     no_wrap=col != "accepted by layer")   # long method names squeeze the layers, not the figures
    for m, f in methods.items():
        o = f["overall"]
        differ = (f"{o['differ_from_ar']}/{o['questions']}" if "differ_from_ar" in o else "n/a (sampling)")
        share = " ".join(f"{short_name(k)}:{v['share_of_accepted']:.0%}"
                         for k, v in o["layers"].items() if v["accepted"])
        t.add_row(m, f"{o['speedup']:.2f}x", *[f"{o[k]:.2f}x" for k, _ in bases],
                  f"{o['tokens_per_second']:.1f}",
                  "-" if o["mean_accepted_tokens"] is None else f"{o['mean_accepted_tokens']:.2f}",
                  "-" if o["overhead_share"] is None else f"{o['overhead_share']:.1%}", differ, share)
    cats = list(next(iter(methods.values()))["categories"])
    grid = Table.grid()
    grid.add_row(t)
    if any(len(f["overall"]["layers"]) > 1 for f in methods.values()):
        grid.add_row(layer_table(methods))
    if any("own_timings" in f["overall"] for f in methods.values()):
        grid.add_row(own_table(methods))
    for key, base in [("speedup", "ar")] + bases:
        c = Table(title=f"speedup over {base} by category", box=box.SIMPLE_HEAD, pad_edge=False)
        c.add_column("method")
        for cat in cats:
            c.add_column(specbench.SHORT_NAMES.get(cat, cat), justify="right")
        for m, f in methods.items():
            c.add_row(m, *[f"{f['categories'][cat][key]:.2f}x" for cat in cats])
        grid.add_row(c)
    return grid


def layer_table(methods: dict) -> Table:
    """Each layer's part in each drafting method: tokens it added that no layer asked before it
    drafted (a token two layers drafted is the earlier one's tree node), drafts it spent, time it
    spent."""
    t = Table(title="what each layer adds (tokens accepted that no earlier layer drafted) and costs",
              caption="drafted: its tree nodes verified · kept: accepted / drafted · ms: its time per "
                      "decode step (candidates, and record for recycle) · time: share of the steps' time",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("method", "layer", "accepted", "share", "drafted", "kept", "ms", "time"):
        t.add_column(col, justify="left" if col in ("method", "layer") else "right", no_wrap=True)
    for m, f in methods.items():
        layers = f["overall"]["layers"]
        if len(layers) < 2:
            continue
        for i, (name, v) in enumerate(layers.items()):
            t.add_row(m if i == 0 else "", short_name(name), str(v["accepted"]),
                      f"{v['share_of_accepted']:.0%}", str(v["drafted"]), f"{v['acceptance_rate']:.0%}",
                      f"{v.get('ms_per_step', 0.0):.2f}", f"{v.get('share_of_time', 0.0):.1%}")
    return t


def own_table(methods: dict) -> Table:
    """The peers timed by their own clocks (llama-server's `timings`): prefill and decode speed
    apart, and their own drafts (--spec-type) with how many were kept."""
    t = Table(title="tok/s by their own timings (llama-server's)",
              caption="prefill: prompt tokens per second · decode: tokens after the first per second, as "
                      "llama-server counts them · drafted, accepted: its own n-gram drafts",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("method", "prefill", "decode", "drafted", "accepted", "kept"):
        t.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for m, f in methods.items():
        own = f["overall"].get("own_timings")
        if own is None:
            continue
        prefill = 1000 * own["prompt_n"] / own["prompt_ms"] if own["prompt_ms"] else 0.0
        drafted, accepted = own["draft_n"], own["draft_n_accepted"]
        t.add_row(m, f"{prefill:.0f}", f"{own['predicted_per_second']:.1f}",
                  *([str(drafted), str(accepted), f"{accepted / drafted:.0%}"] if drafted else ["-"] * 3))
    return t


def chart(report: dict, path: Path) -> None:
    """Grouped bars per category (and overall) per method: speedup over ar, over hf-ar and over
    llama-cpp where they ran, and tokens per second."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta, methods = report, report["methods"]
    cats = list(next(iter(methods.values()))["categories"]) + ["overall"]
    panels = [("speedup", "ar")] + [(k, LABELS[b][1]) for k, b in _bases(methods)] + [("tokens_per_second", None)]
    width = 0.8 / len(methods)
    # one colour a method at any count (matplotlib's default cycle repeats after 10) and hatches
    # past 20; the legend sits beside the bars, never over them
    colours = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.4 * len(cats)) + 3, 4.2 * len(panels)),
                             squeeze=False)
    for ax, (key, base) in zip(axes[:, 0], panels):
        for i, (m, f) in enumerate(methods.items()):
            vals = [f["categories"][c][key] if c != "overall" else f["overall"][key] for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m,
                   color=colours[(2 * i + i // 10) % 20], hatch=("", "//", "..")[i // 20 % 3], edgecolor="white")
        if base is not None:
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats))], cats, rotation=20)
        ax.set_ylabel(f"speedup over {base.split(' ')[0]}" if base else "tokens / s")
        ax.set_title(f"Spec-Bench, {meta['model']} ({meta['dtype']}, {meta['device']}), "
                     f"{meta['max_new_tokens']} new tokens: "
                     + (f"speedup over {base}" if base else "tokens per second"), fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

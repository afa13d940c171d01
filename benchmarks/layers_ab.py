"""The compiled decoder layers (csrc/qmm.cpp's Layers) of an earlier commit against the working
tree's, on one loaded model, interleaved in one process: a change to the one-call forward timed
free of the machine's drift.

The earlier qmm.cpp is built as its own extension (gemm_ab.earlier); one handle of each is built
over the same weights, norms and attention, and the model's compiled layers (model/compiled.py)
switch between them forward by forward. Before anything is timed, each handle's logits and caches
are checked torch.equal on a prompt, then one token and a chain of 4 on its cache (each reading
the keys and values the earlier forwards wrote): a change that moves a
bit is refused here. Then a one-token forward and a 4-row chain on a --context-token cache,
least and median of --rounds, the two handles alternating which goes first.

    python benchmarks/layers_ab.py --before c870f93 --out benchmarks/results/gguf/layers_ab.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import command_line, machine, write_result  # noqa: E402
from gemm_ab import earlier  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.engine.decode.loop import Decoder  # noqa: E402
from hdcli.engine.kernels import quants  # noqa: E402
from hdcli.engine.model import compiled  # noqa: E402


def handle_of(model, module):
    """model's CompiledLayers built on `module`'s Layers (the earlier build's or this tree's)."""
    real = quants.gemm_module
    quants.gemm_module = lambda: module
    try:
        return compiled.CompiledLayers(model)
    finally:
        quants.gemm_module = real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit whose Layers is the baseline")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    lm = api.load_model(args.model, kernels=args.kernels, quiet=True)
    model = lm.model
    now = compiled.layers_of(model)
    if now is None:
        print(f"the compiled layers do not run on this model: {compiled.why_not(model)}")
        return 1
    before_module = earlier(args.before)
    before_module.Layers = before_module.LayersBefore   # the class as gemm_ab.earlier renames it
    handles = {"before": handle_of(model, before_module), "now": now}
    vocab = model.config.vocab_size
    prompt = [(7 + 13 * i) % vocab for i in range(args.context)]

    def run(name: str, ids: list[int], cache):
        model.__dict__["_compiled"] = (model.__dict__["_compiled"][0], handles[name])
        with torch.inference_mode():
            return model.forward(torch.tensor([ids]), cache)

    checks = {}
    for name in handles:
        cache = model.new_cache()
        got = [run(name, prompt[:40], cache), run(name, [5], cache), run(name, [9, 4, 11, 2], cache)]
        checks[name] = got
    if not all(torch.equal(x, y) for x, y in zip(checks["before"], checks["now"])):
        print("the two builds' logits differ: not timed")
        return 1
    cache = model.new_cache()
    Decoder(model, ())._prefill(prompt, cache)
    times = {(n, w): [] for n in handles for w in (1, 4)}
    for r in range(args.rounds):
        order = list(handles) if r % 2 == 0 else list(handles)[::-1]
        for name in order:
            for w in (1, 4):
                t = time.perf_counter()
                run(name, [5, 6, 7, 8][:w], cache)
                times[(name, w)].append(time.perf_counter() - t)
                cache.crop(args.context)
    doc = {"command": command_line("layers_ab.py", args), "machine": machine(), "model": args.model,
           "kernels": lm.info.get("numerics", {}).get("layers"), "threads": torch.get_num_threads(), "rows": {}}
    print(f"{args.model}, {doc['machine']['cpu']}, {torch.get_num_threads()} threads, {args.rounds} rounds "
          f"(ms: least / median); logits torch.equal between the builds")
    for w in (1, 4):
        row = {n: {"least_ms": 1e3 * min(times[(n, w)]), "median_ms": 1e3 * statistics.median(times[(n, w)])}
               for n in handles}
        row["speedup_median"] = row["before"]["median_ms"] / row["now"]["median_ms"]
        row["speedup_least"] = row["before"]["least_ms"] / row["now"]["least_ms"]
        doc["rows"][str(w)] = row
        print(f"  {w} row{'s' if w > 1 else ''}: before {row['before']['least_ms']:.3f} / {row['before']['median_ms']:.3f}, "
              f"now {row['now']['least_ms']:.3f} / {row['now']['median_ms']:.3f}  "
              f"({row['speedup_least']:.3f}x least, {row['speedup_median']:.3f}x median)")
    write_result(Path(args.out) if args.out else None, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

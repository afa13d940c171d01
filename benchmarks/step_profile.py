"""What a one-token forward reads against what it costs, per layer type, on a GGUF (issue 37, item 2).

For each GGUF and each GGUF kernel set (bf16 activations `gguf`, int8 activations `gguf-int8`),
in one process, interleaved:
  bandwidth  what this machine's two threads read per second (sum over a 256 MB fp32 tensor,
             least of 7): the limit a decode step is held to;
  limit      the bytes of every weight one token reads (each GEMM's packing once, the embedding
             row negligible) over that bandwidth: the fastest a one-token forward can be;
  t1         a one-token forward on a 256-token cache, least of --rounds, through the Python
             blocks (the per-type and per-class splits time their calls);
  compiled   the same forward with the decoder layers in one compiled call (model/compiled.py;
             null where the model's layers do not fit it), interleaved with the blocks' in one loop;
  per type   each Linear type's (qkv, o, gate_up, down, head) time inside t1, by timing hooks
             (perf_counter around the call; a few us each), its bytes and the GB/s it streams;
  outside    t1 less every GEMM: norms, rope, attention, embedding, Python;
  by class   t1 split by operation class, timed around the calls that do it (outermost only):
             gemm (every Linear but the head), head, attention (the attention call, the cache
             write inside it), row ops (norms, residual add + norm, heads split, rope: the
             model's RowOps), embedding, and the rest ("python": the blocks' own elementwise
             ops (silu * up, residual adds), slicing, the Step's bookkeeping, Python itself).
Random-weight GGUFs of published shapes (synth_gguf.py) time like real ones.

    python benchmarks/step_profile.py --models /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf \
        --out benchmarks/results/gguf/step_profile.json
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, write_result  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.engine.decode.loop import Decoder  # noqa: E402


def read_bandwidth() -> float:
    a = torch.ones(64 * 1024 * 1024)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def layer_type(name: str) -> str:
    return name.rsplit(".", 1)[-1]   # blocks.3.gate_up -> gate_up; head


class ClassTimer:
    """Seconds spent inside wrapped calls, per class, the outermost call only (a norm inside the
    rope's call counts once, as row ops)."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self.depth = 0

    def wrap(self, owner, name: str, cls: str, undo: list) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.depth:
                return real(*args, **kwargs)
            self.depth += 1
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[cls] += time.perf_counter() - t
                self.depth -= 1
        setattr(owner, name, timed)
        undo.append(lambda: setattr(owner, name, real) if owner.__dict__.get(name) is timed else None)


def by_class(model, context: int, rounds: int, width: int = 1) -> dict:
    """A forward's least time and its split by operation class (module docstring), in ms, for a
    chain of `width` new tokens (1: one token; more: a verification's rows, each after the ones
    before it); the wrapping costs ~1 us a call, inside the classes' shares."""
    from hdcli.engine.model.attention import Step
    timer, undo = ClassTimer(), []
    for n, mod in model.named_modules():
        if type(mod).__name__ == "Linear" and hasattr(mod, "kernel"):
            timer.wrap(mod, "forward", "head" if n == "head" else "gemm", undo)
    timer.wrap(model.embed, "forward", "embedding", undo)
    ops = model.row_ops
    for name in ("norm", "add_norm", "heads", "rotate", "head_norm"):
        if hasattr(ops, name):
            timer.wrap(ops, name, "row ops", undo)
    timer.wrap(Step, "attend", "attention", undo)
    model.compiled_layers = False   # the timers wrap the blocks' calls
    undo.append(lambda: setattr(model, "compiled_layers", True))
    cache = model.new_cache()
    vocab = model.config.vocab_size
    Decoder(model, ())._prefill([(7 + 13 * i) % vocab for i in range(context)], cache)
    ids = torch.tensor([[(5 + 11 * i) % vocab for i in range(width)]])
    best, split = float("inf"), {}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                timer.spent.clear()
                t = time.perf_counter()
                model.forward(ids, cache)
                t1 = time.perf_counter() - t
                cache.crop(context)
                if t1 < best:
                    best, split = t1, dict(timer.spent)
    finally:
        for u in reversed(undo):
            u()
    out = {k: round(1e3 * v, 3) for k, v in split.items()}
    out["python"] = round(1e3 * (best - sum(split.values())), 3)
    return {"t1_ms" if width == 1 else "ms_total": round(1e3 * best, 3), "width": width, "ms": out}


def blocks_and_compiled(model, context: int, rounds: int) -> dict:
    """A one-token forward's least time through the blocks and through the compiled layers, the
    two interleaved round by round, in ms (compiled: None where the layers do not fit it)."""
    from hdcli.engine.model import compiled
    cache = model.new_cache()
    vocab = model.config.vocab_size
    Decoder(model, ())._prefill([(7 + 13 * i) % vocab for i in range(context)], cache)
    ids = torch.tensor([[5]])
    ways = [False] + ([True] if compiled.layers_of(model) is not None else [])
    best = {w: float("inf") for w in ways}
    with torch.inference_mode():
        for _ in range(rounds):
            for way in ways:
                model.compiled_layers = way
                t = time.perf_counter()
                model.forward(ids, cache)
                best[way] = min(best[way], time.perf_counter() - t)
                cache.crop(context)
    model.compiled_layers = True
    return {"blocks_ms": round(1e3 * best[False], 3), "compiled_ms": round(1e3 * best[True], 3) if True in best else None,
            "why_not": compiled.why_not(model)}


def profile(lm, context: int, rounds: int) -> dict:
    model = lm.model
    model.compiled_layers = False   # the hooks time the blocks' calls
    used = {n: m for n, m in model.named_modules() if type(m).__name__ == "Linear" and hasattr(m, "kernel")}
    spent: dict[str, float] = defaultdict(float)
    starts: dict[str, float] = {}
    hooks = []
    for name, mod in used.items():
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: starts.__setitem__(n, time.perf_counter())))
        hooks.append(mod.register_forward_hook(lambda m, a, o, n=name: spent.__setitem__(
            n, spent[n] + time.perf_counter() - starts[n])))
    cache = model.new_cache()
    vocab = model.config.vocab_size
    Decoder(model, ())._prefill([(7 + 13 * i) % vocab for i in range(context)], cache)
    ids = torch.tensor([[5]])
    called: set[str] = set()
    best_t1, best_split = float("inf"), {}
    with torch.inference_mode():
        for _ in range(rounds):
            spent.clear()
            t = time.perf_counter()
            model.forward(ids, cache)
            t1 = time.perf_counter() - t
            cache.crop(context)
            called |= set(spent)
            if t1 < best_t1:
                best_t1, best_split = t1, dict(spent)
    for h in hooks:
        h.remove()
    model.compiled_layers = True
    by_type: dict[str, dict] = {}
    for name in called:   # the layers a forward calls (joined q/k/v and gate/up, not their parts)
        kind = layer_type(name)
        kernel = used[name].kernel
        nbytes = int(getattr(kernel, "nbytes", 0) or kernel.in_features * kernel.out_features * used[name].dtype.itemsize)
        row = by_type.setdefault(kind, {"layers": 0, "bytes": 0, "seconds": 0.0})
        row["layers"] += 1
        row["bytes"] += nbytes
        row["seconds"] += best_split.get(name, 0.0)
    for row in by_type.values():
        row["GBps"] = row["bytes"] / row["seconds"] / 1e9 if row["seconds"] else None
        row["ms"] = 1e3 * row.pop("seconds")
    gemm_ms = sum(r["ms"] for r in by_type.values())
    return {"t1_ms": 1e3 * best_t1, "gemm_ms": gemm_ms, "outside_ms": 1e3 * best_t1 - gemm_ms,
            "bytes": sum(r["bytes"] for r in by_type.values()), "by_type": by_type}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated GGUF paths (or checkpoint folders)")
    ap.add_argument("--kernels", default="gguf,gguf-int8")
    ap.add_argument("--dtype", default="auto", help="auto, bf16 or fp32 (fp32: a GGUF's weights dequantized, dense kernels)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--widths", default="1", help="comma-separated chain widths for the class split "
                    "(e.g. 1,4,8: where a verification's extra rows cost)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    bw = read_bandwidth()
    doc = {"command": command_line("benchmarks/step_profile.py", args), "machine": machine(),
           "read_bandwidth_GBps": bw / 1e9, "models": {}}
    print(f"read bandwidth {bw / 1e9:.1f} GB/s ({doc['machine']['cpu']}, {torch.get_num_threads()} threads)")
    for path in args.models.split(","):
        for kern in args.kernels.split(","):
            lm = api.load_model(path, kernels=kern, dtype=args.dtype, quiet=True)
            got = profile(lm, args.context, args.rounds)
            got["limit_ms"] = 1e3 * got["bytes"] / bw
            got["share_of_limit"] = got["limit_ms"] / got["t1_ms"]
            got["numerics"] = lm.info.get("numerics", {}).get("layers")
            got["by_class"] = by_class(lm.model, args.context, args.rounds)
            got["by_class_width"] = {w: by_class(lm.model, args.context, args.rounds, w) for w in widths if w > 1}
            got["one_call"] = blocks_and_compiled(lm.model, args.context, args.rounds)
            doc["models"].setdefault(Path(path).name, {})[kern] = got
            print(f"{Path(path).name} {kern}: one token {got['t1_ms']:.1f} ms, limit {got['limit_ms']:.1f} ms "
                  f"({100 * got['share_of_limit']:.0f}%), GEMMs {got['gemm_ms']:.1f} ms, outside {got['outside_ms']:.1f} ms")
            oc = got["one_call"]
            print(f"    blocks {oc['blocks_ms']:.2f} ms, the layers in one compiled call "
                  + (f"{oc['compiled_ms']:.2f} ms ({oc['blocks_ms'] / oc['compiled_ms']:.2f}x)" if oc["compiled_ms"] else f"not run: {oc['why_not']}"))
            cl = got["by_class"]
            print(f"    by class (one token {cl['t1_ms']:.1f} ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(cl["ms"].items(), key=lambda kv: -kv[1])))
            for w, wc in got["by_class_width"].items():
                print(f"    by class, {w} rows ({wc['ms_total']:.1f} ms, {wc['ms_total'] / cl['t1_ms']:.2f}x one): " + ", ".join(
                    f"{k} {v:.1f} ({v / max(cl['ms'].get(k, 0.0), 1e-9):.2f}x)" for k, v in sorted(wc["ms"].items(), key=lambda kv: -kv[1])))
            for kind, row in sorted(got["by_type"].items(), key=lambda kv: -kv[1]["ms"]):
                print(f"    {kind:8s} x{row['layers']:3d} {row['ms']:7.1f} ms  {row['bytes'] / 1e6:8.1f} MB  "
                      f"{row['GBps'] or 0:5.1f} GB/s")
            del lm
    write_result(Path(args.out) if args.out else None, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

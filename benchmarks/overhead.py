"""Where a one-token forward's time goes, against the bandwidth limit, and two tries to cut the
overhead around the kernels (issue 18, part 5; docs/dtype.md "Overhead per forward").

For the bundled model in one dtype and forward mode, in one process:
  bandwidth   read bandwidth of this machine (sum over a 256 MB fp32 tensor, median of 5) and the
              bytes of weights one token reads (every GEMM's weight once) -> the tok/s limit;
  t1          one-token forward on a 100-token cache, median of 30, and its share of the limit;
  split       torch.profiler over 10 forwards: self time in the GEMM kernels, in every other op,
              and the rest of t1 (Python around the ops);
  fuse        A/B, interleaved: sibling projections (q/k/v, gate/up) as one packed GEMM per group
              vs one per projection (packed kernels only); rows are checked bit-equal; and the
              same calls alone, over 30 layers' worth of random weights (no other op between);
  compile     A/B: torch.compile of every RMSNorm (fixed shapes) vs eager, and the M-invariant
              self-check after it.

    python benchmarks/overhead.py --dtype bf16 --out benchmarks/results/overhead_bf16.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hdcli import api
from hdcli.engine.kernels import dense as kernels
from hdcli.engine.decode import calibrate

from common import machine


def read_bandwidth() -> float:
    a = torch.ones(64 * 1024 * 1024)
    a.sum()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t)
    return a.numel() * 4 / statistics.median(ts)


def weight_bytes(model) -> int:
    """Bytes of every GEMM weight (what one token must read; the embedding row is negligible)."""
    size = 2 if model.dtype == torch.bfloat16 else 4
    return sum(m.in_features * m.out_features * size for m in model.modules()
               if isinstance(m, (torch.nn.Linear, kernels.PackedLinear)))


def one_token_ms(model, n: int = 30) -> float:
    cache = model.new_cache()
    with torch.inference_mode():
        model.forward(torch.randint(3, 40000, (1, 100)), cache)
        tok = torch.tensor([[5]])
        ts = []
        for i in range(n + 3):
            t = time.perf_counter()
            model.forward(tok, cache)
            ts.append(time.perf_counter() - t)
            cache.crop(-1)
    return statistics.median(ts[3:]) * 1e3


def split(model, t1_ms: float) -> dict:
    from torch.profiler import ProfilerActivity, profile
    cache = model.new_cache()
    tok = torch.tensor([[5]])
    with torch.inference_mode():
        model.forward(torch.randint(3, 40000, (1, 100)), cache)
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(10):
                model.forward(tok, cache)
        wall = (time.perf_counter() - t) / 10
    gemm = other = 0.0
    for e in p.key_averages():
        if e.key in ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"):
            gemm += e.self_cpu_time_total
        else:
            other += e.self_cpu_time_total
    calls = sum(e.count for e in p.key_averages()) / 10
    # the profiler slows the Python around the ops: the rest is taken from the unprofiled t1
    return {"gemm_ms": gemm / 10e3, "other_ops_ms": other / 10e3, "op_calls_per_forward": calls,
            "profiled_wall_ms": wall * 1e3, "rest_ms": t1_ms - (gemm + other) / 10e3}


# ------------------------------------------------ try 1: sibling projections as one GEMM

class _Group:
    def __init__(self, members):
        w = torch.cat([m.weight_matrix() for m in members])
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        self.linear, self.sizes, self.x, self.parts = kernels.PackedLinear(lin), [m.out_features for m in members], None, []

    def part(self, i, x):
        if self.x is not x or self.parts[i] is None:
            self.x, self.parts = x, list(self.linear(x).split(self.sizes, -1))
        out, self.parts[i] = self.parts[i], None
        return out


class _Member(torch.nn.Module):
    def __init__(self, group, i, original):
        super().__init__()
        self.group, self.i, self.original = group, i, original

    def forward(self, x):
        return self.group.part(self.i, x)


def set_fused(model, on: bool) -> None:
    for module in list(model.modules()):
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            got = [getattr(module, n, None) for n in names]
            if on and all(type(m) is kernels.PackedLinear and m.bias is None for m in got):
                g = _Group(got)
                for i, (n, m) in enumerate(zip(names, got)):
                    setattr(module, n, _Member(g, i, m))
            elif not on and all(isinstance(m, _Member) for m in got):
                for n, m in zip(names, got):
                    setattr(module, n, m.original)


def fuse_isolated(dtype: torch.dtype, k: int = 576, sizes=((576, 192, 192), (1536, 1536)),
                  layers: int = 30) -> dict:
    """ms for one token through every sibling projection of `layers` layers, one packed GEMM per
    projection vs one per group, the calls back to back (median of 30, interleaved)."""
    def packed(n):
        return kernels.PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
    sep = [[packed(n) for group in sizes for n in group] for _ in range(layers)]
    fused = [[packed(sum(group)) for group in sizes] for _ in range(layers)]
    x = torch.randn(1, k).to(dtype)
    res = {"separate": [], "fused": []}
    with torch.inference_mode():
        for i in range(35):
            for name, mods in (("separate", sep), ("fused", fused)):
                t = time.perf_counter()
                for layer in mods:
                    for lin in layer:
                        lin(x)
                if i >= 5:
                    res[name].append(time.perf_counter() - t)
    return {f"{name}_ms": statistics.median(v) * 1e3 for name, v in res.items()}


def logits(model):
    cache = model.new_cache()
    ids = torch.randint(3, 40000, (1, 78), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.forward(ids[:, :70], cache)
        return [model.forward(ids[:, 70:70 + w], cache) for w in (1, 3)]


def ab(model, toggle, rounds: int = 4) -> dict:
    res = {"off": [], "on": []}
    for _ in range(rounds):
        for state in ("off", "on"):
            toggle(model, state == "on")
            res[state].append(one_token_ms(model, 15))
    toggle(model, False)
    return {f"t1_ms_{k}": min(v) for k, v in res.items()} | {"rounds": res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--invariant", default="on")
    ap.add_argument("--out")
    args = ap.parse_args()
    lm = api.load_model(dtype=args.dtype, kernels=args.kernels, invariant=args.invariant)
    m = lm.model
    bw, wb = read_bandwidth(), weight_bytes(m)
    t1 = one_token_ms(m)
    limit = bw / wb
    out = {"machine": machine(), "dtype": lm.dtype, "kernels": lm.kernels, "invariant": lm.invariant,
           "read_bandwidth_gb_s": bw / 1e9, "weight_bytes": wb, "bandwidth_limit_tok_s": limit,
           "t1_ms": t1, "plain_tok_s_forward_only": 1e3 / t1, "share_of_limit": 1e3 / t1 / limit,
           "split": split(m, t1)}
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1), file=sys.stderr)
    if lm.kernels == "onednn":
        before = logits(m)
        set_fused(m, True)
        same = all(torch.equal(a, b) for a, b in zip(before, logits(m)))
        set_fused(m, False)
        out["fuse"] = {"rows_bit_equal": same, "isolated": fuse_isolated(m.dtype), **ab(m, set_fused)}
        print("fuse", out["fuse"], file=sys.stderr)
    norms = [mod for mod in m.modules() if type(mod).__name__.endswith("RMSNorm")]
    eager = [mod.forward for mod in norms]
    compiled = [torch.compile(f, dynamic=False) for f in eager]

    def set_compiled(model, on):
        for mod, e, c in zip(norms, eager, compiled):
            mod.forward = c if on else e
    set_compiled(m, True)
    t = time.perf_counter()
    one_token_ms(m, 3)
    compile_s = time.perf_counter() - t
    check = list(calibrate.self_check(m)) if lm.invariant else None
    out["compile_norms"] = {"compile_seconds": compile_s, "self_check": check, **ab(m, set_compiled)}
    print("compile", out["compile_norms"], file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

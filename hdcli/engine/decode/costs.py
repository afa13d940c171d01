"""Forward cost against the number of tokens verified, measured on this machine.

cost(w) is the time of one forward over w new tokens on top of a KV cache, divided by the time
of a one-token forward (so cost(1) = 1 and plain decoding costs 1 per token). It caps the draft
tree (hdcli/engine/decode/tree.py), picks the drafting defaults (CostCurve.verifies_cheaply) and feeds
the planner. The curve depends on the
model, dtype, kernels, device, thread count, torch version and CPU, so it is measured once per
such combination (a few seconds) and cached as JSON under HD_CACHE_DIR (default
~/.cache/hdcli/costs); `hd costs` shows and re-measures it. Between measured widths it is
interpolated linearly; beyond the last it grows linearly with the last slope.

Two more measured terms price what a chain of w tokens does not have (CostCurve.forward):
  * branch: per row of a tree that branches, over a chain of as many rows. In the M-invariant
    forward a tree's rows gather their own keys (engine/kernels/invariant.py): measured on the bundled
    model with 4-bit kernels, an 8-row tree cost nearly one one-token forward more than an 8-row
    chain, so the chain curve alone made the cap keep branches that did not pay;
  * stream: per stream beyond the first in one batched forward (engine/decode/batch.py: its own cache,
    its own attention). 4 one-token streams cost far more than a 4-token chain there, so a server
    that priced streams as rows kept trees that made every forward dearer than they paid for (4
    clients were faster with no drafts at all).

Measurement, made so that a loaded machine cannot fake the curve
  * rounds: every width is timed once per round, the widths of a round in a rotated order, so a
    burst of load hits all widths alike rather than one width's block of repeats; the narrow
    widths (up to NARROW) have their rounds before the wide ones', never after a wide forward;
  * each width's time is the minimum over rounds: load only ever adds time, so the minimum is
    the estimate least hurt by it (the median let one loaded stretch set the one-token time and
    turn the whole curve into 1.0, "every width free");
  * sanity: a wider forward never costs less than a narrower one (noise must not invite wider
    trees), and where the model is big enough that compute must show (MIN_PARAMS_FOR_SLOPE), a
    curve whose widest forward costs under FLAT_LIMIT is implausible on a CPU, as is one that
    steps up faster than its rows (STEEP_LIMIT): it is measured again, and if it stays so it is
    used for this process only and never cached;
  * a cached curve older than MAX_AGE_DAYS, of an older format or from another CPU is measured
    again.
"""
from __future__ import annotations

import bisect
import os
import time
from pathlib import Path

import torch

from ...errors import HdError
from ..records import cache_file, cpu_name, number, read_record, write_json
from . import batch
from .tree import Tree
from ..kernels import fused
from ..kernels import quants
from ..kernels import dense

WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CHEAP_VERIFY = 1.45  # cost(8) at or below this (in one-token forwards): verification is nearly free
ROUNDS = 7           # timed rounds over all widths (the minimum of each width is kept)
FORMAT = 4           # cache records of another format are measured again (3: branch, stream;
                     # 4: the narrow widths timed apart from the wide ones)
# the widths a CPU's decode steps run (trees of up to NARROW tokens) are timed in rounds of their
# own, before the wider ones: a forward that follows a 48- or 64-token one runs slower for tens of
# milliseconds (measured on an Intel Xeon, docs/benchmarks.md), so rounds over every width timed
# the one-token forward in that state, and its inflated time flattened the whole narrow curve
NARROW = 16
MAX_AGE_DAYS = 30    # machines change (firmware, microcode, neighbours): re-measure monthly
FLAT_LIMIT = 1.05    # cost(64) under this on a CPU means the one-token time was inflated
# from one width to the next a forward's cost grows at most as its rows do (it reads the same
# weights; its arithmetic is linear in the rows), times this: a steeper step means the wider
# width's every round was loaded (a bundled-model curve measured beside a test run once read six
# times the cost for one and a half times the rows; measured again, it was not)
STEEP_LIMIT = 2.0
MIN_PARAMS_FOR_SLOPE = 20_000_000  # below this a forward is overhead-bound and may be flat


class CostCurve:
    """cost(w) relative to a one-token forward; one_token_seconds (when measured) makes it absolute."""

    def __init__(self, points: dict[int, float], one_token_seconds: float | None = None,
                 info: dict | None = None, branch: float = 0.0, stream: float = 0.0):
        self.one_token_seconds = one_token_seconds
        self.branch, self.stream = branch, stream   # see the module docstring
        self.widths = sorted(int(w) for w in points)
        self.costs = [float(points[w]) for w in self.widths]
        self.info = dict(info or {})  # how and when it was measured (cache records)
        self._memo: dict[int, float] = {}  # w -> cost(w): asked every step by the tree cap
        if self.widths[0] != 1:
            raise ValueError("a cost curve starts at width 1")

    def __call__(self, w: int) -> float:
        got = self._memo.get(w)
        if got is None:
            got = self._memo[w] = self._interpolate(w)
        return got

    def _interpolate(self, w: int) -> float:
        ws, cs = self.widths, self.costs
        if w <= ws[0]:
            return cs[0]
        i = bisect.bisect_left(ws, w)
        if i == len(ws):
            slope = (cs[-1] - cs[-2]) / (ws[-1] - ws[-2]) if len(ws) > 1 else 1.0
            return cs[-1] + max(slope, 0.0) * (w - ws[-1])
        if ws[i] == w:
            return cs[i]
        f = (w - ws[i - 1]) / (ws[i] - ws[i - 1])
        return cs[i - 1] + f * (cs[i] - cs[i - 1])

    def forward(self, rows: int, streams: int = 1, branched_rows: int = 0) -> float:
        """One forward over `rows` rows of `streams` streams, `branched_rows` of them in trees
        that branch (the rest chains)."""
        return self(rows) + self.stream * (streams - 1) + self.branch * branched_rows

    def verifies_cheaply(self) -> bool:
        """Whether verifying 8 drafted tokens costs at most CHEAP_VERIFY one-token forwards.
        fp32 on torch's kernels is costly, packed kernels and bf16 cheap (docs/dtype.md). The drafting
        defaults (compose.default_min_n and its siblings) follow this."""
        return self(8) <= CHEAP_VERIFY

    def seconds(self, w: int) -> float | None:
        """Absolute time of a w-token forward, where the one-token time was measured."""
        return None if self.one_token_seconds is None else self.one_token_seconds * self(w)

    def to_dict(self) -> dict:
        return {str(w): c for w, c in zip(self.widths, self.costs)}


def flat(cost: float = 1.0) -> CostCurve:
    """A curve where every forward costs the same (an idealised accelerator)."""
    return CostCurve({1: 1.0, 64: cost})


def _n_params(model) -> int:
    # a GGUF tensor's blocks (quants.QLinear) hold no Parameter
    n = 0
    for m in model.module.modules():
        for p in m.parameters(recurse=False):
            n += p.numel()
        if isinstance(m, (dense.PackedLinear, quants.QLinear)):  # an opaque packed tensor, or GGUF blocks
            n += m.in_features * m.out_features
    return n


def _progress(total: int, desc: str, quiet: bool):
    from ..progress import bar
    # not `disable=None`: progress shows when stderr is a file or a pipe too
    return bar(total=total, desc=desc, unit=" forwards", disable=quiet, mininterval=0.5, leave=False)


@torch.inference_mode()
def measure_seconds(model, context: int = 256, rounds: int = ROUNDS, widths=WIDTHS,
                    desc: str = "measuring forward cost", quiet: bool = False,
                    clock=time.perf_counter) -> dict[int, float]:
    """Least time of a w-token forward over a `context`-token cache, per width, over `rounds`
    interleaved rounds (see the module docstring). `clock` reads seconds: the tests pass one that
    the model itself advances, so what they check does not ride on this machine's load."""
    device = model.device
    vocab = model.config.vocab_size
    ctx = torch.arange(context, device=device)[None] % vocab
    cache = model.new_cache()
    model.forward(ctx, cache)
    base = cache.get_seq_length()
    inputs = {w: (torch.arange(w, device=device)[None] * 7 + 11) % vocab for w in widths}

    def once(w: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        model.forward(inputs[w], cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = clock() - t0
        cache.crop(-(cache.get_seq_length() - base))
        return dt

    best = {w: float("inf") for w in widths}
    narrow = [w for w in widths if w <= NARROW]
    phases = [p for p in (narrow, [w for w in widths if w > NARROW]) if p]
    with _progress(len(widths) * (rounds + 1), desc, quiet) as bar:
        for phase in phases:   # the narrow widths first, among themselves (NARROW)
            for w in phase:  # the first run of a shape warms its kernels up; not timed
                once(w)
                bar.update()
            for r in range(rounds):
                shift = r % len(phase)
                for w in phase[shift:] + phase[:shift]:
                    best[w] = min(best[w], once(w))
                    bar.update()
    return best


def curve_from_seconds(seconds: dict[int, float]) -> CostCurve:
    """Relative costs, made monotone: a wider forward never costs less than a narrower one."""
    widths = sorted(seconds)
    one = seconds[widths[0]]
    points, top = {}, 0.0
    for w in widths:
        top = max(top, seconds[w] / one)
        points[w] = top
    points[widths[0]] = 1.0
    return CostCurve(points, one_token_seconds=one, info={"seconds": {str(w): seconds[w] for w in widths}})


def plausible(curve: CostCurve, model) -> bool:
    """False for a curve a CPU cannot have: flat to the widest width on a model whose compute
    must show (a 20M+ parameter forward over 64 tokens does 64x the arithmetic of one), or
    steeper from one width to the next than its rows (STEEP_LIMIT)."""
    device = model.device
    if device.type != "cpu":
        return True
    points = [(w, curve(w)) for w in curve.widths]
    if any(c2 > STEEP_LIMIT * c1 * w2 / w1 for (w1, c1), (w2, c2) in zip(points, points[1:])):
        return False
    if _n_params(model) < MIN_PARAMS_FOR_SLOPE:
        return True
    return curve(curve.widths[-1]) >= FLAT_LIMIT


BIG_PARAMS = 1_000_000_000   # from here a forward over 64 tokens takes seconds on a few cores
BIG_BUDGET = (64, 2)         # (context, rounds) for such a model


def budget_for(model) -> tuple[int, int]:
    """(context, rounds) of a measurement: a model of BIG_PARAMS+ parameters gets a 64-token
    context and 2 rounds (five caches of 256 tokens and 7 rounds over 10 widths are minutes of
    whole-model forwards at 8B on 2 cores, longer than the answers they speed up; the time it
    takes is in docs/benchmarks.md). Least times of 2 rounds still reject one loaded round."""
    return BIG_BUDGET if _n_params(model) >= BIG_PARAMS else (256, ROUNDS)


def measure(model, context: int = 256, repeats: int = ROUNDS, widths=WIDTHS, quiet: bool = True,
            desc: str = "measuring forward cost", clock=time.perf_counter) -> CostCurve:
    """The cost curve of `model`: least times over interleaved rounds, relative to w = 1, checked
    for plausibility and measured once more (twice the rounds) when it fails."""
    curve = curve_from_seconds(measure_seconds(model, context, repeats, widths, desc, quiet, clock))
    ok = plausible(curve, model)
    if not ok:
        curve = curve_from_seconds(measure_seconds(model, context, 2 * repeats, widths,
                                                   desc + " (again: the first looked loaded)", quiet, clock))
        ok = plausible(curve, model)
    curve.info["plausible"] = ok
    curve.branch, curve.stream = measure_extras(model, context, repeats, quiet, clock)
    return curve


@torch.inference_mode()
def measure_extras(model, context: int = 256, rounds: int = ROUNDS, quiet: bool = True,
                   clock=time.perf_counter) -> tuple[float, float]:
    """(branch, stream) of the module docstring, in one-token forwards: an 8-row tree against an
    8-row chain, 4 one-token streams in one batched forward against a 4-token chain, all timed in
    interleaved rounds (least time of each). stream is 1 (a forward each) where the model does
    not batch streams."""
    device = model.device
    vocab = model.config.vocab_size
    n_caches = 4 if batch.can_batch(model) else 1
    caches = []
    for i in range(n_caches):
        cache = model.new_cache()
        model.forward((torch.arange(context, device=device)[None] + 13 * i) % vocab, cache)
        caches.append(cache)
    base = caches[0].get_seq_length()

    def tree(*branches):
        t = Tree()
        for b in branches:
            t.add_candidate([(11 + 7 * x) % vocab for x in b], "x")
        return t
    root = 5 % vocab
    shapes = {"chain1": [tree()], "chain4": [tree([1, 2, 3])], "chain8": [tree(range(1, 8))],
              "tree8": [tree([1, 2, 3, 4], [5, 6, 7])]}
    if n_caches == 4:
        shapes["streams4"] = [tree() for _ in range(4)]

    def once(name: str) -> float:
        items = [(t, root, c) for t, c in zip(shapes[name], caches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        batch.forward_many(model, items)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = clock() - t0
        for c in caches:
            if c.get_seq_length() > base:
                c.crop(base - c.get_seq_length())   # (crop(0) would empty it)
        return dt

    best = {name: float("inf") for name in shapes}
    names = list(shapes)
    with _progress(len(names) * (rounds + 1), "measuring tree and batch cost", quiet) as bar:
        for name in names:
            once(name)
            bar.update()
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                best[name] = min(best[name], once(name))
                bar.update()
    one = best["chain1"]
    branch = max(0.0, (best["tree8"] - best["chain8"]) / 8 / one)
    stream = max(0.0, (best["streams4"] - best["chain4"]) / 3 / one) if "streams4" in best else 1.0
    return branch, stream


def _valid_curve(d: dict) -> bool:
    return (number(d["measured_at"]) and isinstance(d["cost"], dict) and "1" in d["cost"]
            and all(int(w) >= 1 and number(c, 0) for w, c in d["cost"].items())
            and number(d["branch"], 0) and number(d["stream"], 0)
            and (d.get("one_token_seconds") is None or number(d["one_token_seconds"], 0)))


def _cache_path(key: str) -> Path:
    return cache_file("costs", key)


def curve_key(source: str, dtype: str, device: str, kernels: str, invariant: bool = False) -> str:
    """What a curve depends on; the M-invariant forward (engine/kernels/invariant.py) is another forward.
    A file is keyed by its real path: a link to it (an Ollama blob linked to a file, a relative
    path) is the same model, measured once."""
    if os.path.exists(source):
        source = os.path.realpath(source)
    # 3: on hd's own forward (engine/model/); the attention's implementation sets its speed and numerics
    mode = f"|invariant:3-{fused.name()}" if invariant else ""
    if kernels in ("gguf", "gguf-int8"):   # another build of the GGUF GEMMs is measured again
        kernels = f"{kernels}-{quants.module_name()}"
    return (f"{source}|{dtype}|{device}|{kernels}{mode}|{torch.get_num_threads()}|{torch.__version__}|"
            f"{cpu_name() if device == 'cpu' else torch.cuda.get_device_name() if torch.cuda.is_available() else device}")


def _key_of(lm) -> str:
    return curve_key(lm.source, lm.dtype, lm.device, getattr(lm, "kernels", "torch"), getattr(lm, "invariant", False))


_CURVES: dict[str, CostCurve] = {}  # per process: api.generate asks for every generation


def _read(key: str) -> CostCurve | None:
    """The cached curve for key, or None when missing, unreadable, of another format or old."""
    try:
        data = read_record(_cache_path(key), key, FORMAT, _valid_curve, "the cost-curve record")
        if data is None:
            return None
        if time.time() - float(data["measured_at"]) > MAX_AGE_DAYS * 86400:
            return None
        info = {k: data[k] for k in ("measured_at", "seconds", "rounds", "plausible") if k in data}
        return CostCurve({int(w): c for w, c in data["cost"].items()},
                         one_token_seconds=data.get("one_token_seconds"), info=info,
                         branch=float(data["branch"]), stream=float(data["stream"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(key: str, curve: CostCurve) -> None:
    record = {"key": key, "format": FORMAT, "measured_at": time.time(), "rounds": ROUNDS,
              "cost": curve.to_dict(), "one_token_seconds": curve.one_token_seconds,
              "branch": curve.branch, "stream": curve.stream, **curve.info}
    write_json(_cache_path(key), record)
    curve.info.setdefault("measured_at", record["measured_at"])


def cached_curve(key: str, model, remeasure: bool = False, quiet: bool = False,
                 desc: str = "measuring forward cost", measure_missing: bool = True,
                 clock=time.perf_counter) -> CostCurve | None:
    """The curve for key from this process, the disk cache, or measured now on `model` (cached
    only when plausible; None instead of measuring when measure_missing is False)."""
    if not remeasure:
        if key in _CURVES:
            return _CURVES[key]
        got = _read(key)
        if got is not None:
            _CURVES[key] = got
            return got
    if not measure_missing:
        return None
    context, rounds = budget_for(model)
    curve = _CURVES[key] = measure(model, context=context, repeats=rounds, quiet=quiet, desc=desc, clock=clock)
    if curve.info.get("plausible", True):
        _write(key, curve)
    return curve


def assume(lm, curve: CostCurve) -> None:
    """Take `curve` as the loaded model's for the rest of this process (nothing is cached): what
    `hd bench drafts --price-by` replays under, another model's measured curve, so that the trees
    and the drafting defaults (hdcli/compose.py) are those that model's curve would give."""
    _CURVES[_key_of(lm)] = curve


def from_report(rep: dict, what: str) -> CostCurve:
    """The curve of an `hd costs --json` report (its only curve, or the kernels' it ran on), or
    HdError naming `what` (the file) and what to do."""
    try:
        curves = rep["curves"]
        c = curves.get(rep.get("kernels")) or next(iter(curves.values()))
        curve = CostCurve({int(w): float(v) for w, v in c["cost"].items()},
                          None if c.get("one_token_ms") is None else float(c["one_token_ms"]) / 1e3,
                          info={"model": rep.get("model"), "source": rep.get("source"), "cpu": rep.get("cpu"),
                                "kernels": rep.get("kernels"), "measured_at": c.get("measured_at")},
                          branch=float(c.get("branch") or 0.0), stream=float(c.get("stream") or 0.0))
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration):
        raise HdError(f"{what}: not the output of `hd costs --json` (no curves.<kernels>.cost); "
                      "write it with `hd costs --model FILE --json > costs.json`") from None
    if curve.one_token_seconds is None:
        raise HdError(f"{what}: its curve has no one_token_ms; measure it again with `hd costs --remeasure --json`")
    return curve


def curve_for(lm, remeasure: bool = False, quiet: bool = False) -> CostCurve:
    """The cost curve of a loaded model (api.load_model), from the cache or measured now."""
    return cached_curve(_key_of(lm), lm.model, remeasure, quiet,
                        desc=f"measuring forward cost ({lm.dtype}, {getattr(lm, 'kernels', 'torch')} kernels)")


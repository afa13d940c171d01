"""Forward cost against the number of tokens verified, measured on this machine.

cost(w) is the time of one forward over w new tokens on top of a KV cache, divided by the time
of a one-token forward (so cost(1) = 1 and plain decoding costs 1 per token). It caps the draft
tree (hdcli/tree.py) and feeds the planner. The curve depends on the model, dtype, device and
thread count, so it is measured once per such combination (~1-3 s) and cached as JSON under
HD_CACHE_DIR (default ~/.cache/hdcli/costs). Between measured widths it is interpolated linearly;
beyond the last it grows linearly with the last slope.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .tree import new_cache

WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CHEAP_VERIFY = 1.45  # cost(8) at or below this (in one-token forwards): verification is nearly free


class CostCurve:
    """cost(w) relative to a one-token forward; one_token_seconds (when measured) makes it absolute."""

    def __init__(self, points: dict[int, float], one_token_seconds: float | None = None):
        self.one_token_seconds = one_token_seconds
        self.widths = sorted(int(w) for w in points)
        self.costs = [float(points[w]) for w in self.widths]
        if self.widths[0] != 1:
            raise ValueError("a cost curve starts at width 1")

    def __call__(self, w: int) -> float:
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

    def verifies_cheaply(self) -> bool:
        """Whether verifying 8 drafted tokens costs at most CHEAP_VERIFY one-token forwards.
        Measured here: fp32 on torch's kernels 1.60 (costly); fp32 on packed oneDNN kernels 1.23 and
        bf16 ~1.1 (cheap). The drafting defaults (api.default_min_n and its siblings) follow this."""
        return self(8) <= CHEAP_VERIFY

    def to_dict(self) -> dict:
        return {str(w): c for w, c in zip(self.widths, self.costs)}


def flat(cost: float = 1.0) -> CostCurve:
    """A curve where every forward costs the same (an idealised accelerator)."""
    return CostCurve({1: 1.0, 64: cost})


@torch.inference_mode()
def measure(model, context: int = 256, repeats: int = 5, widths=WIDTHS) -> CostCurve:
    """Median time of a w-token forward over a `context`-token cache, relative to w = 1."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ctx = torch.arange(context, device=device)[None] % vocab
    cache = new_cache(model)
    model(input_ids=ctx, past_key_values=cache, use_cache=True)
    base = cache.get_seq_length()
    seconds = {}
    for w in widths:
        ids = (torch.arange(w, device=device)[None] * 7 + 11) % vocab
        ts = []
        for _ in range(repeats + 1):  # the first run of a shape warms its kernels up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
            cache.crop(-(cache.get_seq_length() - base))
        seconds[w] = statistics.median(ts[1:])
    one = seconds[widths[0]]
    # a wider forward never costs less than a narrower one: noise must not invite wider trees
    points, top = {}, 0.0
    for w in widths:
        top = max(top, seconds[w] / one)
        points[w] = top
    points[1] = 1.0
    return CostCurve(points, one_token_seconds=one)


def _cache_path(key: str) -> Path:
    root = Path(os.environ.get("HD_CACHE_DIR", Path.home() / ".cache" / "hdcli")) / "costs"
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


_CURVES: dict[str, CostCurve] = {}  # per process: api.generate asks for every generation


def curve_for(lm) -> CostCurve:
    """The cost curve of a loaded model (api.load_model), from the cache or measured now."""
    key = (f"{lm.source}|{lm.dtype}|{lm.device}|{getattr(lm, 'kernels', 'torch')}|"
           f"{torch.get_num_threads()}|{torch.__version__}")
    if key in _CURVES:
        return _CURVES[key]
    path = _cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            _CURVES[key] = CostCurve({int(w): c for w, c in data["cost"].items()})
            return _CURVES[key]
    except (OSError, ValueError, KeyError):
        pass
    curve = _CURVES[key] = measure(lm.model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "cost": curve.to_dict()}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return curve

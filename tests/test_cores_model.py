"""benchmarks/cores.py's cost model: the fit recovers known constants from synthetic times, and
refuses inputs that cannot describe one machine. Pure arithmetic: no timing, no torch."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "cores.py"
_spec = importlib.util.spec_from_file_location("cores_under_test", _PATH)
cores = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cores
_spec.loader.exec_module(cores)

B, BW1, BW_MAX = 1.0e9, 20e9, 30e9          # 1 GB of weights, 20 GB/s on one core, 30 shared
GEMM = {1: 0.060, 2: 0.064, 4: 0.072, 8: 0.088, 16: 0.120}   # compute alone, one core (s)
S, A = 0.004, 0.0015                          # serial per forward, per-row rest (s)


def synthetic(c: int) -> dict:
    return {w: max(B / min(c * BW1, BW_MAX), g / c) + A * w / c + S for w, g in GEMM.items()}


def test_fit_recovers_constants_and_predicts_more_cores():
    consts = cores.fit(synthetic(1), GEMM, B, BW1)
    assert consts["s"] == pytest.approx(S, rel=1e-9)
    assert consts["a"] == pytest.approx(A, rel=1e-9)
    assert consts["fit_residual_max_pct"] == pytest.approx(0, abs=1e-9)
    for c in (2, 8):
        for w, t in synthetic(c).items():
            assert cores.predict(consts, w, c, BW_MAX) == pytest.approx(t, rel=1e-9)
    # at 8 cores one row is bandwidth-bound: B / BW_max + the row and serial parts
    assert cores.predict(consts, 1, 8, BW_MAX) == pytest.approx(B / BW_MAX + A / 8 + S)


def test_speedup_of_a_policy():
    t = lambda w: 0.010 * (1 + 0.1 * (w - 1))   # noqa: E731
    # half the steps at width 1, half at 3 (cost 1.2), 1.5 tokens a step, no overhead
    assert cores.policy_speedup({1: 5, 3: 5}, 1.5, t, 0.0) == pytest.approx(1.5 / 1.1)
    got = cores.speedups([{"name": "p", "histogram": {1: 5, 3: 5}, "mean_accepted": 1.5},
                          {"name": "uncapped", "mean_width": 11, "mean_accepted": 2.0}], t, 0.0)
    assert got["best_capped"]["policy"] == "p"
    assert got["uncapped_optimistic"] == pytest.approx(1.0)


def test_fit_refuses_impossible_inputs():
    with pytest.raises(ValueError):
        cores.fit({1: 0.1}, GEMM, B, BW1)                       # one width
    with pytest.raises(ValueError):
        cores.fit({w: 0.001 for w in GEMM}, GEMM, B, BW1)       # faster than its own floor
    with pytest.raises(ValueError):
        cores.fit({1: 0.1, 2: 0.0}, GEMM, B, BW1)               # a zero time
    # a different machine's times give other constants, not the true ones
    consts = cores.fit({w: t * 1.5 for w, t in synthetic(1).items()}, GEMM, B, BW1)
    assert consts["a"] != pytest.approx(A, rel=1e-3)

"""benchmarks/cores.py's cost model: the fit recovers known constants from synthetic times, and
refuses inputs that cannot describe one machine. Pure arithmetic: no timing, no torch."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "cores.py"
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


def _entry(shape: str) -> dict:
    """A measured cores.json "models" row for `shape`, made up (constants of this file)."""
    n = cores.shape_weights(shape)
    return {"source": f"/tmp/{shape}-Q4_K_M.gguf", "weight_bytes": 2 * n, "weights_by_type": {"dense/bfloat16": n},
            "gemm_compute_ms_1_thread": {str(w): 1000 * g for w, g in GEMM.items()},
            "fit": {"s_ms": 1000 * S, "a_ms_per_row": 1000 * A}}


def test_shape_projection_scales_by_weights_layers_and_hidden():
    entry = _entry("smollm2-1.7b")
    assert cores.shape_of(entry) == "smollm2-1.7b"
    # the 1.7B's Linear weights as hd loads it (24 layers, tied 49152 x 2048 head): 1,711,276,032
    assert cores.shape_weights("smollm2-1.7b") == 1711276032
    same = cores.shape_projection(entry, "smollm2-1.7b", BW1)["consts"]
    assert same["bytes"] == 2 * 1711276032 and same["s"] == pytest.approx(S) and same["a"] == pytest.approx(A)
    big = cores.shape_projection(entry, "llama-3.1-8b", BW1)
    r = cores.shape_weights("llama-3.1-8b") / cores.shape_weights("smollm2-1.7b")
    # the 8B's untied 128256 x 4096 head is counted once, as the tied ones are, its embedding not:
    # 7,504,658,432 Linear weights (+ 525M of embedding = the published 8.03B parameters)
    assert cores.shape_weights("llama-3.1-8b") == 7504658432
    assert big["ratios"]["weights"] == pytest.approx(r)
    assert big["consts"]["bytes"] == pytest.approx(same["bytes"] * r)
    for w in GEMM:
        assert big["consts"]["gemm"][w] == pytest.approx(GEMM[w] * r)
    assert big["consts"]["s"] == pytest.approx(S * 32 / 24)
    assert big["consts"]["a"] == pytest.approx(A * 32 * 4096 / (24 * 2048))
    # negative controls: an entry whose weights are not its file's shape is refused, and the
    # projection to another shape is not the measured one's
    wrong = dict(entry, weights_by_type={"dense/bfloat16": cores.shape_weights("smollm2-1.7b") + 1})
    with pytest.raises(ValueError):
        cores.shape_projection(wrong, "llama-3.1-8b", BW1)
    assert cores.predict(big["consts"], 1, 8, BW_MAX) != pytest.approx(cores.predict(same, 1, 8, BW_MAX), rel=0.5)

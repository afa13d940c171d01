"""The forward-cost curve: measured so that load cannot fake
it, re-measured when implausible or old; loading a model measures nothing. The measurement's
logic runs on a model's own clock (SleepyModel), so no test here rides on the machine's load.
And the cache the measurements are kept in (HD_CACHE_DIR): a malformed record is measured again,
a cache folder that cannot be one is one line."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from hdcli import api
from hdcli.engine import records
from hdcli.engine.decode import costs
from hdcli.engine.kernels import dense as kernels
from hdcli.engine import loader
from hdcli.engine.model.target import TransformersForward
from conftest import hd_main, hd_sub, one_line_error, tiny_llama


class Clock:
    """Seconds that pass only when a SleepyModel says its forward took them: what the tests check
    is the measurement's logic, not this machine's load (another process on the cores changes
    nothing here)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SleepyModel(TransformersForward):
    """A tiny llama (a TargetModel over transformers' forward) whose forward over w tokens takes
    base + per_token * w seconds on its own clock, except calls number `burst` (a set) that take
    `slow` times longer: another process loading the CPU."""

    def __init__(self, base=0.008, per_token=0.002, burst=(), slow=6.0):
        super().__init__(tiny_llama(40))
        self.base, self.per_token, self.burst, self.slow = base, per_token, set(burst), slow
        self.calls = 0
        self.clock = Clock()

    def forward(self, input_ids, cache=None, position_ids=None, mask=None):
        out = super().forward(input_ids, cache, position_ids, mask)
        t = self.base + self.per_token * input_ids.shape[1]
        if self.calls in self.burst:
            t *= self.slow
        self.calls += 1
        self.clock.now += t
        return out


def true_cost(m: SleepyModel, w: int) -> float:
    return (m.base + m.per_token * w) / (m.base + m.per_token)


WIDTHS = (1, 4, 16, 48)


def test_a_load_burst_cannot_fake_a_flat_curve():
    """Load that hits a whole stretch of the measurement (here: the prefill, the warm-ups and
    the first two timed rounds, the one-token forwards included) changes nothing: widths are
    interleaved and each keeps its least time. (Timing each width's repeats in one block and
    taking the median, as before, turned such a stretch into a flat 1.0 curve.)"""
    calm = SleepyModel()
    quiet = costs.measure(calm, context=8, repeats=6, widths=WIDTHS, clock=calm.clock)
    m = SleepyModel(burst=range(0, 1 + 4 + 2 * 4))
    curve = costs.measure(m, context=8, repeats=6, widths=WIDTHS, clock=m.clock)
    for w in WIDTHS:
        assert curve(w) == pytest.approx(quiet(w), rel=0.3), (w, curve.to_dict(), quiet.to_dict())
    assert curve(48) > 0.5 * true_cost(m, 48) > 5


class AfterWideModel(SleepyModel):
    """A forward right after one wider than 16 tokens takes `slow` times longer: what a CPU does
    after a wide forward for a while (a one-token forward after a 64-token one, docs/benchmarks.md)."""

    def __init__(self, slow=1.6):
        super().__init__()
        self.wide_slow, self.last = slow, 0

    def forward(self, input_ids, cache=None, position_ids=None, mask=None):
        before = self.clock.now
        out = super().forward(input_ids, cache, position_ids, mask)
        if self.last > 16:
            self.clock.now += (self.clock.now - before) * (self.wide_slow - 1)
        self.last = input_ids.shape[1]
        return out


def test_narrow_widths_are_never_timed_after_a_wide_forward(monkeypatch):
    """Timed among every width, the one-token forward always followed a 48-token one (the rotation
    puts it after the last width) and its slow time flattened the narrow curve; the narrow widths'
    own rounds give their true costs. Control: the same model measured over a rotation of all
    widths in one round reads cost(4) far below its true cost."""
    widths = (1, 4, 16, 48)
    m = AfterWideModel()
    curve = costs.measure(m, context=8, repeats=3, widths=widths, clock=m.clock)
    for w in (4, 16):
        assert curve(w) == pytest.approx(true_cost(m, w), rel=1e-6)
    flat = AfterWideModel()
    monkeypatch.setattr(costs, "NARROW", 64)   # every width in one phase: the measurement this replaced
    mixed = costs.measure(flat, context=8, repeats=3, widths=widths, clock=flat.clock)
    assert mixed(4) < 0.8 * true_cost(flat, 4)


def test_curve_is_monotone_and_starts_at_one():
    m = SleepyModel(per_token=0.0005)
    curve = costs.measure(m, context=8, repeats=2, widths=WIDTHS, clock=m.clock)
    assert curve(1) == 1.0 and all(a <= b for a, b in zip(curve.costs, curve.costs[1:]))
    # the one-token time is the one-token forward's, not a wider one's (a width-48 time taken
    # for it would be 48 tokens' worth)
    assert curve.one_token_seconds == pytest.approx(m.base + m.per_token)
    assert curve(48) == pytest.approx(true_cost(m, 48))


def test_implausible_flat_curve_is_measured_again_and_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "MIN_PARAMS_FOR_SLOPE", 0)  # treat the tiny model as a big one
    monkeypatch.setattr(costs, "FLAT_LIMIT", 1.5)
    m = SleepyModel(base=0.006, per_token=0.0)  # every width costs the same: impossible on a CPU
    key = "test-flat"
    curve = costs.cached_curve(key, m, quiet=True, clock=m.clock)
    assert curve.info["plausible"] is False
    assert m.calls > 1 + 2 * len(costs.WIDTHS) * (costs.ROUNDS + 1)  # two measurements (and prefills)
    assert costs._read(key) is None and not list((tmp_path / "costs").glob("*.json"))
    # a sane curve is cached, with its absolute times
    monkeypatch.setattr(costs, "MIN_PARAMS_FOR_SLOPE", 10 ** 12)
    costs._CURVES.clear()
    sane = SleepyModel()
    got = costs.cached_curve("test-sane", sane, quiet=True, clock=sane.clock)
    back = costs._read("test-sane")
    assert back is not None and back.to_dict() == got.to_dict()
    assert back.one_token_seconds == got.one_token_seconds


class LoadedWidthModel(SleepyModel):
    """A SleepyModel whose forwards of one width take `slow` times longer in its first
    measurement: a width every round of which another process's load hit."""

    def __init__(self, width: int, rounds: int, **kw):
        super().__init__(**kw)
        self.width, self.loaded_calls = width, rounds + 1

    def forward(self, input_ids, cache=None, position_ids=None, mask=None):
        if input_ids.shape[1] == self.width and self.loaded_calls > 0:
            self.loaded_calls -= 1
            self.burst.add(self.calls)
        return super().forward(input_ids, cache, position_ids, mask)


def test_a_width_loaded_in_every_round_is_measured_again(tmp_path, monkeypatch):
    """A curve that steps up faster than its rows (cost(16) six times cost(4)'s rows' worth, as a
    width whose every round was loaded reads) is implausible: measured again, the second
    measurement's sane curve is the one kept. Control: the same steep step is plausible where
    the limit allows it, and then kept as measured."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    m = LoadedWidthModel(16, costs.ROUNDS, slow=6.0)
    curve = costs.measure(m, context=8, widths=WIDTHS, clock=m.clock)
    assert curve.info["plausible"] is True and curve(16) == pytest.approx(true_cost(m, 16), rel=0.01)
    monkeypatch.setattr(costs, "STEEP_LIMIT", 100.0)
    m = LoadedWidthModel(16, costs.ROUNDS, slow=6.0)
    steep = costs.measure(m, context=8, widths=WIDTHS, clock=m.clock)
    assert steep(16) > 4 * true_cost(m, 16)


def test_old_foreign_or_stale_records_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    costs._write("k", costs.CostCurve({1: 1.0, 8: 1.3}, one_token_seconds=0.01))
    assert costs._read("k") is not None
    path = costs._cache_path("k")
    rec = json.loads(path.read_text())
    for change in ({"measured_at": time.time() - (costs.MAX_AGE_DAYS + 1) * 86400}, {"format": 1},
                   {"key": "another"}):
        path.write_text(json.dumps(rec | change))
        assert costs._read("k") is None, change
    path.write_text("{not json")
    assert costs._read("k") is None
    # the CPU model is part of every key: a curve from another machine is never read
    assert records.cpu_name() in costs.curve_key("m", "fp32", "cpu", "torch")


def test_loading_measures_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """`--kernels auto` and `--dtype auto` are decided without timing (their choices change the
    numbers: docs/dtype.md), so a load writes no cost curve; the choice is in the model's Numerics."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    costs._CURVES.clear()
    lm = api.load_model(str(tiny_model_dir), dtype="auto", kernels="auto", invariant="off", quiet=True)
    assert not list((tmp_path / "costs").glob("*.json"))
    assert lm.info["numerics"]["kernels"] == lm.kernels == ("onednn" if kernels.available() else "torch")
    assert lm.info["numerics"]["dtype"] == lm.dtype == ("bf16" if loader.native_bf16() else "fp32")


def test_hd_costs_shows_and_remeasures(tiny_model_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner
    from hdcli.cli import app
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    costs._CURVES.clear()
    r = CliRunner().invoke(app, ["costs", "--model", str(tiny_model_dir), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["cpu"] == records.cpu_name() and rep["kernels"] in rep["curves"]
    first = {k: c["measured_at"] for k, c in rep["curves"].items()}
    r = CliRunner().invoke(app, ["costs", "--model", str(tiny_model_dir), "--remeasure", "--json"])
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(again["curves"][k]["measured_at"] > first[k] for k in first)
    assert (rep["attention"] is None) == (not rep["invariant"])
    if rep["invariant"]:
        assert rep["attention"]["attention"] in ("fused", "torch")
    # the tiny checkpoint's layers (dense kernels) run as one compiled call where its attention is
    # the fused one, else as the Python blocks, and it says why
    fused = bool(rep["invariant"]) and rep["attention"]["attention"] == "fused"
    assert rep["layers"]["compiled"] is fused and bool(rep["layers"].get("why")) is not fused
    r = CliRunner().invoke(app, ["costs", "--model", str(tiny_model_dir)])
    assert r.exit_code == 0 and "1 token" in r.output
    assert ("its attention:" in r.output) == bool(rep["invariant"])
    assert ("its decoder blocks: one compiled call a forward" if fused else "its decoder blocks: the Python blocks") in r.output


# --- the cache the measurements are kept in (HD_CACHE_DIR) ------------------------------------

def _cache_records(cache):
    return {p.parent.name: p for p in cache.rglob("*.json") if p.parent.name in ("costs", "attention", "invariant")}


def test_malformed_cache_records_are_dropped_and_measured_again(tiny_model_dir, tmp_path):
    """A record with the right key and a wrong type (an edited or damaged file) made every run exit 1
    with a TypeError, `hd costs --remeasure` too. Now each is dropped in one line and measured again.
    Processes of their own: what a process decides once (the attention) is read from the records
    by a new one."""
    env = {**os.environ, "HD_CACHE_DIR": str(tmp_path / "cache")}
    m = str(tiny_model_dir)
    gen = ["generate", "-m", m, "-p", "the cat sat", "-n", "4", "--json"]
    first = hd_sub(*gen, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    records = _cache_records(tmp_path / "cache")
    assert set(records) == {"costs", "attention", "invariant"}, records
    bad = {"costs": ("cost", "x"), "attention": ("ms", None), "invariant": ("self_check", 5)}

    def spoil():
        for kind, (field, value) in bad.items():
            rec = json.loads(records[kind].read_text())
            records[kind].write_text(json.dumps({**rec, field: value}))
    spoil()
    p = hd_sub(*gen, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert json.loads(p.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    for kind, path in records.items():
        assert f"warning: {path}: " in p.stderr and "is malformed; re-measuring" in p.stderr, (kind, p.stderr)
        assert json.loads(path.read_text())[bad[kind][0]] != bad[kind][1]   # measured and written again
    spoil()
    p = hd_sub("costs", "-m", m, "--remeasure", "--json", env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("is malformed; re-measuring") == 2   # attention, invariant (costs: not read)


def test_a_cache_folder_that_cannot_be_one_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    m = str(tiny_model_dir)
    for cache in (afile, afile / "sub"):
        err = one_line_error(hd_main("generate", "-m", m, "-p", "x", env={**os.environ, "HD_CACHE_DIR": str(cache)}))
        assert f"HD_CACHE_DIR {cache}" in err and "set HD_CACHE_DIR to a writable folder" in err, err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "costs").write_text("")
    err = one_line_error(hd_main("generate", "-m", m, "-p", "x", env={**os.environ, "HD_CACHE_DIR": str(tmp_path / "c")}))
    assert f"{tmp_path / 'c' / 'costs'} is a file" in err
    # read-only (what a read-only home gives): hd works, measuring again each run, and says so once
    from hdcli.engine import environment
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "ro"))
    monkeypatch.setattr(environment.os, "access", lambda *a: False)
    environment.check_cache_dir()
    environment.check_cache_dir()
    err = capsys.readouterr().err
    assert err.count("is not writable") == 1 and "set HD_CACHE_DIR" in err

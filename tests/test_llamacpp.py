"""The `llama-cpp` bench method: llama.cpp on the same GGUF through llama-cpp-python.

Its plumbing (same prompt ids, stop rules, a fresh cache per answer, the summary's speedup and
answer counts against it, tables and chart) is tested with a stand-in `llama_cpp` module that
decodes greedily with hd's own model; the real library is tested where it is installed."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest
import torch

from hdcli import bench
from hdcli.bench import llamacpp, report
from hdcli.compose import DBs
from hdcli.config import DecodingConfig
from hdcli.errors import HdError

from test_bench import spec_file  # noqa: F401 (fixture)


def _stand_in(monkeypatch, module: types.ModuleType) -> None:
    """`module` as llama_cpp. It is one module with no llama.cpp beneath it, so no AMX weight
    buffers to turn off (bench/llamacpp.amx_off, on a CPU with AMX, patches llama_cpp.llama)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(llamacpp, "amx_off", lambda: False)


def _fake_llama_cpp(lm, calls: list) -> types.ModuleType:
    """A `llama_cpp` whose Llama decodes greedily with lm's model (a full forward per token)."""
    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_gpu_layers, verbose):
            calls.append(("load", model_path, n_threads))
            self.resets = 0

        def n_vocab(self):
            return lm.model.config.vocab_size

        def reset(self):
            self.resets += 1

        def set_seed(self, seed):
            pass

        def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty, reset, grammar=None):  # llama_cpp.Llama.generate's keywords
            calls.append(("generate", list(tokens), temp, self.resets))
            ids = list(tokens)
            while True:  # the caller stops it
                with torch.inference_mode():
                    nxt = int(lm.model.forward(torch.tensor([ids]))[-1].argmax())
                ids.append(nxt)
                yield nxt
    mod = types.ModuleType("llama_cpp")
    mod.Llama, mod.__version__ = Llama, "fake"
    return mod


@pytest.fixture
def gguf_lm(tiny_lm):
    """The tiny model as if loaded from a GGUF file (llama-cpp runs only GGUF files)."""
    return dataclasses.replace(tiny_lm, source="/models/tiny.gguf")


def test_llama_cpp_runs_as_a_method_beside_hd(gguf_lm, spec_file, monkeypatch):  # noqa: F811
    calls = []
    _stand_in(monkeypatch, _fake_llama_cpp(gguf_lm, calls))
    qs = bench.specbench.select(bench.specbench.load(spec_file), None)[:3]
    runners = bench.make_runners(gguf_lm, ["ar", "context", "llama-cpp"], DecodingConfig(), DBs())
    results = bench.run(gguf_lm, qs, runners, 12)
    s = bench.summarize(results)
    assert calls[0] == ("load", "/models/tiny.gguf", torch.get_num_threads())
    gens = [c for c in calls if c[0] == "generate"]
    # hd's prompt ids, greedy, each answer after a reset (the warm-up's, then one per turn)
    assert all(c[2] == 0.0 for c in gens) and [c[3] for c in gens] == list(range(1, len(gens) + 1))
    ar_turns = [t for _, turns in results["ar"] for t in turns]
    lc_turns = [t for _, turns in results["llama-cpp"] for t in turns]
    for a, b in zip(ar_turns, lc_turns):
        assert b.tokens == a.tokens and len(b.tokens) <= 12  # same model, same stop rules
        assert b.tokens[-1] in gguf_lm.eos_ids or len(b.tokens) == 12
    for m in ("ar", "context", "llama-cpp"):
        o = s[m]["overall"]
        assert o["differ_from_llama_cpp"] == 0 and o["speedup_over_llama_cpp"] > 0
    assert s["llama-cpp"]["overall"]["speedup_over_llama_cpp"] == pytest.approx(1.0)
    shown = {"model": "tiny", "dtype": "fp32", "device": "cpu", "questions": 3, "max_new_tokens": 12,
             "methods": s}
    from rich.console import Console
    con = Console(width=200, record=True)
    con.print(report.tables(shown))
    text = con.export_text()
    assert "vs lcpp" in text and "speedup over llama-cpp by category" in text


def test_llama_cpp_counts_answers_that_differ(gguf_lm, spec_file, monkeypatch):  # noqa: F811
    """A llama.cpp whose numerics differ: its answers are counted, not assumed equal."""
    calls = []
    fake = _fake_llama_cpp(gguf_lm, calls)
    real_gen = fake.Llama.generate

    def off_by_one(self, tokens, **kw):
        for i, t in enumerate(real_gen(self, tokens, **kw)):
            yield (t + 1) % gguf_lm.model.config.vocab_size if i == 2 else t
    fake.Llama.generate = off_by_one
    _stand_in(monkeypatch, fake)
    qs = bench.specbench.select(bench.specbench.load(spec_file), None)[1:3]
    results = bench.run(gguf_lm, qs, bench.make_runners(gguf_lm, ["ar", "llama-cpp"], DecodingConfig(), DBs()), 8)
    s = bench.summarize(results)
    assert s["llama-cpp"]["overall"]["differ_from_ar"] == 2
    assert s["ar"]["overall"]["differ_from_llama_cpp"] == 2
    assert s["ar"]["overall"]["first_differences_from_llama_cpp"] == [2, 2]


def test_llama_cpp_refusals_are_one_line(tiny_lm, gguf_lm, monkeypatch):
    with pytest.raises(HdError, match="GGUF") as e:
        llamacpp.LlamaCppModel(tiny_lm)  # a model folder
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert not llamacpp.available()
    with pytest.raises(HdError, match="pip install") as e:
        llamacpp.LlamaCppModel(gguf_lm)
    assert "llama-cpp-python" in str(e.value) and "\n" not in str(e.value)


def test_llama_cpp_refused_through_the_cli(tiny_model_dir, spec_file):  # noqa: F811
    from test_cli import run
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", str(tiny_model_dir),
            "--methods", "ar,llama-cpp", "-n", "4", "--json")
    assert isinstance(r, HdError) and "GGUF" in str(r)


@pytest.mark.bundled
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed (optional): pip install -e '.[llama-cpp]'")
def test_real_llama_cpp_on_the_bundled_gguf(bundled_lm):
    from hdcli.engine.text.prompts import encode_prompt
    from hdcli.engine.decode.verify import Sampling
    model = llamacpp.LlamaCppModel(bundled_lm)
    ids = [int(t) for t in encode_prompt(bundled_lm.tokenizer, "Name three colours.")]
    tokens, wall = model.answer(ids, 16, Sampling(), 0)
    again, _ = model.answer(ids, 16, Sampling(), 0)
    assert 0 < len(tokens) <= 16 and wall > 0
    assert again == tokens  # a fresh cache each answer: the same greedy answer
    assert tokens[-1] in bundled_lm.eos_ids or len(tokens) == 16

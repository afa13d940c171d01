"""The CLI through typer's runner, on the tiny model folder (no bundled model needed)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hdcli import cli
from hdcli.errors import HdError

from conftest import hd_main, one_line_error

runner = CliRunner()


def run(*args):
    """Invoke like the console script does: HdError becomes exit 2 with one line."""
    try:
        return runner.invoke(cli.app, list(args), catch_exceptions=False)
    except HdError as exc:
        return exc


def hd(*args):
    r = run(*args)
    if isinstance(r, HdError):
        raise AssertionError(f"unexpected error: {r}")
    assert r.exit_code == 0, r.output
    return r


def test_generate_streams_text_and_table(tiny_model_dir):
    r = hd("generate", "--model", str(tiny_model_dir), "-p", "the cat sat on the mat the cat",
           "-n", "20", "--no-color")
    assert "context" in r.output and "tok/s" in r.output


def test_generate_json_compare(tiny_model_dir):
    r = hd("generate", "--model", str(tiny_model_dir), "-p", "one two three one two three one",
           "-n", "30", "--json", "--compare")
    data = json.loads(r.stdout)
    assert data["compare"]["identical"] is True and data["compare"]["first_difference"] is None
    assert data["tokens"] == data["compare"]["plain"]["tokens"]
    st = data["stats"]
    assert st["new_tokens"] == len(data["tokens"]) == 30
    assert st["mean_accepted_tokens"] == pytest.approx(30 / st["steps"])
    assert data["compare"]["speedup"] == pytest.approx(
        st["tokens_per_second"] / data["compare"]["plain"]["stats"]["tokens_per_second"])
    ctx = st["layers"]["context"]
    assert st["steps"] - 1 <= ctx["queries"] <= st["steps"] and 0 <= ctx["accepted"] <= ctx["drafted"]


def test_generate_sampling_json_is_reproducible(tiny_model_dir):
    args = ("generate", "--model", str(tiny_model_dir), "-p", "hello world", "-n", "15", "--json",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "7")
    assert json.loads(hd(*args).stdout)["tokens"] == json.loads(hd(*args).stdout)["tokens"]


def test_raw_mode_and_prompt_file(tiny_model_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("red blue green red blue green red")
    data = json.loads(hd("generate", "--model", str(tiny_model_dir), "--prompt-file", str(f),
                         "--raw", "-n", "5", "--json").stdout)
    assert data["stats"]["prompt_tokens"] == 7


def test_stop_string(tiny_model_dir):
    base = json.loads(hd("generate", "--model", str(tiny_model_dir), "-p", "the cat sat", "-n", "20",
                         "--json").stdout)
    words = base["text"].split()
    assert len(words) > 3
    stop = words[2]
    data = json.loads(hd("generate", "--model", str(tiny_model_dir), "-p", "the cat sat", "-n", "20",
                         "--json", "--stop", stop).stdout)
    assert stop not in data["text"] and data["stop_reason"] == "stop"
    assert base["text"].startswith(data["text"].rstrip())


@pytest.mark.parametrize("args,msg", [
    (["-p", ""], "prompt is empty"),
    (["-p", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["-p", "hi", "--dtype", "fp8"], "--dtype"),
    (["-p", "hi", "--device", "tpu"], "--device"),
    (["-p", "hi", "--layers", "context,bogus"], "unknown drafting layer"),
    (["-p", "hi", "--top-p", "0"], "top_p"),
    (["-p", "hi", "--temperature", "-1"], "temperature"),
    (["-p", "hi", "--min-n", "3", "--max-n", "2"], "--min-n"),
    (["-p", "hi", "--prompt-file", "x.txt"], "not both"),
    (["--prompt-file", "/nonexistent/p.txt"], "cannot read"),
    ([], "no prompt"),
])
def test_bad_input_is_one_clear_line(tiny_model_dir, args, msg):
    r = run("generate", "--model", str(tiny_model_dir), *args)
    assert isinstance(r, HdError), getattr(r, "output", r)
    assert msg in str(r) and "\n" not in str(r)


def test_prompt_longer_than_context(tiny_model_dir):
    r = run("generate", "--model", str(tiny_model_dir), "-p", "the " * 300, "--raw")
    assert isinstance(r, HdError) and "context" in str(r)


@pytest.mark.parametrize("model,msg", [
    ("/nonexistent/model.gguf", "does not exist"),
    ("some-org/no-such-model", "could not load model"),
])
def test_unknown_models(model, msg, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("generate", "--model", model, "-p", "hi")
    assert isinstance(r, HdError) and msg in str(r)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = run("generate", "--model", str(bad), "-p", "hi")
    assert isinstance(r, HdError) and "not a GGUF" in str(r)


def test_console_script_exit_code(tiny_model_dir):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "hdcli.cli", "generate", "--model", str(tiny_model_dir),
                        "-p", ""], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: the prompt is empty: pass --prompt TEXT or --prompt-file FILE"]


def test_version():
    assert "hd " in hd("--version").output


def test_serve_takes_hd_api_key_first_and_refuses_it_empty(monkeypatch):
    monkeypatch.delenv("HD_API_KEY", raising=False)
    assert cli._api_keys(["k1"]) == ["k1"]
    monkeypatch.setenv("HD_API_KEY", "env-key")
    assert cli._api_keys(["k1"]) == ["env-key", "k1"]
    monkeypatch.setenv("HD_API_KEY", "  ")
    with pytest.raises(HdError, match="HD_API_KEY is set but empty"):
        cli._api_keys([])


def test_streamed_pieces_make_the_text_and_name_layers(tiny_lm):
    from hdcli import api
    pieces = []
    res = api.generate(tiny_lm, "the cat sat on the mat the cat sat on the", max_new_tokens=30,
                       on_text=lambda piece, layer: pieces.append((piece, layer)))
    assert "".join(p for p, _ in pieces) == res.text
    assert {layer for _, layer in pieces} <= {None, "context", "model"}   # the default layers
    assert sum(layer == "context" for layer in res.layers) == res.stats.layers["context"].accepted


def test_compare_says_why_transformers_differs_and_that_drafting_did_not():
    """A difference from transformers' stock forward is numerics (its kernels' rounding), not
    drafting: the line says so and names plain decoding as the exact reference. Control: where the
    outputs agree it says identical, and a drafting difference is still DIFFERENT in capitals."""
    import io
    from rich.console import Console
    from hdcli import show
    from hdcli.commands.generate import GenerateReport

    def line(identical: bool, hf_identical: bool) -> str:
        compare = {"identical": identical, "first_difference": None if identical else 3, "speedup": 2.0,
                   "hf_ar": {"tokens": [], "tokens_per_second": 10.0, "kernels": "torch", "dtype": "bf16"},
                   "speedup_over_hf_ar": 5.0, "identical_to_hf_ar": hf_identical,
                   "first_difference_from_hf_ar": None if hf_identical else 18}
        rep = GenerateReport({"model": "m", "dtype": "bf16", "device": "cpu", "config": {"temperature": 0},
                              "compare": compare}, {})
        buf = io.StringIO()
        show.generate(Console(file=buf, width=400), rep)
        return buf.getvalue()

    got = line(True, False)
    assert "output identical" in got
    assert "differs from token 18, by numerics, not drafting" in got and "plain decoding" in got
    assert "transformers' bf16 kernels" in got
    assert "output identical" in line(True, True).splitlines()[-1]
    assert "DIFFERENT from token 3" in line(False, False)


# --- options that contradict each other or are out of range, usage errors: one line each ------

@pytest.mark.parametrize("args,msg", [
    (["generate", "-p", "x", "--learn"], "--model-db"),
    (["generate", "-p", "x", "--no-db"], "--draft-models"),
    (["generate", "-p", "x", "--candidates", "0"], "--candidates"),
    (["generate", "-p", "x", "--policy", "greedy"], "--policy"),
    (["generate", "-p", "x", "--draft-len", "context=x"], "--draft-len"),
    (["generate", "-p", "x", "--draft-len", "bogus=3"], "unknown layer"),
    (["generate", "-p", "x", "--draft-models", "self:layers=1", "--level-tokens", "2,3"], "--level-tokens"),
])
def test_contradictory_or_invalid_flags(tiny_model_dir, args, msg):
    r = run(args[0], "--model", str(tiny_model_dir), *args[1:])
    assert isinstance(r, HdError) and msg in str(r) and "\n" not in str(r)


def test_bad_numbers_and_empty_lists_are_one_line_errors(tiny_model_dir, tmp_path):
    m = str(tiny_model_dir)
    cases = [
        (["generate", "--model", m, "-p", "the cat", "--temperature", "nan"], "temperature must be a finite"),
        (["generate", "--model", m, "-p", "the cat", "--temperature", "inf"], "temperature must be a finite"),
        (["generate", "--model", m, "-p", "the cat", "--temperature", "0.7", "--seed", str(2 ** 70)],
         "--seed must be between 0 and 2**64 - 1"),
        (["generate", "--model", m, "-p", "the cat", "--draft-len", "stats=0"],
         "--draft-len must be >= 1 for every layer, not stats=0"),
        (["plan", "--model", m, "--draft-models", " , "], "--draft-models is empty"),
        (["build-model-db", "--model", m, "-o", str(tmp_path / "missing" / "m.lmdb")],
         "output folder"),
    ]
    for args, want in cases:
        r = run(*args)
        assert isinstance(r, HdError), (args, getattr(r, "output", r))
        assert want in str(r) and "\n" not in str(r), (args, str(r))


def test_empty_stop_and_thresholds_out_of_range_are_refused(tiny_model_dir):
    m = str(tiny_model_dir)
    for args, want in ((["--stop", ""], "--stop takes non-empty strings"),
                       (["--stats-min-prob", "5"], "--stats-min-prob must be between 0 and 1, not 5.0"),
                       (["--stats-min-prob", "nan"], "--stats-min-prob must be a finite number, not nan"),
                       (["--stats-min-expected", "-1"], "--stats-min-expected must be a finite number >= 0"),
                       (["--stats-min-expected", "inf"], "--stats-min-expected must be a finite number, not inf")):
        r = run("generate", "-m", m, "-p", "the cat", *args)
        assert isinstance(r, HdError) and want in str(r), (args, getattr(r, "output", r))


@pytest.mark.parametrize("args", [["generate", "--bogus"], ["generate", "-n", "abc", "--json"],
                                  ["db", "info"], ["build-stats", "--json"], ["plan", "--count", "x"]])
def test_usage_errors_are_one_line(args):
    p = hd_main(*args)
    line = one_line_error(p)
    assert "--help" in line and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_max_new_tokens_past_the_context_is_said(tiny_lm):
    from hdcli.config import DecodingConfig
    from hdcli.commands.generate import generate_report
    said = []
    cfg = DecodingConfig(model=tiny_lm.name, max_new_tokens=10_000, layers=[])
    rep = generate_report(cfg, "the cat sat", lm=tiny_lm, on_status=said.append)
    warned = [s for s in said if s.startswith("warning: --max-new-tokens 10000 exceeds the room left in the "
                                              "model's context (")]
    assert len(warned) == 1, said
    room = int(warned[0].rsplit(" ", 1)[1])
    assert 0 < room < tiny_lm.max_context and len(rep.data["tokens"]) <= room
    said.clear()
    generate_report(cfg.replace(max_new_tokens=4), "the cat sat", lm=tiny_lm, on_status=said.append)
    assert not [s for s in said if "exceeds" in s]

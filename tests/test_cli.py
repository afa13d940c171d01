"""The CLI through typer's runner, on the tiny model folder (no bundled model needed)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hdcli import cli
from hdcli.errors import HdError

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
    assert {layer for _, layer in pieces} <= {None, "context", "recycle"}
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

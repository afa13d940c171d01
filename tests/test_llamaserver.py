"""The `llama-server*` bench methods: llama.cpp's server on the same GGUF, plain and with its own
n-gram speculation.

Their plumbing is tested against a fake llama-server: a small stdlib Python script, run as the
binary through HD_LLAMA_SERVER, that speaks /health, /v1/models and /completion with `timings`,
answers from a table of prompt ids the test writes, logs what it was sent, and can fail to load or
die mid-run. The real binary (`make llama-server`) is tested where it is built."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hdcli import bench
from hdcli.bench import llamaserver
from hdcli.compose import DBs
from hdcli.config import DecodingConfig
from hdcli.engine.decode.verify import Sampling
from hdcli.errors import HdError

from test_bench import spec_file  # noqa: F401 (fixture)
from test_llamacpp import gguf_lm  # noqa: F401 (fixture)

FAKE = textwrap.dedent('''\
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    env = os.environ.get
    if "--help" in args:
        print("--spec-type [" + env("FAKE_LLAMA_SPECS", "none|draft-simple|ngram-simple|ngram-map-k|"
              "ngram-map-k4v|ngram-mod|ngram-cache") + "]   comma-separated list of types")
        sys.exit(0)
    if "--version" in args:
        print("version: 1 (fake)")
        sys.exit(0)

    def note(record):
        with open(env("FAKE_LLAMA_LOG"), "a") as f:
            f.write(json.dumps(record) + "\\n")

    note({"argv": args})
    if env("FAKE_LLAMA_FAIL"):
        print("llama_model_load: error loading model: tensor 'x' has wrong shape", flush=True)
        print("main: exiting due to model loading error", flush=True)
        sys.exit(1)
    answers = json.load(open(env("FAKE_LLAMA_ANSWERS"))) if env("FAKE_LLAMA_ANSWERS") else {}
    die_after, health, served = int(env("FAKE_LLAMA_DIE_AFTER", "-1")), [0], [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":   # loading for its first two calls, as a real one is
                health[0] += 1
                self.reply(200 if health[0] > 2 else 503, {"status": "ok" if health[0] > 2 else "loading"})
            elif self.path == "/v1/models":
                self.reply(200, {"data": [{"meta": {"n_vocab": int(env("FAKE_LLAMA_VOCAB"))}}]})
            else:
                self.reply(404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            note({"request": body})
            if served[0] == die_after:
                print("llama-server: GGML_ASSERT(n_tokens > 0) failed: error in decode", flush=True)
                os._exit(134)
            served[0] += 1
            tokens = answers.get(json.dumps(body["prompt"]), [5, 6, 7])[:body["n_predict"]]
            n = len(tokens)
            self.reply(200, {"tokens": tokens, "timings": {
                "prompt_n": len(body["prompt"]), "prompt_ms": 10.0, "predicted_n": n,
                "predicted_ms": 40.0 * n, "predicted_per_second": 25.0, "draft_n": 4, "draft_n_accepted": 3}})

    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch, gguf_lm):  # noqa: F811
    """The fake llama-server as HD_LLAMA_SERVER; returns (its log, the answers file it reads)."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n" + FAKE)
    path.chmod(0o755)
    log, answers = tmp_path / "fake.jsonl", tmp_path / "answers.json"
    monkeypatch.setenv("HD_LLAMA_SERVER", str(path))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("FAKE_LLAMA_ANSWERS", str(answers))
    monkeypatch.setenv("FAKE_LLAMA_VOCAB", str(gguf_lm.model.config.vocab_size))
    answers.write_text("{}")
    return log, answers


def _logged(log: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, log.read_text().splitlines()) if key in r]


def _shown(summary: dict, **meta) -> str:
    from rich.console import Console
    from hdcli.bench import report
    con = Console(width=80, record=True)
    con.print(report.tables({"model": "tiny", "dtype": "fp32", "device": "cpu", "questions": 3,
                             "max_new_tokens": 12, "methods": summary, **meta}))
    return con.export_text()


def _run(lm, names, qs, n=12):
    runners = bench.make_runners(lm, names, DecodingConfig(), DBs())
    try:
        return bench.run(lm, qs, runners, n)
    finally:
        bench.close(runners)


def _ar_answers(lm, qs, n=12) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, tokens) of every answer plain decoding gives, the warm-up's first."""
    runners = bench.make_runners(lm, ["ar"], DecodingConfig(), DBs())
    seen, answer = [], runners["ar"].answer

    def recording(ids, *a, **kw):
        turn = answer(ids, *a, **kw)
        seen.append((list(ids), turn.tokens))
        return turn
    runners["ar"].answer = recording
    bench.run(lm, qs, runners, n)
    return seen


def test_llama_server_is_sent_hds_prompt_ids_and_timed_by_its_own_timings(gguf_lm, spec_file,  # noqa: F811
                                                                         fake_server):
    log, answers = fake_server
    qs = bench.specbench.select(bench.specbench.load(spec_file), None)[:3]
    ar = _ar_answers(gguf_lm, qs)
    answers.write_text(json.dumps({json.dumps(ids): tokens for ids, tokens in ar}))
    results = _run(gguf_lm, ["ar", "llama-server-ngram-mod"], qs)
    argv = _logged(log, "argv")[0]
    threads = str(torch.get_num_threads())
    assert argv[argv.index("-m") + 1] == "/models/tiny.gguf" and argv[argv.index("--spec-type") + 1] == "ngram-mod"
    assert argv[argv.index("-t") + 1] == threads and argv[argv.index("-tb") + 1] == threads
    sent = _logged(log, "request")
    assert [r["prompt"] for r in sent] == [ids for ids, _ in ar]   # hd's prompt ids, the warm-up's first
    assert all(r["temperature"] == 0 and r["top_k"] == 1 and r["cache_prompt"] is False and r["seed"] == 0
               and r["return_tokens"] for r in sent)
    assert [r["n_predict"] for r in sent] == [8] + [12] * (len(sent) - 1)
    turns = [t for _, ts in results["llama-server-ngram-mod"] for t in ts]
    for t in turns:   # its own timings: prompt_ms + predicted_ms, not the request's wall time
        assert t.wall_time == pytest.approx((10.0 + 40.0 * len(t.tokens)) / 1000)
        assert t.timings["predicted_n"] == len(t.tokens) and t.layers == {"ngram-mod": {"drafted": 4, "accepted": 3}}
    s = bench.summarize(results)["llama-server-ngram-mod"]["overall"]
    assert s["differ_from_ar"] == 0   # compared with hd's answers like every peer's
    per_question = [sum(len(t.tokens) for t in ts) / sum(t.wall_time for t in ts)
                    for _, ts in results["llama-server-ngram-mod"]]
    assert s["tokens_per_second"] == pytest.approx(sum(per_question) / len(per_question))
    own = s["own_timings"]
    assert own["predicted_n"] == sum(len(t.tokens) for t in turns) and own["draft_n_accepted"] == 3 * len(turns)
    assert own["predicted_per_second"] == pytest.approx(
        1000 * sum(len(t.tokens) - 1 for t in turns) / (40.0 * sum(len(t.tokens) for t in turns)))
    assert s["layers"]["ngram-mod"]["acceptance_rate"] == pytest.approx(0.75)
    text = _shown(bench.summarize(results))
    assert "tok/s by their own timings" in text and "llama-server-ngram-mod" in text and "75%" in text


def test_llama_server_answers_unlike_hds_are_counted(gguf_lm, spec_file, fake_server):  # noqa: F811
    _, answers = fake_server
    qs = bench.specbench.select(bench.specbench.load(spec_file), None)[1:3]   # single-turn questions
    ar = _ar_answers(gguf_lm, qs)
    table = {json.dumps(ids): list(tokens) for ids, tokens in ar}
    first = json.dumps(ar[1][0])
    assert len(table[first]) > 2
    table[first][2] = (table[first][2] + 1) % gguf_lm.model.config.vocab_size
    answers.write_text(json.dumps(table))
    s = bench.summarize(_run(gguf_lm, ["ar", "llama-server"], qs))["llama-server"]["overall"]
    assert s["differ_from_ar"] == 1 and s["first_differences"] == [2]


def test_its_answer_stops_at_hds_end_of_sequence(gguf_lm, fake_server):  # noqa: F811
    """llama.cpp stops at its own end-of-generation tokens; the answer kept stops by hd's rule."""
    _, answers = fake_server
    eos = sorted(gguf_lm.eos_ids)[0]
    answers.write_text(json.dumps({json.dumps([3, 4]): [5, eos, 6, 7], json.dumps([4]): [5, 6, 7, 8, 9]}))
    server = llamaserver.LlamaServer("llama-server", gguf_lm)
    try:
        assert server.answer([3, 4], 8, Sampling(), 0)[0] == [5, eos]
        assert server.answer([4], 3, Sampling(), 0)[0] == [5, 6, 7]
    finally:
        server.close()
    assert server.proc.poll() is not None and not Path(server.log.name).exists()


def test_a_missing_binary_skips_the_method_with_the_reason(tmp_path, monkeypatch, tiny_model_dir,
                                                           spec_file):  # noqa: F811
    from test_cli import hd
    monkeypatch.setenv("HD_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    why = bench.unavailable(["ar", "llama-server", "llama-server-ngram-mod"])
    assert set(why) == {"llama-server", "llama-server-ngram-mod"}
    assert all("no llama-server binary at" in w and "make llama-server" in w and "\n" not in w
               for w in why.values())
    r = hd("bench", "spec-bench", "--data", str(spec_file), "--model", str(tiny_model_dir), "--limit", "1",
           "--categories", "qa", "--methods", "ar,llama-server", "-n", "4", "--json")
    report = json.loads(r.stdout)
    assert list(report["methods"]) == ["ar"] and "no llama-server binary" in report["skipped"]["llama-server"]
    assert "not run here: llama-server " in " ".join(_shown(report["methods"], skipped=report["skipped"]).split())


def test_hd_as_avx2_takes_the_avx2_build_beside_it(tmp_path, monkeypatch):
    """Where hd runs as an AVX2 CPU (HD_CPU) its peer is llama-server-avx2 beside its Python when
    there is one (make llama-server-avx2), else llama-server; HD_LLAMA_SERVER wins over both."""
    import sys
    for name in ("python", "llama-server", "llama-server-avx2"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.delenv("HD_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("HD_CPU", raising=False)
    assert llamaserver.binary() == tmp_path / "llama-server"
    monkeypatch.setenv("HD_CPU", "avx2")
    assert llamaserver.binary() == tmp_path / "llama-server-avx2"
    (tmp_path / "llama-server-avx2").unlink()
    assert llamaserver.binary() == tmp_path / "llama-server"
    monkeypatch.setenv("HD_LLAMA_SERVER", str(tmp_path / "mine"))
    assert llamaserver.binary() == tmp_path / "mine"


def test_a_spec_type_the_binary_lacks_skips(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SPECS", "none,draft-simple,ngram-simple")
    assert llamaserver.unavailable("llama-server-ngram-simple") is None
    why = llamaserver.unavailable("llama-server-ngram-mod")
    assert "does not offer --spec-type ngram-mod" in why and "ngram-simple" in why


def test_a_server_that_dies_is_one_line(gguf_lm, spec_file, fake_server, monkeypatch):  # noqa: F811
    qs = bench.specbench.select(bench.specbench.load(spec_file), None)[1:3]
    monkeypatch.setenv("FAKE_LLAMA_DIE_AFTER", "2")   # the warm-up and one question, then it dies
    runners = bench.make_runners(gguf_lm, ["ar", "llama-server-ngram-simple"], DecodingConfig(), DBs())
    server = runners["llama-server-ngram-simple"].server
    try:
        with pytest.raises(HdError) as e:
            bench.run(gguf_lm, qs, runners, 8)
    finally:
        bench.close(runners)
    msg = str(e.value)
    assert "\n" not in msg and "'llama-server-ngram-simple'" in msg and "exited with status" in msg
    assert "GGML_ASSERT" in msg and server.proc.poll() is not None
    assert Path(server.log.name).is_file()   # the log it names is kept
    Path(server.log.name).unlink()


def test_a_server_that_cannot_load_is_one_line(gguf_lm, fake_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(HdError) as e:
        llamaserver.LlamaServer("llama-server", gguf_lm)
    msg = str(e.value)
    assert "\n" not in msg and "exited with status 1 loading /models/tiny.gguf" in msg
    assert "error loading model" in msg
    Path(msg.rsplit("its log: ", 1)[1].rstrip(")")).unlink()


def test_a_vocabulary_unlike_hds_is_refused(gguf_lm, fake_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_LLAMA_VOCAB", str(gguf_lm.model.config.vocab_size + 1))
    with pytest.raises(HdError, match="vocabulary") as e:
        llamaserver.LlamaServer("llama-server", gguf_lm)
    assert "\n" not in str(e.value)


def test_a_model_that_is_no_gguf_is_refused(tiny_lm, fake_server):
    with pytest.raises(HdError, match="GGUF") as e:
        llamaserver.LlamaServer("llama-server-ngram-mod", tiny_lm)
    assert "\n" not in str(e.value)


@pytest.mark.bundled
def test_real_llama_server_on_the_bundled_gguf(bundled_lm):
    why = llamaserver.unavailable("llama-server-ngram-mod")
    if why:
        pytest.skip(why)
    from hdcli.engine.text.prompts import encode_prompt
    ids = [int(t) for t in encode_prompt(bundled_lm.tokenizer, "Name three colours. Name three colours.")]
    for method in ("llama-server", "llama-server-ngram-mod"):
        server = llamaserver.LlamaServer(method, bundled_lm)
        try:
            tokens, wall, timings = server.answer(ids, 16, Sampling(), 0)
            again, _, _ = server.answer(ids, 16, Sampling(), 0)
        finally:
            server.close()
        assert 0 < len(tokens) <= 16 and wall > 0 and timings["prompt_n"] == len(ids)   # no BOS added, no reuse
        assert again == tokens   # no prefix reuse: the same greedy answer
        assert tokens[-1] in bundled_lm.eos_ids or len(tokens) == 16
        assert server.proc.poll() is not None

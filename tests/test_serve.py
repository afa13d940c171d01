"""`hd serve` (hdcli/serve) driven by the official `openai` client over loopback on a free port:
chat and completions, streamed and not, equal to `hd generate`; exact under concurrent load;
API key; bad input answered in OpenAI's error schema; a client that disconnects mid-stream; the
model DB learned across requests and kept across a restart; SIGTERM drains, SIGKILL mid-learning
leaves the DB intact.

The served model is a tiny llama with head_dim 16, which holds the M-invariant mode in fp32
(test_invariant.py), so requests are verified together in one forward."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from hdcli import api
from hdcli.serve import Server

from conftest import save_tiny_model

openai = pytest.importorskip("openai")

PROMPTS = ["the cat sat on", "a dog is very", "hello world", "one two three", "red blue green",
           "we run and jump", "the sun and the moon", "big small fast slow"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve-llama"), hidden=64)


def config(model_dir, **kw) -> api.DecodingConfig:
    return api.DecodingConfig(model=str(model_dir), dtype="fp32", kernels="torch", max_new_tokens=40, **kw)


class Running:
    """A Server serving from a thread of this process."""

    def __init__(self, cfg, **kw):
        self.server = Server(cfg, port=0, **kw)
        self.port = self.server.bind()
        self.uv = self.server.uvicorn_server()
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.server._sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(model_dir):
    r = Running(config(model_dir), max_batch=8)
    assert r.server.scheduler.batched, "the test model must hold the M-invariant mode"
    yield r
    r.stop()


def chat(client, name, prompt, **kw):
    return client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            return f.status, f.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_chat_and_completions_equal_hd_generate(served, model_dir):
    s, c = served.server, served.client()
    cfg = config(model_dir)
    for prompt in PROMPTS[:3]:
        ref = api.generate(s.lm, prompt, config=cfg)
        r = chat(c, s.name, prompt, max_tokens=40)
        assert r.choices[0].message.content == ref.text
        assert r.usage.completion_tokens == len(ref.tokens) and r.usage.prompt_tokens == len(ref.prompt_ids)
        hd = r.usage.model_extra["hd"]
        assert hd["steps"] >= 1 and hd["mean_accepted_tokens"] >= 1
        pieces, usage = [], None
        for ch in chat(c, s.name, prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                pieces.append(ch.choices[0].delta.content or "")
            else:
                usage = ch.usage
        assert "".join(pieces) == ref.text and usage.completion_tokens == len(ref.tokens)
    raw = api.generate(s.lm, "the cat sat", config=cfg.replace(chat=False))
    r = c.completions.create(model=s.name, prompt="the cat sat", max_tokens=40, temperature=0)
    assert r.choices[0].text == raw.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=s.name, prompt="the cat sat", max_tokens=40, temperature=0, stream=True) if ch.choices)
    assert streamed == raw.text
    assert [m.id for m in c.models.list().data] == [s.name]


def test_stop_strings_cut_streamed_and_whole_answers(served):
    s, c = served.server, served.client()
    whole = chat(c, s.name, PROMPTS[0], max_tokens=40).choices[0].message.content
    words = whole.split()
    assert len(words) > 4
    stop = " ".join(words[2:4])
    r = chat(c, s.name, PROMPTS[0], max_tokens=40, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    assert whole.startswith(r.choices[0].message.content)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       chat(c, s.name, PROMPTS[0], max_tokens=40, stop=[stop], stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content


def test_concurrent_requests_equal_each_alone(served, model_dir):
    """1, 3 and 7 other requests beside each, long and short: every answer is `hd generate`'s."""
    s = served.server
    cfg = config(model_dir)
    lengths = [40, 5, 30, 12, 40, 3, 25, 40]
    refs = [api.generate(s.lm, p, config=cfg.replace(max_new_tokens=n)).text for p, n in zip(PROMPTS, lengths)]
    before = s.metrics.forward_requests._sum.get()
    forwards = s.metrics.forwards._value.get()
    for width in (2, 4, 8):
        with ThreadPoolExecutor(width) as pool:
            got = list(pool.map(lambda i: chat(served.client(), s.name, PROMPTS[i], max_tokens=lengths[i])
                                .choices[0].message.content, range(width)))
        assert got == refs[:width]
    per_forward = (s.metrics.forward_requests._sum.get() - before) / (s.metrics.forwards._value.get() - forwards)
    assert per_forward > 1.0   # requests were verified together


def test_api_key_refused_and_accepted(model_dir):
    r = Running(config(model_dir), api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(r.client(), r.server.name, "hello", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            chat(r.client("wrong"), r.server.name, "hello", max_tokens=3)
        assert chat(r.client("sekrit"), r.server.name, "hello", max_tokens=3).choices[0].message.content is not None
        assert http("GET", r.url + "/health")[0] == 200
    finally:
        r.stop()


def test_bad_input_gets_openai_errors_and_the_server_goes_on(served):
    s, url = served.server, served.url + "/v1/chat/completions"
    ok = {"model": s.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    cases = [
        (b"{not json", 400, None),
        (json.dumps([1, 2]).encode(), 400, None),
        (json.dumps({**ok, "frobnicate": 1}).encode(), 400, "frobnicate"),
        (json.dumps({**ok, "max_tokens": "3"}).encode(), 400, "max_tokens"),
        (json.dumps({**ok, "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({**ok, "messages": []}).encode(), 400, "messages"),
        (json.dumps({**ok, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages.0.role"),
        (json.dumps({**ok, "max_tokens": 10 ** 6}).encode(), 400, "max_tokens"),
        (json.dumps({**ok, "n": 2}).encode(), 400, "n"),
        (json.dumps({**ok, "model": "gpt-4"}).encode(), 404, "model"),
        (json.dumps({**ok, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(), 413, None),
    ]
    for body, status, param in cases:
        got, text = http("POST", url, body)
        err = json.loads(text)["error"]
        assert got == status, (body[:80], text)
        assert err["message"] and err["type"] and err["param"] == param, text
    assert http("GET", served.url + "/v1/nope")[0] == 404
    assert http("GET", url)[0] == 405
    # the client's models.retrieve: the served model's card, 404 model_not_found for another id
    assert served.client().models.retrieve(s.name).id == s.name
    got, text = http("GET", served.url + "/v1/models/gpt-4")
    assert got == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        chat(served.client(), s.name, "hello", max_tokens=10 ** 6)
    assert chat(served.client(), s.name, "hello", max_tokens=3).choices[0].finish_reason in ("length", "stop")


def test_a_client_leaving_mid_stream_stops_its_decode_only(served, model_dir, monkeypatch):
    s = served.server
    ended = []
    finish = s.scheduler.on_finish
    monkeypatch.setattr(s.scheduler, "on_finish", lambda job: (ended.append(job), finish(job)))
    step = s.scheduler.on_step
    monkeypatch.setattr(s.scheduler, "on_step", lambda jobs, n: (time.sleep(0.02), step(jobs, n)))
    ref = api.generate(s.lm, PROMPTS[1], config=config(model_dir)).text
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: chat(served.client(), s.name, PROMPTS[1], max_tokens=40).choices[0].message.content)
        stream = chat(served.client(), s.name, PROMPTS[0], max_tokens=200, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert other.result() == ref
    deadline = time.time() + 20
    while not any(j.finish_reason == "cancelled" for j in ended):
        assert time.time() < deadline, [j.finish_reason for j in ended]
        time.sleep(0.05)
    gone = next(j for j in ended if j.finish_reason == "cancelled")
    assert len(gone.stream.out) < 200
    assert s.scheduler.load() == (0, 0) or time.sleep(0.5) or s.scheduler.load() == (0, 0)


def model_db(lm, path):
    """A model DB that knows nothing of the test prompts yet."""
    from hdcli.db import modeldb
    samples = path.with_suffix(".jsonl")
    modeldb.sample(lm, ["zzz"], samples, max_new_tokens=4, temperature=0.0, batch_size=1)
    modeldb.index(samples, path, lm.tokenizer, "tiny", min_count=1)
    return path


def model_acceptance(client, name, prompts) -> float:
    drafted = accepted = 0
    for p in prompts:
        layers = chat(client, name, p, max_tokens=30).usage.model_extra["hd"]["layers"]
        drafted += layers.get("model", {}).get("drafted", 0)
        accepted += layers.get("model", {}).get("accepted", 0)
    return accepted / max(drafted, 1), accepted


def test_learning_across_requests_rises_and_survives_a_restart(served, model_dir, tmp_path):
    db = model_db(served.server.lm, tmp_path / "m.lmdb")
    cfg = config(model_dir, model_db=str(db), learn=True, layers=["model"],
                 stats_min_prob=0.0, stats_min_expected=0.0)
    r = Running(cfg)
    try:
        first_rate, first = model_acceptance(r.client(), r.server.name, PROMPTS)
        deadline = time.time() + 20
        while r.server.learner.learned < len(PROMPTS):
            assert time.time() < deadline
            time.sleep(0.05)
        second_rate, second = model_acceptance(r.client(), r.server.name, PROMPTS)
        assert second > first and second_rate > first_rate
    finally:
        r.stop()
    r = Running(cfg)
    try:
        _, after = model_acceptance(r.client(), r.server.name, PROMPTS)
        assert after > first
        metrics = http("GET", r.url + "/metrics")[1]
        assert re.search(r'hd_accepted_drafts_total\{layer="model"\} [1-9]', metrics)
        assert "hd_learned_generations_total" in metrics
    finally:
        r.stop()


def start_cli(model_dir, *args):
    from hdcli.serve.spawn import spawn
    p, url, seen = spawn(["--model", str(model_dir), "--dtype", "fp32", "--kernels", "torch", *args],
                         timeout=120, env=os.environ.copy())
    return p, int(url.rsplit(":", 1)[1].split("/")[0]), seen


def test_sigterm_drains_running_requests_then_exits(model_dir):
    p, port, _ = start_cli(model_dir, "--json")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        name = json.loads(http("GET", f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: chat(client, name, PROMPTS[0], max_tokens=200))
            time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            r = fut.result(timeout=60)
        assert r.choices[0].finish_reason in ("length", "stop")
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        assert json.loads(out)["requests"] >= 1
    finally:
        p.kill()


def test_sigkill_mid_learning_leaves_the_model_db_intact(model_dir, tmp_path):
    from hdcli.db.stores import Store
    from hdcli.engine import models
    lm = models.load(str(model_dir), dtype="fp32", device="cpu", kernels="torch", quiet=True)
    db = model_db(lm, tmp_path / "m.lmdb")
    p, port, _ = start_cli(model_dir, "--model-db", str(db), "--learn", "-n", "60")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        name = json.loads(http("GET", f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        for i in range(6):
            chat(client, name, PROMPTS[i % len(PROMPTS)] + " and" * i, max_tokens=60)
        p.send_signal(signal.SIGKILL)   # generations are still being learned, or just were
        p.wait(30)
    finally:
        p.kill()
    report = Store(db).verify()
    assert report["ok"], report
    p, port, _ = start_cli(model_dir, "--model-db", str(db), "--learn")
    try:
        assert http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


@pytest.mark.parametrize("args,says", [(["--port", "99999"], "--port 99999"), (["--max-batch", "0"], "--max-batch"),
                                       (["--learn"], "--learn"), (["--api-key", " "], "--api-key")])
def test_bad_options_are_one_line_errors(model_dir, args, says):
    p = subprocess.run([sys.executable, "-m", "hdcli.cli", "serve", "--model", str(model_dir), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_served_connections_send_without_waiting_for_acks():
    """The listening socket says TCP, so asyncio (uvicorn's server) turns Nagle's algorithm off on
    every connection it accepts: a response's body is not held for the client's delayed ACK (40
    ms a request on a kept-alive connection before). A socket made with protocol 0, as hd's was,
    gets no TCP_NODELAY: the check can fail."""
    import asyncio
    import socket
    from hdcli.serve import listening_socket

    async def nodelay_of(lsock) -> int:
        got = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                got.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()
        server = await asyncio.get_running_loop().create_server(Probe, sock=lsock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", lsock.getsockname()[1])
            value = await asyncio.wait_for(got, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(nodelay_of(listening_socket("127.0.0.1", 0))) != 0
    bare = socket.socket(socket.AF_INET, socket.SOCK_STREAM)   # protocol 0
    bare.bind(("127.0.0.1", 0))
    bare.listen(4)
    assert asyncio.run(nodelay_of(bare)) == 0


def test_the_fields_apps_send_are_taken_at_neutral_values_and_refused_otherwise():
    """Issue 39: a body with the fields OpenAI clients send by default is accepted; each field at a
    value hd does not implement is a 400 naming it (never silently ignored)."""
    from hdcli.serve import protocol
    msgs = [{"role": "user", "content": "hi"}]
    neutral = {"model": "m", "messages": msgs, "frequency_penalty": 0, "presence_penalty": 0.0,
               "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
               "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "store": False,
               "metadata": {"app": "x"}, "service_tier": "auto", "user": "u"}
    assert protocol.parse(protocol.ChatRequest, neutral).messages[0].content == "hi"
    assert protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": None,
                                                       "frequency_penalty": 0, "logit_bias": {}})
    for field, value in [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("logit_bias", {"5": 10}),
                         ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("tool_choice", "required")]:
        with pytest.raises(protocol.ApiError) as err:
            protocol.parse(protocol.ChatRequest, {**neutral, field: value})
        assert err.value.status == 400 and err.value.param == field, field
    with pytest.raises(protocol.ApiError) as err:
        protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 2})
    assert err.value.param == "logprobs"
    with pytest.raises(protocol.ApiError) as err:  # still strict: an unknown field is refused
        protocol.parse(protocol.ChatRequest, {**neutral, "frobnicate": 1})
    assert err.value.param == "frobnicate"

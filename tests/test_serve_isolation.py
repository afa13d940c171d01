"""`hd serve` keeps tenants and requests apart: tenants never cross (structured scopes, unique key
names, /metrics behind an admin key), no 500 for bad input, bad options refused at start, and one
request's fault fails that request only: the decode loop goes on, other requests' tokens stay
plain decoding's."""
from __future__ import annotations

import hashlib
import json
import math
import threading

import pytest

from conftest import PATIENCE, hd_sub, one_line_error
from hdcli import api
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.draft import Draft
from hdcli.engine.decode.request import Request
from hdcli.errors import HdError
from hdcli.serve.server import Server, listening_socket
from hdcli.serve import tenants
from hdcli.serve.scheduler import Job, Scheduler

from test_serve import PROMPTS, Running, chat, config, http, model_dir  # noqa: F401 - model_dir: a fixture

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("keys") / "keys"
    f.write_text("acme KA\nacme:eu KB\n")
    return f


@pytest.fixture(scope="module")
def served(model_dir, keys_file):
    """Two tenants whose names and users would have joined into one scope string."""
    r = Running(config(model_dir), api_keys_file=str(keys_file), metrics_key="KM", learn_scope="user", max_batch=8)
    assert r.server.scheduler.batched
    yield r
    r.stop()


# --- class 2: tenants crossing ------------------------------------------------------------------

def test_user_scopes_of_different_keys_never_meet(served):
    """Key `acme` with user `eu:bob` and key `acme:eu` with user `bob` made one scope string
    "user:acme:eu:bob": the second drafted the first's answers. Scopes are tuples now, their DB
    tags hash length-prefixed parts; a key scope keeps its former tag (its learned answers stay)."""
    s = served.server
    a, b = s.scope_for("acme", "eu:bob"), s.scope_for("acme:eu", "bob")
    assert a != b and tenants.tag(a) != tenants.tag(b)
    assert s.tenants.recycled(a) is not s.tenants.recycled(b)
    assert tenants.tag(("user", "a", "bc")) != tenants.tag(("user", "ab", "c"))
    assert tenants.tag(("key", "acme")) == hashlib.blake2b(b"key:acme", digest_size=8).digest()
    assert tenants.tag(("user", "acme", "\ud800")) is not None   # a JSON user may hold a lone surrogate


def test_two_keys_never_share_a_name(tmp_path):
    """A keys file's `key-1 K` took the name of the first --api-key, two `alice` lines one scope:
    duplicate names are refused at start, naming the file and line; names hd makes up hold a
    space, which a file's NAME cannot."""
    f = tmp_path / "keys"
    f.write_text("# tenants\nalice K1\nbob K2\n\nalice K3\n")
    with pytest.raises(HdError, match=rf"{f} line 5: the name 'alice' is also on line 2"):
        tenants.Keys.load([], f)
    f.write_text("key-1 K1\nK2\n")
    keys = tenants.Keys.load(["K0"], f)
    names = [keys.identify(k) for k in ("K0", "K1", "K2")]
    assert len(set(names)) == 3 and names[1] == "key-1"
    assert " " in names[0] and " " in names[2]


def test_duplicate_key_names_stop_hd_serve_in_one_line(tmp_path, model_dir):
    f = tmp_path / "keys"
    f.write_text("alice K1\nalice K2\n")
    err = one_line_error(hd_sub("serve", "--model", model_dir, "--api-keys-file", f, timeout=PATIENCE))
    assert f"{f} line 2" in err and "alice" in err


def test_a_tenant_key_cannot_read_metrics(served):
    """/metrics moves with every request (prompt tokens, cached prefix tokens, latency): with
    several tenants it answers only to --metrics-key."""
    url = served.url + "/metrics"
    with served.client("KA") as c:
        chat(c, served.server.name, PROMPTS[0], max_tokens=5)
    assert http("GET", url)[0] == 401
    for tenant in ("KA", "KB"):
        status, body = http("GET", url, headers={"Authorization": f"Bearer {tenant}"})
        assert status == 401 and "hd_prompt_tokens" not in body and "metrics-key" in body
    status, body = http("GET", url, headers={"Authorization": "Bearer KM"})
    assert status == 200 and "hd_prompt_tokens_total" in body


def test_metrics_readers_are_chosen_at_start():
    from hdcli.serve.metrics import Readers
    two = tenants.Keys.load(["K1", "K2"])
    with pytest.raises(HdError, match="--metrics-key"):
        Readers(two, protect=True)           # used to let every tenant read every other's counters
    with pytest.raises(HdError, match="also an API key"):
        Readers(two, admin_key="K2")
    from hdcli.serve.protocol import ApiError
    with pytest.raises(ApiError) as e:
        Readers(two).check("Bearer K1")
    assert e.value.status == 403 and "--metrics-key" in e.value.message
    Readers(tenants.Keys.load(["K1"]), protect=True).check("Bearer K1")   # one tenant: its key
    Readers(None).check("")                                               # an open server: open


# --- class 7: 500s and wrong acceptance -------------------------------------------------------

def body(served, **fields) -> bytes:
    return json.dumps({"model": served.server.name, "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize("key", ["²", "٣", "3.0", "-1", " 3", "1e3"])
def test_logit_bias_takes_ascii_digits_only(served, key):
    """"²" passed str.isdigit and crashed int() (500); "٣" was read as token 3."""
    status, text = http("POST", served.url + "/v1/completions", body(served, prompt="the cat", logit_bias={key: 5}),
                        headers={"Authorization": "Bearer KA"})
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == "logit_bias"


def test_a_lone_surrogate_is_a_400_on_both_routes(served):
    auth = {"Authorization": "Bearer KA"}
    raw = body(served, prompt="PLACE").replace(b"PLACE", b"the cat \\ud800")
    status, text = http("POST", served.url + "/v1/completions", raw, headers=auth)
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt", text
    raw = body(served, messages=[{"role": "user", "content": "PLACE"}]).replace(b"PLACE", b"\\udc00 hi")
    status, text = http("POST", served.url + "/v1/chat/completions", raw, headers=auth)
    assert status == 400 and json.loads(text)["error"]["param"] == "messages.0.content", text


@pytest.mark.parametrize("option,value", [("drain_timeout", math.nan), ("drain_timeout", math.inf),
                                          ("drain_timeout", -1.0), ("prefix_cache_mb", math.nan),
                                          ("prefix_cache_mb", math.inf), ("prefix_cache_mb", -1.0)])
def test_non_finite_serve_options_are_refused(model_dir, option, value):
    flag = "--" + option.replace("_", "-")
    with pytest.raises(HdError, match=rf"{flag} must be a finite number"):
        Server(config(model_dir), port=0, **{option: value})


def test_nan_drain_timeout_stops_hd_serve_in_one_line(model_dir):
    err = one_line_error(hd_sub("serve", "--model", model_dir, "--drain-timeout", "nan", "--port", "0",
                                 timeout=PATIENCE))
    assert "--drain-timeout" in err and "nan" in err


@pytest.mark.parametrize("host,says", [("999.1.1.1", "is neither an IP address nor a name that resolves"),
                                       ("192.0.2.77", "is not an address of this machine")])
def test_a_host_that_is_not_this_machines_names_the_host(host, says):
    with pytest.raises(HdError) as e:
        listening_socket(host, 0)
    assert f"--host {host} {says}" in str(e.value) and "--port" not in str(e.value)


# --- class 3, the loop: one request's fault fails that request only -------------------------

class Faulty:
    """A drafter that fails for prompts holding `poison`: raises `exc`, or (exc None)
    proposes a token id outside the vocabulary (a DB with out-of-vocabulary ids); others get
    `inner`'s drafts (None: no drafts, plain decoding)."""

    def __init__(self, inner, poison: list[int], exc: Exception | None = None, vocab: int = 0):
        self.inner, self.poison, self.exc, self.vocab = inner, poison, exc, vocab
        self.poisoned = False

    def reset(self, tokens):
        n = len(self.poison)
        self.poisoned = any(list(tokens[i:i + n]) == self.poison for i in range(len(tokens) - n + 1))
        if self.inner is not None:
            self.inner.reset(tokens)

    def propose(self, history, max_len, stats=None):
        if self.poisoned:
            if self.exc is not None:
                raise self.exc
            return [Draft((self.vocab + 7, 3), "context")]
        return self.inner.propose(history, max_len, stats) if self.inner is not None else []

    def __getattr__(self, name):
        if name == "records":
            return getattr(self.inner, "records", False)
        return getattr(self.inner, name)


def ids_of(server, prompt: str) -> list[int]:
    return [int(t) for t in server.lm.tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def plain(server, ids, n):
    return Decoder(server.lm.model, server.lm.eos_ids).generate(ids, max_new_tokens=n).tokens


def run_jobs(sched: Scheduler, prompts: list[list[int]], n: int = 24) -> list[Job]:
    """Jobs submitted before the loop starts, so that its first turn admits them all together."""
    left = threading.Semaphore(0)
    jobs = [Job(Request(p, max_new_tokens=n),
                emit=lambda ev: left.release() if ev[0] == "done" else None) for p in prompts]
    for job in jobs:
        assert sched.submit(job)
    if sched._thread is None:
        sched.start()
    for _ in jobs:
        assert left.acquire(timeout=60)
    return jobs


@pytest.mark.parametrize("fault", ["oov", "raise"])
def test_a_fault_in_one_batched_request_leaves_the_others_exact(served, fault):
    """Four requests in one batch, one whose drafter fails (an id outside the vocabulary used to
    raise IndexError in the shared forward and end the loop): a raising drafter ends its request
    with an error, ids outside the vocabulary are cut from the drafts (that request is exact too),
    the others' tokens are plain decoding's, and the loop serves the next requests."""
    s = served.server
    prompts = [ids_of(s, p) for p in PROMPTS[:4]]
    bad = prompts[2]
    vocab = s.lm.model.config.vocab_size
    exc = None if fault == "oov" else IndexError("index 99 is out of bounds")
    assert s.scheduler.cost is not None   # trees capped jointly over the batch, as served
    sched = Scheduler(s.lm, lambda scope: Faulty(s._drafter(scope), bad, exc, vocab), cost=s.scheduler.cost,
                      max_batch=8)
    try:
        jobs = run_jobs(sched, prompts)
        if fault == "oov":   # the decode loop cuts drafts before an id outside the vocabulary
            assert jobs[2].finish_reason in ("eos", "length") and jobs[2].stream.out == plain(s, bad, 24)
        else:
            assert jobs[2].finish_reason == "error" and "IndexError: index 99" in jobs[2].error
        for job in jobs[:2] + jobs[3:]:
            assert job.finish_reason in ("eos", "length") and job.stream.out == plain(s, list(job.request.prompt_ids), 24)
        assert sched.failed is None and sched.alive()
        again = run_jobs(sched, [prompts[0], prompts[3]])
        assert [j.stream.out for j in again] == [plain(s, p, 24) for p in (prompts[0], prompts[3])]
    finally:
        sched.stop(timeout=30)


def test_a_failed_shared_forward_ends_its_requests_cleanly(served, monkeypatch):
    """A forward shared by several requests that fails may have written into any of their caches:
    they all end with an error naming it (never with tokens from a damaged cache); the loop goes on."""
    from hdcli.serve import scheduler as sched_mod
    s = served.server
    real = sched_mod.batch.forward_many
    calls = []

    def failing_once(model, items):
        calls.append(len(items))
        if len(calls) == 2 and len(items) > 1:
            raise RuntimeError("simulated fault in a batched forward")
        return real(model, items)
    monkeypatch.setattr(sched_mod.batch, "forward_many", failing_once)
    prompts = [ids_of(s, p) for p in PROMPTS[4:7]]
    sched = Scheduler(s.lm, s._drafter, cost=None, max_batch=8)
    try:
        jobs = run_jobs(sched, prompts)
        assert calls[1] == 3
        for job in jobs:
            assert job.finish_reason == "error" and "shared with 2 other" in job.error
        again = run_jobs(sched, prompts[:2])
        assert [j.stream.out for j in again] == [plain(s, p, 24) for p in prompts[:2]]
        assert sched.failed is None
    finally:
        sched.stop(timeout=30)


def test_a_failing_request_gets_a_500_and_the_server_goes_on(served, model_dir):
    """Over HTTP: the faulty request's client gets a 500 with a one-line message, /health stays
    200, the next request is answered with plain decoding's text."""
    s, sched = served.server, served.server.scheduler
    bad = "red blue green"
    real = sched.drafter_for
    sched.drafter_for = lambda scope: Faulty(real(scope), ids_of(s, f"<|user|> {bad}"),
                                             ZeroDivisionError("drafter broke"))
    try:
        with served.client("KB") as c:
            with pytest.raises(openai.InternalServerError) as e:
                chat(c, s.name, bad, max_tokens=20)
            message = e.value.body["message"]
            assert "ZeroDivisionError: drafter broke" in message and "\n" not in message
            assert http("GET", served.url + "/health")[0] == 200
            ref = api.generate(s.lm, PROMPTS[1], config=config(model_dir).replace(max_new_tokens=20))
            assert chat(c, s.name, PROMPTS[1], max_tokens=20).choices[0].message.content == ref.text
    finally:
        sched.drafter_for = real
    assert sched.failed is None


def test_bookkeeping_that_fails_leaves_the_answer(served):
    """on_finish (metrics, learning) raising is logged; the request keeps its answer, the loop goes on."""
    s = served.server

    def broken(job):
        raise KeyError("metrics")
    sched = Scheduler(s.lm, s._drafter, cost=None, max_batch=8, on_finish=broken)
    try:
        p = ids_of(s, PROMPTS[0])
        jobs = run_jobs(sched, [p]) + run_jobs(sched, [p])
        assert all(j.finish_reason in ("eos", "length") and j.stream.out == plain(s, p, 24) for j in jobs)
    finally:
        sched.stop(timeout=30)

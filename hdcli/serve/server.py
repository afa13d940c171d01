"""`hd serve`: an OpenAI-compatible server over hd's lossless speculative decoding.

    from hdcli import api
    from hdcli.serve.server import Server
    server = Server(api.DecodingConfig(model_db="model.lmdb", learn=True), port=8000)
    server.run()                      # until SIGTERM / Ctrl-C: drains running requests, then exits

One configuration (hdcli/config.py, the same options as `hd generate`) sets the model, dtype,
drafting layers and DBs; a request's own fields (max_tokens, temperature, top_p, seed, stop) take
precedence over its sampling settings. The modules:

  scheduler.py  the decode loop: requests stepped together, verified in one forward each step
  learner.py    --learn: finished generations into the model DB, one writer thread
  metrics.py    /metrics (prometheus-client)
  options.py    ServeOptions: `hd serve`'s own options (listening, admission, batching), declared once
  protocol.py   the request bodies and OpenAI's error schema
  structured.py what a chat request asks of its output: response_format's grammar, tools and
                tool_choice (call grammars, engine/text/tools.py), a predicted output; checked here
  app.py        the routes (Starlette, run by uvicorn)
  limits.py     connection bounds: header timeout, connection cap, rate-limited out-of-files log
  spawn.py      `hd serve` in a process of its own on a free port (tests, benchmarks, apps)

Exactness under load: a request's greedy tokens equal `hd generate`'s with the same options,
whatever else is served at the same time, in the M-invariant mode (the server says at start
whether the model is in it; tests/test_serve.py checks it).

Bounded shutdown: once SIGTERM/SIGINT arrives, run() ends within drain_timeout + SHUTDOWN_MARGIN
seconds whatever the HTTP side or the lifespan does; past that a watchdog says so on stderr in
one line and ends the process (exit 1). Requests still running drain_timeout seconds after the
signal end with finish_reason "cancelled": a stream gets its last chunk and `data: [DONE]`, never a
cut body. A second SIGTERM/SIGINT ends running requests the same way at once and stops (`hd serve`
then exits 128 + the signal's number: 130 after two Ctrl-C, 143 after a second SIGTERM).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from .. import compose
from ..config import DecodingConfig
from ..engine.text import constrain, tools
from ..engine.decode import prefix
from ..engine.decode.request import Request, Speculation
from ..engine.text.prompts import PromptTooLong, encode_messages, refuse_too_long
from ..engine.decode.verify import Sampling
from ..errors import HdError
from ..generation import NoRoom, prepare
from . import structured, tenants
from .learner import Learner
from .limits import http_protocol, limit_log
from .metrics import Metrics, Readers as MetricsReaders
from .options import MAX_BODY, ServeOptions
from .protocol import ApiError
from .scheduler import Job, Scheduler

# seconds past drain_timeout a signalled shutdown may take (cancelling what still runs, writing
# what is left to learn) before the watchdog ends the process
SHUTDOWN_MARGIN = 60.0
# seconds uvicorn waits for responses beyond drain_timeout: requests still running then are ended
# by hd, and their streams need a moment to send their last chunk and [DONE]
CUT_GRACE = 10.0
# seconds a second signal leaves streams to send their last chunk before the HTTP side stops
FORCE_GRACE = 1.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (0: any free port).

    Its protocol is IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says TCP. Without it a response's body, written after its headers,
    waited for the client's delayed ACK on every request after the first of a kept-alive
    connection (the openai client keeps them), on loopback too."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fix = _bind_fix(host, exc)
        raise HdError(f"cannot listen on {host}:{port}: {exc.strerror}; {fix}") from None
    sock.listen(128)
    return sock


def _bind_fix(host: str, exc: OSError) -> str:
    """What to change when binding failed: the host where it is not this machine's, else the port."""
    if isinstance(exc, socket.gaierror):
        wrong = f"--host {host} is neither an IP address nor a name that resolves"
    elif exc.errno == errno.EADDRNOTAVAIL:
        wrong = f"--host {host} is not an address of this machine"
    else:
        return "choose another --port (0: any free one)"
    return wrong + ": give an address of this machine (127.0.0.1: itself only; 0.0.0.0: all its addresses)"


class Server:
    """A loaded model, its decode loop, learner and metrics, and the HTTP app over them.

    cfg: the run's configuration (model, dtype, layers, DBs, --learn, default sampling).
    The keywords are ServeOptions' fields (options.py, `hd serve`'s own options), checked there:
    host/port: where to listen (port 0: a free port, see `port` after bind()); only what the
    caller gives, 127.0.0.1 by default. api_key: a bearer token /v1 routes require, or several
    (one per tenant; None: open); api_keys_file: more, one a line (tenants.Keys.load).
    learn_scope: shared|key|user, whose learned drafts a request uses (tenants.py; None: `key`
    with several keys, else `shared`). protect_metrics, metrics_key: who may read /metrics
    (metrics.Readers: with several keys, only the holder of metrics_key).
    max_batch: requests decoded at once; max_queue: requests waiting beyond those (then 503).
    drain_timeout: seconds SIGTERM waits for running requests before cancelling them.
    max_connections: open connections at most (one beyond: 503 and closed); keep_alive_timeout:
    seconds an idle kept-alive connection stays open; header_timeout: seconds a connection has to
    send a whole request header, from its opening or its last response (hdcli/serve/limits.py);
    body_timeout: seconds a request has to send its whole body, from its header (then 408).
    prefix_cache_mb: MiB of prompts' keys and values kept for later requests of the same scope
    (engine/decode/prefix.py; 0: off; off by itself where the model cannot use it)."""

    def __init__(self, cfg: DecodingConfig, lm=None, *, on_status: Callable[[str], None] = lambda m: None,
                 **options):
        opts = ServeOptions(**options).validate()   # the keywords: ServeOptions' fields (options.py)
        self.options = opts
        api_key, learn_scope, port, prefix_cache_mb = opts.api_key, opts.learn_scope, opts.port, opts.prefix_cache_mb
        self.keys = tenants.Keys.load([api_key] if isinstance(api_key, str) else list(api_key or []),
                                      opts.api_keys_file)
        if learn_scope is not None and learn_scope not in tenants.SCOPES:
            raise HdError(f"--learn-scope must be one of {', '.join(tenants.SCOPES)}, not '{learn_scope}'")
        self.learn_scope = learn_scope or tenants.default_scope(self.keys)
        self.protect_metrics = opts.protect_metrics
        self.metrics_readers = MetricsReaders(self.keys, opts.metrics_key, opts.protect_metrics)
        self.host, self.port = opts.host, port
        self.max_body, self.drain_timeout, self.say = opts.max_body, opts.drain_timeout, on_status
        self.max_connections, self.keep_alive_timeout = opts.max_connections, opts.keep_alive_timeout
        self.header_timeout, self.body_timeout = opts.header_timeout, opts.body_timeout
        self.prepared = prepare(cfg, lm, on_status)   # the Run every request decodes in
        self.config, self.lm, self.dbs = self.prepared.config, self.prepared.lm, self.prepared.dbs
        self.name = opts.name or self.lm.name
        self.created = int(time.time())
        self.metrics = Metrics()
        compose.warm_up(self.lm)
        # the grammar engine's view of the tokenizer (a second or so), built now rather than by the first
        # request with a schema or tools, which builds it holding the tokenizer lock the decode loop needs
        constrain.prepare(self.lm)
        self.learner = None
        if self.config.learn:
            m = self.metrics
            self.learner = Learner(self.config.model_db, on_error=on_status,
                                   on_learned=lambda keys: (m.learned.inc(), m.learned_keys.inc(keys)),
                                   on_dropped=m.learn_dropped.inc)
        from ..drafting.model import drafts_answers
        # what requests teach (recycled predictions, answers), kept per scope (tenants.py)
        self.tenants = tenants.Tenants(self.dbs.model, drafts_answers(self.dbs.model))
        if self.learner is not None:
            self._private(self.config.model_db)
        cost = self.prepared.cost if self.config.drafting else None
        self.prefix = None
        why = prefix.why_not(self.lm.model) if prefix_cache_mb > 0 else None
        if why:
            on_status(f"prefix cache off: {why}")
        elif prefix_cache_mb > 0:
            self.prefix = prefix.PrefixCache(int(prefix_cache_mb * (1 << 20)))
            self.metrics.watch_prefix(self.prefix)
        self.scheduler = Scheduler(self.lm, self._drafter, cost=cost, max_batch=opts.max_batch, max_queue=opts.max_queue,
                                   on_finish=self._finished, on_step=self._stepped, prefix=self.prefix)
        self._sock: socket.socket | None = None
        self._main_loop = False
        self._closed = self._signalled = False
        self._signalled_at: float | None = None
        self._ended = threading.Event()   # run() is over: the shutdown watchdog stands down
        self.forced_by: int | None = None   # the second signal that stopped the server at once
        self.served = {"requests": 0, "completion_tokens": 0, "steps": 0, "learned_generations": 0}

    # ------------------------------------------------------------ requests

    def _drafter(self, request: Request):
        """A drafter for one request: its scope's recycled predictions and answers, its own layers
        (None where it drafts nothing)."""
        scope = request.scope
        return self.prepared.drafter(self.tenants.recycled(scope), self.tenants.answers(scope), request.speculation)

    def _speculation(self, req) -> Speculation:
        """The request's own hold on drafting (its `speculative` field), its layers checked against
        the server's."""
        enabled, n_max, layers, governed = req.speculation()
        if layers is not None:
            known = self.prepared.layers
            twice = next((n for i, n in enumerate(layers) if n in layers[:i]), None)
            bad = next((n for n in layers if n not in known), None)
            if twice is not None or bad is not None:
                raise ApiError(400, f"speculative.layers: '{twice}' is named twice" if twice is not None else
                               f"speculative.layers: '{bad}' is not one of this server's drafting layers "
                               f"({', '.join(known) if known else 'none: it decodes plainly'})", "speculative.layers")
        return Speculation(enabled, n_max, None if layers is None else tuple(layers), governed)

    def scope_for(self, key_name: str | None, user: str | None) -> tenants.Scope:
        return tenants.scope_of(self.learn_scope, key_name, user)

    def _private(self, path) -> None:
        """The learned DB holds users' text: readable by its owner only (it may have been built
        world-readable, as any output is under a usual umask)."""
        from pathlib import Path
        p = Path(path)
        for f in [p] + ([p.with_name(p.name + "-lock")] if p.is_file() else []):
            try:
                if f.exists() and f.stat().st_mode & 0o077:
                    os.chmod(f, f.stat().st_mode & 0o700)
                    self.say(f"{f}: made readable by its owner only (--learn writes requests' text into it)")
            except OSError as exc:
                self.say(f"warning: cannot restrict {f} to its owner ({exc.strerror}): it holds what requests generate")

    def job_for(self, req, chat: bool, scope: tenants.Scope = tenants.SHARED) -> Job:
        """The decode job of a parsed request, or ApiError (unknown model, too long): its Request
        (engine/decode/request.py; what the request leaves out, the server's configuration) made
        here, the one place hd serve makes one."""
        if req.model != self.name:
            raise ApiError(404, f"model '{req.model}' is not served here; this server serves '{self.name}'",
                           "model", "model_not_found")
        speculation = self._speculation(req)
        spec = None
        if chat:   # tools, tool messages: checked before the prompt is built from them (serve/structured.py)
            # no tokenizer lock: compiling a schema does not touch the tokenizer once constrain.prepare
            # ran (at start), and a big schema compiles for seconds, which stalled every stream
            spec = structured.tool_spec(req, self.lm)
            structured.check_tool_messages(req)
        ids, where = self._encode(req, chat, spec)   # takes the tokenizer lock itself (not while a template renders)
        if not ids:
            raise ApiError(400, f"{where}: the prompt is empty", where)
        limit = req.limit()
        try:
            room = self.prepared.room(ids, limit)
        except NoRoom as exc:
            if exc.asked is None:
                raise ApiError(400, f"{where}: the prompt is {len(ids)} tokens, the model's context "
                               f"{self.lm.max_context}", where, "context_length_exceeded") from None
            raise ApiError(400, f"max_tokens: {exc}", "max_tokens", "context_length_exceeded") from None
        grammar = prediction = family = None
        if chat:
            family = tools.family(self.lm.tokenizer)
            grammar = structured.grammar_for(req, self.lm, spec, family, self.scheduler.tokenizer_lock)
            with self.scheduler.tokenizer_lock:
                prediction = structured.prediction_ids(req, self.lm, room)
        warnings = []

        def cut(default: int, room: int) -> None:   # the server's default, not the client's ask
            warnings.append(f"max_tokens: unset, and the server's default of {default} new tokens exceeds "
                            f"the room the model's context leaves after the {len(ids)}-token prompt: at most {room}")
        own = {"sampling": self._sampling(req), "stop": tuple(req.stops()), "logprobs": req.logprobs_wanted(),
               "grammar": grammar, "prediction": prediction, "scope": scope, "speculation": speculation}
        own |= {k: v for k, v in (("max_new_tokens", limit), ("seed", req.seed)) if v is not None}
        if not own["stop"]:   # what the request leaves out is the server's
            del own["stop"]
        request = self.prepared.request(ids, own, on_cut=cut)
        return Job(request, emit=lambda ev: None, streamed=req.stream,
                   tool_family=family if structured.parses_calls(req, spec) else None,
                   tools=spec.tools if spec is not None else [], warnings=warnings)

    def _sampling(self, req) -> Sampling:
        """The request's sampling and logits processors; what it leaves out, the server's."""
        cfg = self.config

        def pick(name):
            value = getattr(req, name)
            return getattr(cfg, name) if value is None else value
        bias = cfg.logit_bias
        if req.logit_bias is not None:
            vocab = self.lm.model.config.vocab_size
            # ASCII digits only: str.isdigit takes "²" (int() refuses it) and "٣" (int() reads 3); and
            # no more digits than the vocabulary's size has, before int(): it refuses over 4300
            bad = next((key for key in req.logit_bias
                        if not (key.isascii() and key.isdigit()) or len(key.lstrip("0")) > len(str(vocab))
                        or int(key) >= vocab), None)
            if bad is not None:
                shown = bad if len(bad) <= 24 else f"{bad[:12]}...({len(bad)} characters)"
                raise ApiError(400, f"logit_bias: '{shown}' is not a token id of this model (0..{vocab - 1})",
                               "logit_bias")
            bias = {int(key): value for key, value in req.logit_bias.items()}
        top_k = cfg.top_k if req.top_k is None else max(req.top_k, 0)   # -1: off, as vLLM's clients send it
        try:   # the other fields' ranges are the request schema's: only a bias can be out of range here
            return Sampling(pick("temperature"), top_k, pick("top_p"), pick("frequency_penalty"),
                            pick("presence_penalty"), tuple(bias.items()))
        except ValueError as exc:
            raise ApiError(400, str(exc), "logit_bias") from None

    def _encode(self, req, chat: bool, spec: structured.ToolSpec | None = None) -> tuple[list[int], str]:
        """The request's prompt as token ids, and the field it came from. A conversation with tools
        or tool turns is rendered by engine/text/tools.py (the model's template, or hd's tool prompt)."""
        tok = self.lm.tokenizer
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        | ({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {})
                        | ({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {})
                        for m in req.messages]
            with_tools = bool(spec and spec.tools) or any(m.tool_calls or m.role == "tool" for m in req.messages)
            try:
                if with_tools:
                    ids = tools.render(tok, messages, spec.tools if spec else [], max_tokens=self.lm.max_context,
                                       lock=self.scheduler.tokenizer_lock)
                else:
                    ids = encode_messages(tok, messages, chat=self.config.chat, max_tokens=self.lm.max_context,
                                          lock=self.scheduler.tokenizer_lock)
            except PromptTooLong as exc:
                raise ApiError(400, f"messages: {exc}", "messages", "context_length_exceeded") from None
            except HdError as exc:   # the template failed or hit a bound; a control token kept as text
                raise ApiError(400, f"messages: {exc}", "messages") from None
            except Exception as exc:  # noqa: BLE001 - a template that refuses these messages
                raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from None
            where = "messages"
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ApiError(400, "prompt: hd serve takes one prompt per request", "prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                try:
                    refuse_too_long(tok, [prompt], self.lm.max_context, as_text=False,
                                    lock=self.scheduler.tokenizer_lock)
                except PromptTooLong as exc:
                    raise ApiError(400, f"prompt: {exc}", "prompt", "context_length_exceeded") from None
                with self.scheduler.tokenizer_lock:
                    ids = [int(t) for t in tok(prompt, add_special_tokens=True)["input_ids"]]
            else:
                vocab = self.lm.model.config.vocab_size
                if any(not 0 <= t < vocab for t in prompt):
                    raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
                ids = list(prompt)
            where = "prompt"
        return ids, where

    def jobs_for(self, req, chat: bool, scope: tenants.Scope = tenants.SHARED) -> list[Job]:
        """One job per choice (`n`): the same prompt, each its own stream in the decode loop
        (they share a forward like any requests). Sampling is keyed by (seed, choice index, output
        position): seeded choices differ from each other and repeat across calls, loads and
        learning; greedy choices are all the same."""
        import dataclasses
        job = self.job_for(req, chat, scope)
        return [job] + [dataclasses.replace(job, request=job.request.replace(choice=i)) for i in range(1, req.n)]

    def usage_of(self, jobs: list[Job]) -> dict:
        """A response's usage: the prompt counted once, the choices' tokens summed; `hd` is the
        first choice's, with every choice's under hd.choices when there are several."""
        first = self.usage(jobs[0])
        if len(jobs) == 1:
            return first
        each = [self.usage(j) for j in jobs]
        n = sum(u["completion_tokens"] for u in each)
        out = first | {"completion_tokens": n, "total_tokens": first["prompt_tokens"] + n,
                       "hd": first["hd"] | {"choices": [u["hd"] for u in each]}}
        out["completion_tokens_details"] = {k: sum(u["completion_tokens_details"][k] for u in each)
                                            for k in first["completion_tokens_details"]}
        return out

    def usage(self, job: Job) -> dict:
        n = len(job.stream.out) if job.stream else 0
        hd = {"steps": 0, "mean_accepted_tokens": None, "layers": {},
              "draft_tokens": {"verified": 0, "accepted": 0, "wasted": 0}, "governed_steps": 0}
        if job.stream is not None:
            st = job.stream.stats
            steps = len(st.accept_lengths)
            hd = {"steps": steps, "mean_accepted_tokens": (sum(st.accept_lengths) / steps) if steps else None,
                  "layers": {name: {"drafted": s.drafted, "accepted": s.accepted} for name, s in st.layers.items()},
                  "draft_tokens": st.draft_tokens, "governed_steps": st.governed_steps,
                  "queue_seconds": round(job.started - job.submitted, 4) if job.started else None,
                  "seconds": round(job.finished - job.submitted, 4),
                  "cached_prompt_tokens": st.cached_tokens, "prefill_seconds": round(st.prefill_seconds, 4)}
        cached = job.stream.stats.cached_tokens if job.stream is not None else 0
        # both details objects always, with every count OpenAI sends, as its clients read them
        # (`usage.completion_tokens_details.reasoning_tokens` raised on a null); hd makes no
        # reasoning or audio tokens
        details = {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                   "rejected_prediction_tokens": 0}
        request = job.request
        if request.prediction is not None:   # OpenAI's counts for a predicted output (engine/decode/loop.py)
            counts = job.stream.prediction_usage() if job.stream is not None else None
            details |= counts or {"rejected_prediction_tokens": len(request.prediction)}
        # completion_tokens counts the end-of-sequence token where the model made one, as max_tokens
        # does (docs/serve.md: "Token counts")
        return {"prompt_tokens": len(request.prompt_ids), "completion_tokens": n,
                "total_tokens": len(request.prompt_ids) + n,
                "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                "completion_tokens_details": details, "hd": hd}

    def _finished(self, job: Job) -> None:  # decode thread
        m = self.metrics
        if job.stream is None:
            return
        st = job.stream.stats
        n = len(job.stream.out)
        m.prompt_tokens.inc(len(job.request.prompt_ids))
        m.completion_tokens.inc(n)
        for name, s in st.layers.items():
            m.drafted.labels(name).inc(s.drafted)
            m.accepted.labels(name).inc(s.accepted)
        m.latency.observe(job.finished - job.submitted)
        if job.first_token:
            m.ttft.observe(job.first_token - job.submitted)
        self.served["requests"] += 1
        self.served["completion_tokens"] += n
        self.served["steps"] += len(st.accept_lengths)
        if self.learner is not None and job.finish_reason in ("eos", "length", "stop") and n:
            self.learner.put(list(job.request.prompt_ids), job.stream.out, tenants.tag(job.request.scope))

    def _stepped(self, jobs, counts) -> None:  # decode thread
        self.metrics.step(len(jobs), sum(counts))

    def refresh_gauges(self) -> None:
        queued, running = self.scheduler.load()
        self.metrics.queue.set(queued)
        self.metrics.running.set(running)
        if self.learner is not None:
            self.metrics.learn_pending.set(self.learner.pending())

    # ------------------------------------------------------------ running

    def bind(self) -> int:
        """Open the listening socket (so the port is known before serving); returns the port."""
        self._sock = listening_socket(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        return self.port

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        if not self._main_loop:   # served from threads (tests, benchmarks): the loop in one too
            self.scheduler.start()
        try:
            yield
        finally:
            import asyncio
            # close() in a thread of its own, not the loop's executor (shut down already when the
            # loop is being torn down): once started it finishes even if this lifespan is cancelled
            done: concurrent.futures.Future = concurrent.futures.Future()

            def closing():
                try:
                    self.close()
                    done.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - handed to the lifespan below
                    done.set_exception(exc)
            threading.Thread(target=closing, name="hd-close", daemon=True).start()
            await asyncio.shield(asyncio.wrap_future(done))

    def close(self) -> None:
        """Let running requests finish (up to drain_timeout), then write what is left to learn."""
        if self._closed:
            return
        self._closed = True
        drain = self.drain_timeout
        if self._signalled_at is not None:   # uvicorn's graceful shutdown spent part of it already
            drain = max(0.0, drain - (time.monotonic() - self._signalled_at))
        if not self.scheduler.stop(drain=True, timeout=drain):
            self.scheduler.stop(drain=False, timeout=30)
        if self.learner is not None:
            self.learner.close()
            self.served["learned_generations"] = self.learner.learned

    def uvicorn_server(self):
        import uvicorn
        from .app import build_app

        class Uvicorn(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                # SIGTERM/SIGINT stop serving gracefully (uvicorn's handle_exit: no new
                # connections, running requests finish). uvicorn would raise the signal again
                # afterwards, killing the process before hd drains the learner and reports; a
                # clean stop exits 0, as process managers expect.
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)
        limit_log()
        # limit_concurrency: uvicorn's own 503 counts the asking connection too; Bounded (limits.py)
        # already keeps connections to max_connections, each of which may ask
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=self.drain_timeout + CUT_GRACE, access_log=False,
                                http=http_protocol(self), limit_concurrency=self.max_connections + 1,
                                timeout_keep_alive=self.keep_alive_timeout)
        return Uvicorn(config)

    def run(self) -> dict:
        """Serve until SIGTERM or SIGINT; returns what was served. Call from the main thread: the
        decode loop runs here (see Scheduler.start for why), the HTTP side in a thread beside it.
        A signal stops accepting connections; running requests finish; then the loop ends."""
        if self._sock is None:
            self.bind()
        self._main_loop = True
        http = self.uvicorn_server()

        def serve_http():
            try:
                http.run(sockets=[self._sock])
            finally:
                self.close()   # also where uvicorn stopped without its lifespan shutdown
        thread = threading.Thread(target=serve_http, name="hd-http", daemon=True)

        def on_signal(sig, frame):   # in this (the decode loop's) thread: nothing here may wait for it
            http.should_exit = True
            if self._signalled:   # a second signal: stop now
                self.forced_by = sig
                self.scheduler.stop(drain=False, timeout=0)   # running requests end: streams get their last chunk
                force = threading.Timer(FORCE_GRACE, lambda: setattr(http, "force_exit", True))
                force.daemon = True   # ... and FORCE_GRACE s to send it before uvicorn stops waiting
                force.start()
            else:
                self._signalled_at = time.monotonic()
                threading.Thread(target=self._cut_after_drain, name="hd-drain", daemon=True).start()
                threading.Thread(target=self._watchdog, name="hd-shutdown-watchdog", daemon=True).start()
            self._signalled = True
        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            thread.start()
            self.scheduler.run()      # returns once the HTTP side has shut down and closed it
            thread.join(self.drain_timeout + 30)
        finally:
            self._ended.set()
            for sig, handler in old.items():
                signal.signal(sig, handler)
        if self.scheduler.failed is not None:
            raise HdError(f"the decode loop failed: {type(self.scheduler.failed).__name__}: {self.scheduler.failed}")
        return self.summary()

    def _cut_after_drain(self) -> None:
        """drain_timeout s after the first signal, the requests still running end (finish_reason
        "cancelled"): their streams close with a last chunk and [DONE] while uvicorn still waits
        for them (it cuts what is left CUT_GRACE s later, mid-body)."""
        if not self.scheduler.stop(drain=True, timeout=self.drain_timeout):
            self.scheduler.stop(drain=False, timeout=0)

    def _watchdog(self) -> None:
        """Ends the process if run() has not returned drain_timeout + SHUTDOWN_MARGIN seconds
        after the first signal: a hung HTTP thread or lifespan must not keep a stopped server
        alive (one did for over 10 minutes). Committed LMDB transactions are safe from this."""
        bound = self.drain_timeout + SHUTDOWN_MARGIN
        if self._ended.wait(bound):
            return
        sys.stderr.write(f"hd serve: still stopping {bound:g} s after the signal (--drain-timeout "
                         f"{self.drain_timeout:g} + {SHUTDOWN_MARGIN:g} s): exiting now\n")
        sys.stderr.flush()
        os._exit(1)

    def summary(self) -> dict:
        return {"model": self.name, "source": self.lm.source, "dtype": self.lm.dtype, "device": self.lm.device,
                "kernels": self.lm.kernels, "invariant": bool(self.lm.invariant),
                "batched": self.scheduler.batched, "host": self.host, "port": self.port, **self.served,
                "decode_loop_seconds": {k: round(v, 3) for k, v in self.scheduler.times.items()},
                "prefix_cache": self.prefix.summary() if self.prefix is not None else None}


__all__ = ["Server", "MAX_BODY", "SHUTDOWN_MARGIN", "listening_socket"]

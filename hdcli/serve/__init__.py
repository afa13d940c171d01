"""`hd serve`: an OpenAI-compatible server over hd's lossless speculative decoding.

    from hdcli import api
    from hdcli.serve import Server
    server = Server(api.DecodingConfig(model_db="model.lmdb", learn=True), port=8000)
    server.run()                      # until SIGTERM / Ctrl-C: drains running requests, then exits

One configuration (hdcli/config.py, the same options as `hd generate`) sets the model, dtype,
drafting layers and DBs; a request's own fields (max_tokens, temperature, top_p, seed, stop) take
precedence over its sampling settings. The modules:

  scheduler.py  the decode loop: requests stepped together, verified in one forward each step
  learner.py    --learn: finished generations into the model DB, one writer thread
  metrics.py    /metrics (prometheus-client)
  protocol.py   the request bodies and OpenAI's error schema
  app.py        the routes (Starlette, run by uvicorn)
  spawn.py      `hd serve` in a process of its own on a free port (tests, benchmarks, apps)

Exactness under load: a request's greedy tokens equal `hd generate`'s with the same options,
whatever else is served at the same time, in the M-invariant mode (the server says at start
whether the model is in it; tests/test_serve.py checks it).
"""
from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Callable

from .. import api, compose
from ..drafting import RecycledTable
from ..engine import costs
from ..engine.prompts import encode_messages
from ..engine.verify import Sampling
from ..errors import HdError
from .learner import Learner
from .metrics import Metrics
from .protocol import ApiError
from .scheduler import Job, Scheduler

MAX_BODY = 1 << 20   # bytes: a request body beyond this is refused (413)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (0: any free port).

    Its protocol is IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says TCP. Without it a response's body, written after its headers,
    waited for the client's delayed ACK: 40 ms on every request after the first of a kept-alive
    connection (the openai client keeps them), measured on loopback."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise HdError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another "
                      "--port (0: any free one)") from None
    sock.listen(128)
    return sock


class Server:
    """A loaded model, its decode loop, learner and metrics, and the HTTP app over them.

    cfg: the run's configuration (model, dtype, layers, DBs, --learn, default sampling).
    host/port: where to listen (port 0: a free port, see `port` after bind()); only what the
    caller gives, 127.0.0.1 by default. api_key: a bearer token /v1 routes require (None: open).
    max_batch: requests decoded at once; max_queue: requests waiting beyond those (then 503).
    drain_timeout: seconds SIGTERM waits for running requests before cancelling them."""

    def __init__(self, cfg: api.DecodingConfig, lm=None, *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, max_batch: int = 8, max_queue: int = 64,
                 name: str | None = None, max_body: int = MAX_BODY, drain_timeout: float = 60.0,
                 on_status: Callable[[str], None] = lambda m: None):
        if max_batch < 1 or max_queue < 0:
            raise HdError("--max-batch must be >= 1 and --max-queue >= 0")
        if not 0 <= port <= 65535:
            raise HdError(f"--port {port} is not a port: give 0..65535 (0: any free one)")
        if drain_timeout < 0:
            raise HdError("--drain-timeout must be >= 0 seconds")
        if api_key is not None and not api_key.strip():
            raise HdError("--api-key is empty: give a token, or leave the option out for an open server")
        self.host, self.port, self.api_key = host, port, api_key
        self.max_body, self.drain_timeout, self.say = max_body, drain_timeout, on_status
        run = api.prepare(cfg, lm, on_status)
        self.config, self.lm, self.dbs = run.config, run.lm, run.dbs
        self.name = name or self.lm.name
        self.created = int(time.time())
        self.metrics = Metrics()
        compose.warm_up(self.lm)
        self.learner = None
        if self.config.learn:
            m = self.metrics
            self.learner = Learner(self.config.model_db, on_error=on_status,
                                   on_learned=lambda keys: (m.learned.inc(), m.learned_keys.inc(keys)),
                                   on_dropped=m.learn_dropped.inc)
        self.recycled = RecycledTable()   # the target's predictions, shared by all requests
        drafting = self.config.drafting
        cost = costs.curve_for(self.lm) if drafting else None
        self.scheduler = Scheduler(self.lm, self._drafter, cost=cost, max_batch=max_batch, max_queue=max_queue,
                                   on_finish=self._finished, on_step=self._stepped)
        self._sock: socket.socket | None = None
        self._main_loop = False
        self._closed = self._signalled = False
        self.served = {"requests": 0, "completion_tokens": 0, "steps": 0, "learned_generations": 0}

    # ------------------------------------------------------------ requests

    def _drafter(self):
        if not self.config.drafting:
            return None
        return compose.build_drafter(self.config, self.lm, self.dbs, recycle_table=self.recycled)

    def job_for(self, req, chat: bool) -> Job:
        """The decode job of a parsed request, or ApiError (unknown model, too long)."""
        if req.model != self.name:
            raise ApiError(404, f"model '{req.model}' is not served here; this server serves '{self.name}'",
                           "model", "model_not_found")
        with self.scheduler.tokenizer_lock:
            ids, where = self._encode(req, chat)
        if not ids:
            raise ApiError(400, f"{where}: the prompt is empty", where)
        room = self.lm.max_context - len(ids)
        if room < 1:
            raise ApiError(400, f"{where}: the prompt is {len(ids)} tokens, the model's context "
                           f"{self.lm.max_context}", where, "context_length_exceeded")
        limit = req.limit()
        if limit is not None and limit > room:
            raise ApiError(400, f"max_tokens: {limit} new tokens after a {len(ids)}-token prompt exceed "
                           f"the model's context of {self.lm.max_context} (at most {room})",
                           "max_tokens", "context_length_exceeded")
        cfg = self.config
        temperature = cfg.temperature if req.temperature is None else req.temperature
        top_p = cfg.top_p if req.top_p is None else req.top_p
        return Job(prompt_ids=ids, max_tokens=min(limit or cfg.max_new_tokens, room),
                   sampling=Sampling(temperature, cfg.top_k, top_p),
                   seed=cfg.seed if req.seed is None else req.seed, stop=req.stops() or list(cfg.stop),
                   emit=lambda ev: None, streamed=req.stream)

    def _encode(self, req, chat: bool) -> tuple[list[int], str]:
        """The request's prompt as token ids, and the field it came from."""
        tok = self.lm.tokenizer
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
            try:
                ids = encode_messages(tok, messages, chat=self.config.chat)
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
                ids = [int(t) for t in tok(prompt, add_special_tokens=True)["input_ids"]]
            else:
                vocab = self.lm.model.config.vocab_size
                if any(not 0 <= t < vocab for t in prompt):
                    raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
                ids = list(prompt)
            where = "prompt"
        return ids, where

    def usage(self, job: Job) -> dict:
        n = len(job.stream.out) if job.stream else 0
        hd = {"steps": 0, "mean_accepted_tokens": None, "layers": {}}
        if job.stream is not None:
            st = job.stream.stats
            steps = len(st.accept_lengths)
            hd = {"steps": steps, "mean_accepted_tokens": (sum(st.accept_lengths) / steps) if steps else None,
                  "layers": {name: {"drafted": s.drafted, "accepted": s.accepted} for name, s in st.layers.items()},
                  "queue_seconds": round(job.started - job.submitted, 4) if job.started else None,
                  "seconds": round(job.finished - job.submitted, 4)}
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
                "total_tokens": len(job.prompt_ids) + n, "hd": hd}

    def _finished(self, job: Job) -> None:  # decode thread
        m = self.metrics
        if job.stream is None:
            return
        st = job.stream.stats
        n = len(job.stream.out)
        m.prompt_tokens.inc(len(job.prompt_ids))
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
            self.learner.put(job.prompt_ids, job.stream.out)

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
            await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Let running requests finish (up to drain_timeout), then write what is left to learn."""
        if self._closed:
            return
        self._closed = True
        if not self.scheduler.stop(drain=True, timeout=self.drain_timeout):
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
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=self.drain_timeout, access_log=False)
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

        def on_signal(sig, frame):
            http.should_exit = True
            if self._signalled:   # a second Ctrl-C: stop now
                http.force_exit = True
                self.scheduler.stop(drain=False)
            self._signalled = True
        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            thread.start()
            self.scheduler.run()      # returns once the HTTP side has shut down and closed it
            thread.join(self.drain_timeout + 30)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        if self.scheduler.failed is not None:
            raise HdError(f"the decode loop failed: {type(self.scheduler.failed).__name__}: {self.scheduler.failed}")
        return self.summary()

    def summary(self) -> dict:
        return {"model": self.name, "source": self.lm.source, "dtype": self.lm.dtype, "device": self.lm.device,
                "kernels": self.lm.kernels, "invariant": bool(self.lm.invariant),
                "batched": self.scheduler.batched, "host": self.host, "port": self.port, **self.served,
                "decode_loop_seconds": {k: round(v, 3) for k, v in self.scheduler.times.items()}}


__all__ = ["Server", "MAX_BODY", "listening_socket"]

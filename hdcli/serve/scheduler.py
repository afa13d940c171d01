"""The decode loop of `hd serve`: one thread steps every running request, their verification
forwards batched into one (hdcli/engine/decode/batch.py).

Each loop turn: admit queued requests up to max_batch (each is prefilled alone, so its cache is
what `hd generate` would build); then one speculative step of every running request, the step
`hd generate` takes (engine/decode/loop.speculative_steps): each proposes its draft tree, with the
forward's rows shared among them (invariant.MAX_ROWS in all, the widest forward the M-invariant
mode is calibrated for), one forward verifies all trees, each accepts its tokens; each hands the
new text to its client. A finished request goes to the learner (hdcli/serve/learner.py)
when the server learns. A job's grammar and predicted output go to its decode stream (engine/decode/loop.py);
a job parsed for tool calls holds back the text that may still become one (engine/text/tools.held) and
ends with its calls in Job.calls.

Invariants
  * Only this thread touches the model, the KV caches, the drafters and the shared tables (the
    recycled predictions): no locks around them.
  * A request's tokens are those of `hd generate` with the same options, whatever else runs: its
    rows of each forward depend only on its own path in the M-invariant mode, and its prefill runs
    alone. Without the mode (another architecture, --invariant off) requests are still stepped
    together, each in a forward of its own.
  * With a prefix cache (engine/decode/prefix.py, --prefix-cache-mb) a prompt's longest prefix stored by
    a request of the same scope (Job.request.scope) is restored instead of computed: torch.equal to
    its prefill.
    A finished request stores its prompt and answer, after its client has the answer.
  * A cancelled request (its client went away) leaves at the next loop turn; the others go on.
  * An exception while serving one request (admitting, drafting, verifying, accepting, handing
    its text) ends that request with finish_reason "error" (the client gets a 500 naming it),
    logged once (at most once per 10 s); the loop goes on. A request's KV cache is its own, so the
    others are untouched, except where the failing step was a forward shared with them: any of
    their caches may hold part of it, so they end with an error too, never with wrong tokens.
    Only a fault outside any one request's step (or a dead CUDA context) ends the loop
    (`failed`, /health 503).
  * stop(drain=True) lets running and queued requests finish; stop(drain=False) ends them with
    finish_reason "cancelled".
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.decode import batch
from ..engine.text import tools
from ..engine.decode.loop import Decoder, Stream, speculative_steps
from ..engine.text.prompts import cut_at_stop
from ..engine.decode.request import Request
from .limits import RateLimited

log = logging.getLogger("hdcli.serve")
if not any(isinstance(f, RateLimited) for f in log.filters):
    log.addFilter(RateLimited(10.0, match=lambda record: getattr(record, "request_fault", False)))

# what a request hands its client: ("text", (piece, log-probability entries of the tokens the
# text completes, or None)) while it runs, ("done", Job) at the end
Event = tuple[str, object]


@dataclass
class Job:
    """One request to the decode loop: what it asks for (a Request: prompt, max tokens, sampling,
    seed, choice index, stop strings, logprobs, grammar, prediction, and its scope, whose learned
    drafts and cached prefixes it may use, serve/tenants.py), and how its answer travels and when
    it ran."""
    request: Request
    emit: Callable[[Event], None]          # called from the decode thread; must not block
    streamed: bool = False                 # hand text pieces while running (else only the end)
    lp_sent: int = 0                       # tokens whose log-probabilities went with the text
    lp_rest: list | None = None            # those left at the end (sent with the last chunk)
    tool_family: str | None = None         # parse the answer for tool calls in this format (engine/text/tools.py)
    tools: list = field(default_factory=list)   # the tools offered (engine/text/tools.Tool): calls name one
    calls: list | None = None              # the tool calls the answer is (OpenAI's shape), or None
    warnings: list[str] = field(default_factory=list)   # what hd changed of the request (the body's `warnings`)
    id: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0                   # prefill done
    first_token: float = 0.0
    finished: float = 0.0
    stream: Stream | None = None
    text: str = ""                         # final text (stop strings cut; with calls, the text before them)
    sent: str = ""                         # text handed to the client so far
    finish_reason: str = ""
    error: str | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True              # read by the decode thread at its next turn


class Scheduler:
    """Runs Jobs on one model. drafter_for(request): a new drafter for that request (its scope's,
    with its own layers; None: plain decoding); on_finish(job): called in the decode thread when a job ends (learning, metrics)."""

    def __init__(self, lm, drafter_for: Callable[[Request], object], cost=None, max_batch: int = 8,
                 max_queue: int = 64, on_finish: Callable[[Job], None] = lambda job: None,
                 on_step: Callable[[list[Job], list[int]], None] = lambda jobs, n: None,
                 prefix=None):
        self.lm, self.drafter_for, self.cost = lm, drafter_for, cost
        self.prefix = prefix   # engine/decode/prefix.PrefixCache: prompts' keys kept across requests, or None
        self.max_batch, self.max_queue = max_batch, max_queue
        self.on_finish, self.on_step = on_finish, on_step
        self.decoder = Decoder(lm.model, lm.eos_ids, None, cost=cost, prefix=prefix, tokenizer=lm.tokenizer)
        self.batched = batch.can_batch(lm.model)
        self.queue: deque[Job] = deque()
        self.running: list[Job] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._admitting: list[Job] = []   # taken from the queue, not yet running (this turn)
        self._drain = True
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._running = threading.Event()   # the loop is running (in some thread)
        self._ended = threading.Event()     # the loop has returned
        self.failed: BaseException | None = None
        self.tokenizer_lock = threading.Lock()
        # where the decode loop's time goes (hd serve --json, docs/serve.md)
        self.times = {"busy": 0.0, "prefill": 0.0, "draft": 0.0, "forward": 0.0, "accept": 0.0}  # a fast tokenizer must not be used by two threads at once

    # ------------------------------------------------------------ called from any thread

    def start(self) -> None:
        """Run the loop in a thread of its own. Slower than run() in the main thread where torch
        uses GNU OpenMP: with a second thread team in the process libgomp stops spinning between
        parallel regions, and each Linear call pays a wake-up (a small 4-bit GEMM took several
        times as long). hd serve runs the loop in the main thread, HTTP beside it."""
        self._thread = threading.Thread(target=self.run, name="hd-decode", daemon=True)
        self._thread.start()
        self._running.wait()

    def run(self) -> None:
        """The decode loop, in the calling thread, until stop()."""
        self._running.set()
        try:
            self._loop()
        finally:
            self._ended.set()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full or the server is stopping."""
        with self._cv:
            if self._stopping or len(self.queue) >= self.max_queue:
                return False
            job.id = job.id or f"{next(self._ids)}"
            self.queue.append(job)
            self._cv.notify()
        return True

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Ask the loop to end (drain: after the running and queued jobs); wait up to timeout for
        it where it runs in another thread. Returns whether it has ended."""
        with self._cv:
            # once asked to stop without draining, a later drain=True (close() after a second
            # signal) does not bring draining back: that kept a forced stop waiting for every job
            self._drain = drain and (self._drain or not self._stopping)
            self._stopping = True
            self._cv.notify()
        if not self._running.is_set() or threading.current_thread() is self._thread:
            return self._ended.is_set()
        return self._ended.wait(timeout)

    def alive(self) -> bool:
        return self._running.is_set() and not self._ended.is_set()

    def load(self) -> tuple[int, int]:
        """(queued, running)."""
        return len(self.queue), len(self.running)

    # ------------------------------------------------------------ the decode thread

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._turn():
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported by /health, every job gets an error
            self.failed = exc
            # those being admitted are in neither list yet: they must hear of it too
            for job in self._admitting + [j for j in self.running if j not in self._admitting] + list(self.queue):
                if not job.finished:
                    self._end(job, "error", f"the decode loop failed: {type(exc).__name__}: {exc}")
            self.running.clear()
            self.queue.clear()

    def _turn(self) -> bool:
        with self._cv:
            while not self.queue and not self.running and not self._stopping:
                self._cv.wait(0.5)   # a timeout, so that signal handlers run in the main thread
            if self._stopping and not self._drain:
                for job in list(self.running) + list(self.queue):
                    self._end(job, "cancelled")
                self.running.clear()
                self.queue.clear()
                return False
            if self._stopping and not self.queue and not self.running:
                return False
            admit = []
            while self.queue and len(self.running) + len(admit) < self.max_batch:
                admit.append(self.queue.popleft())
        t0 = time.perf_counter()
        self._admitting = admit
        for job in admit:
            self._admit(job)
        self._admitting = []
        self.times["prefill"] += time.perf_counter() - t0
        for job in [j for j in self.running if j.cancelled]:
            self.running.remove(job)
            self._end(job, "cancelled")
        if not self.running:
            self.times["busy"] += time.perf_counter() - t0
            return True
        jobs = list(self.running)
        new = speculative_steps(self.lm.model, [j.stream for j in jobs], self._failing(jobs), self.times)
        t1 = time.perf_counter()
        stepped, counts = [], []
        for job, tokens in zip(jobs, new):
            if tokens is None:   # its step failed: it has ended (_fail)
                continue
            stepped.append(job)
            counts.append(len(tokens))
            try:
                if tokens and not job.first_token:
                    job.first_token = time.perf_counter()
                if job.streamed:
                    self._send_text(job)
            except Exception as exc:  # noqa: BLE001 - this request's fault (module header)
                self._fail(job, exc)
                continue
            if job.stream.done:
                self.running.remove(job)
                self._end(job, job.stream.stop_reason)
        self._quietly(self.on_step, stepped, counts)
        t2 = time.perf_counter()
        self.times["accept"] += t2 - t1   # besides the step's own accepting (speculative_steps)
        self.times["busy"] += t2 - t0
        return True

    def _failing(self, jobs: list[Job]):
        """speculative_steps' on_fault for these jobs: the job whose step failed ends (_fail); one
        that failed in a forward shared with others is told so."""
        def fault(i: int, exc: Exception, shared: int) -> None:
            why = f"the verification forward it shared with {shared} other request(s) failed" if shared else ""
            self._fail(jobs[i], exc, why)
        return fault

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, "cancelled")
            return
        try:
            request = job.request
            job.stream = self.decoder.stream(request, drafter=self.drafter_for(request))
        except Exception as exc:  # noqa: BLE001 - this request's fault (module header)
            if self.prefix is not None:   # its prefill may have stored part of an entry
                self.prefix.clear()
            self._fail(job, exc)
            return
        job.started = time.perf_counter()
        self.running.append(job)

    def _fail(self, job: Job, exc: Exception, why: str = "") -> None:
        """End one job whose serving raised exc (module header): logged, the client told."""
        if _fatal(exc):
            raise exc
        if job in self.running:
            self.running.remove(job)
        what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        message = f"{why}: {what}" if why else what
        log.error("hd serve: request %s failed (the server goes on): %s", job.id, message,
                  extra={"request_fault": True})
        self._end(job, "error", message)

    def _quietly(self, fn, *args) -> None:
        """Call fn (bookkeeping: metrics, learning); a fault is logged, the request's answer stands."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - module header
            log.error("hd serve: %s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc,
                      extra={"request_fault": True})

    def _send_text(self, job: Job, final: bool = False) -> None:
        """Hand the client the text that can no longer change: held back are an incomplete UTF-8
        sequence and, while running, a tail that could start a stop string or a tool call. At the
        end an answer that is tool calls (job.calls) hands only the text before them."""
        with self.tokenizer_lock:
            text = self.lm.tokenizer.decode(job.stream.out, skip_special_tokens=True)
        text = cut_at_stop(text, job.request.stop)
        if final:
            if job.tool_family and job.stream.stop_reason in ("eos", "stop"):
                content, job.calls = tools.split_calls(text, job.tool_family, job.tools)
                text = text if job.calls is None else content or ""
            job.text = text
        else:
            if text.endswith("\ufffd"):
                return
            hold = max((len(s) for s in job.request.stop), default=1) - 1
            text = text[:len(text) - hold] if hold else text
            if job.tool_family:
                text = text[:tools.held(text, job.tool_family)]
        if text.startswith(job.sent) and len(text) > len(job.sent):
            job.emit(("text", (text[len(job.sent):], self._logprobs_upto(job, len(text), final))))
            job.sent = text

    def _logprobs_upto(self, job: Job, chars: int, final: bool) -> list | None:
        """The log-probability entries (token id, logprob, [(id, logprob)]) of the tokens not yet
        sent whose text lies within the first `chars` characters of the output (all of them at the
        end), the end-of-sequence token left out."""
        lps = job.stream.out_logprobs
        if lps is None:
            return None
        out, n = job.stream.out, job.lp_sent
        if final:
            n = len(lps)
        else:
            with self.tokenizer_lock:
                while n < len(lps) and len(self.lm.tokenizer.decode(out[:n + 1], skip_special_tokens=True)) <= chars:
                    n += 1
        entries = self.logprob_entries(job, job.lp_sent, n)
        job.lp_sent = n
        return entries

    def logprob_entries(self, job: Job, start: int = 0, end: int | None = None) -> list | None:
        """(token id, logprob, [(id, logprob)]) of the job's output tokens start..end, the
        end-of-sequence token left out; None where the job returns no log-probabilities."""
        lps = job.stream.out_logprobs if job.stream is not None else None
        if lps is None:
            return None
        out, eos = job.stream.out, self.lm.eos_ids
        return [(out[i], *lps[i]) for i in range(start, len(lps) if end is None else end) if out[i] not in eos]

    def _end(self, job: Job, reason: str, error: str | None = None) -> None:
        """Finish a job once: its last text, bookkeeping, then the client hears "done" (always)."""
        if job.finished:
            return
        job.finished = time.perf_counter()
        try:
            if job.stream is not None:
                if not job.stream.done:
                    job.stream.stop(reason)
                self._send_text(job, final=True)
                job.lp_rest = self._logprobs_upto(job, 0, True)   # tokens whose text came to nothing
        except Exception as exc:  # noqa: BLE001 - the client gets the error, not a half answer
            reason, error = "error", " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            log.error("hd serve: request %s failed (the server goes on): %s", job.id, error,
                      extra={"request_fault": True})
        job.finish_reason, job.error = reason, error
        try:
            self._quietly(self.on_finish, job)
        finally:
            job.emit(("done", job))
        if self.prefix is not None and job.stream is not None and reason in ("eos", "length", "stop"):
            # after the answer went out: the next turn of a chat starts with this prompt and
            # answer, and the cache holds history[:-1] (engine/decode/loop.py's invariant)
            try:
                self.prefix.store(job.request.scope, job.stream.history[:-1], job.stream.cache)
            except Exception as exc:  # noqa: BLE001 - a half-stored entry must never be restored
                self.prefix.clear()
                log.error("hd serve: storing request %s's prefix failed (the prefix cache is emptied): %s: %s",
                          job.id, type(exc).__name__, exc, extra={"request_fault": True})


def _fatal(exc: BaseException) -> bool:
    """Whether exc leaves the device unusable for every request (a CUDA context after a
    device-side assert): the loop must end, /health say so."""
    return "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError"

"""The HTTP side of `hd serve` (Starlette under uvicorn): OpenAI-compatible routes over the decode
loop (hdcli/serve/scheduler.py).

  POST /v1/chat/completions   messages through the model's chat template
  POST /v1/completions        a raw prompt (text, or token ids)
  GET  /v1/models             the one model served
  GET  /v1/models/{id}        that model's card (the client's models.retrieve), 404 for another id
  GET  /health                200 while the decode loop runs, 503 after it failed
  GET  /metrics               Prometheus text format (hdcli/serve/metrics.py); with several API
                              keys only to --metrics-key, else open or (--protect-metrics) the key

Both POST routes take max_tokens, temperature, top_p, seed, stop, stream (server-sent events,
with stream_options.include_usage), n (1-8 choices, each a job), frequency_penalty, presence_penalty, logit_bias,
logprobs (chat: with top_logprobs), top_k, user (the tenant scope's, serve/tenants.py); fields
taken and not acted on (each request class's IGNORED, protocol.py: reasoning_effort...) are named in the response header
X-HD-Ignored-Fields. A response's `usage` has the usual token counts (both details objects always,
as OpenAI's) and `hd`: verification steps, mean accepted tokens a step, drafted/accepted tokens
per layer. Log-probabilities are those of the rows plain decoding
computes, after penalties and biases, before temperature and truncation.

Chat also takes response_format (json_object, json_schema: the answer follows the grammar, exact
under speculation), tools with tool_choice and parallel_tool_calls, tool messages and assistant
tool_calls, and prediction (serve/structured.py). An answer that is tool calls (constrained under
"required" or a named function; parsed, never constrained, under "auto": a call that does not parse
is text) carries message.tool_calls (ids "call_<hex>", JSON-text arguments), content null or the
text before the calls, and finish_reason "tool_calls"; streamed, the text that may still become a
call is held back and the calls come at the end as OpenAI's deltas (index, id, type and name, then
the arguments). With a prediction, usage.completion_tokens_details has OpenAI's
accepted_prediction_tokens and rejected_prediction_tokens.

Errors follow OpenAI's schema ({"error": {"message", "type", "param", "code"}}): 400 bad JSON
(nested too deeply included), unknown field, wrong type, max_tokens beyond the context, a schema,
tool, tool_choice, tool message or prediction that cannot be used (param names it); 401
missing or wrong API key (compared in constant time); 404 unknown model or route; 408 a body not
received whole within --body-timeout; 413 body over the limit; 503 queue full or the server
stopping. A client that disconnects cancels its request; others go on.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import IGNORED_HEADER, ApiError, ChatRequest, CompletionRequest, parse
from .scheduler import Job

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}


def _finish(job: Job) -> str:
    """OpenAI's finish_reason: "tool_calls" where the answer is calls (Job.calls)."""
    return "tool_calls" if job.calls else FINISH[job.finish_reason]


def build_app(server) -> Starlette:
    """server: hdcli.serve.server.Server (its config, model, scheduler, metrics)."""
    r = Routes(server)

    async def chat(request: Request) -> Response:
        return await r.completions(request, True)

    async def completions(request: Request) -> Response:
        return await r.completions(request, False)
    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", r.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", r.model, methods=["GET"]),
              Route("/health", r.health, methods=["GET"]),
              Route("/metrics", r.metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=server.lifespan,
                     exception_handlers={404: _not_found, 405: _not_found, Exception: _crashed})


class Routes:
    def __init__(self, server):
        self.server = server

    def error(self, exc: ApiError, endpoint: str) -> JSONResponse:
        self.server.metrics.requests.labels(endpoint, str(exc.status)).inc()
        # a body cut short by its timeout may still be arriving: the connection ends with the answer
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers={"connection": "close"} if exc.status == 408 else None)

    def authorised(self, request: Request) -> str | None:
        """The name of the request's API key (serve/tenants.py), None on an open server; else 401."""
        keys = self.server.keys
        if keys is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        name = keys.identify(token.strip()) if scheme.lower() == "bearer" else None
        if name is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return name

    async def read_json(self, request: Request):
        # a body over the limit is read on (not kept, up to 16x the limit) before the 413, so
        # that clients still sending see the answer instead of a reset connection
        limit, body = self.server.max_body, bytearray()

        async def receive() -> int:
            seen = 0
            async for chunk in request.stream():
                seen += len(chunk)
                if seen <= limit:
                    body.extend(chunk)
                elif seen > 16 * limit:
                    break
            return seen
        # the whole body within body_timeout: a body trickled a byte at a time held its
        # connection for ever (8 of them filled --max-connections 8)
        try:
            seen = await asyncio.wait_for(receive(), self.server.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.server.body_timeout:g} s: "
                           "send it whole at once", code="body_timeout") from None
        if seen > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        except RecursionError:   # "[" * 100000: the parser recurses once a level
            raise ApiError(400, "the body's JSON is nested too deeply: send a flatter document") from None

    async def completions(self, request: Request, chat: bool) -> Response:
        server = self.server
        endpoint = "chat" if chat else "completions"
        try:
            key = self.authorised(request)
            req = parse(ChatRequest if chat else CompletionRequest, await self.read_json(request))
            # off the event loop: a chat template renders for up to templates.TEMPLATE_SECONDS
            jobs = await asyncio.to_thread(server.jobs_for, req, chat, server.scope_for(key, req.user))
        except ApiError as exc:
            return self.error(exc, endpoint)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()   # (choice index, event) of every choice's job

        def emitter(i):
            def emit(ev):  # from the decode thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return emit
        for i, job in enumerate(jobs):
            job.emit = emitter(i)
            if not server.scheduler.submit(job):
                for j in jobs[:i]:
                    j.cancel()
                return self.error(ApiError(503, "the server is busy or stopping: retry later", code="overloaded"),
                                  endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # the fields taken and not acted on (reasoning_effort...), so that a client can tell
        ignored = {IGNORED_HEADER: ", ".join(req.ignored())} if req.ignored() else {}
        warned = warnings_of(req, jobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(server, jobs, events, rid, created, chat, include_usage, endpoint, warned),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", **ignored})
        waiter = asyncio.ensure_future(_until_done(events, len(jobs)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait([waiter, gone], return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():  # the client went away: stop decoding for it
            for job in jobs:
                job.cancel()
            waiter.cancel()
            server.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        gone.cancel()
        failed = next((job for job in jobs if job.finish_reason == "error"), None)
        if failed is not None:
            return self.error(ApiError(500, f"generation failed: {failed.error}"), endpoint)
        server.metrics.requests.labels(endpoint, "200").inc()
        answer = _answer(server, jobs, rid, created, chat) | ({"warnings": warned} if warned else {})
        return JSONResponse(answer, headers=ignored or None)

    async def models(self, request: Request) -> Response:
        try:
            self.authorised(request)
        except ApiError as exc:
            return self.error(exc, "models")
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.authorised(request)
            wanted = request.path_params["model_id"]
            if wanted != self.server.name:
                raise ApiError(404, f"model '{wanted}' is not served here; this server serves "
                                    f"'{self.server.name}'", "model", "model_not_found")
        except ApiError as exc:
            return self.error(exc, "models")
        return JSONResponse(self.card())

    def card(self) -> dict:
        s = self.server
        return {"id": s.name, "object": "model", "created": s.created, "owned_by": "hd"}

    async def health(self, request: Request) -> Response:
        sched = self.server.scheduler
        queued, running = sched.load()
        ok = sched.alive() and sched.failed is None
        body = {"status": "ok" if ok else "failed", "model": self.server.name, "queued": queued, "running": running}
        if sched.failed is not None:
            body["error"] = f"{type(sched.failed).__name__}: {sched.failed}"
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        try:   # who may read it: serve/metrics.Readers
            self.server.metrics_readers.check(request.headers.get("authorization", ""))
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        self.server.refresh_gauges()
        return Response(self.server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _logprobs(server, job: Job, entries, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for (token id, logprob, [(id, logprob)]) entries: chat's
    {"content": [{token, logprob, bytes, top_logprobs}]} or completions' {tokens, token_logprobs,
    top_logprobs, text_offset}. A token's text is its own decode (a piece of a multi-byte
    character decodes to U+FFFD; `bytes` are those of that text)."""
    if job.request.logprobs is None or entries is None:
        return None
    with server.scheduler.tokenizer_lock:
        tok = server.lm.tokenizer
        names = {t: tok.decode([t]) for e in entries for t in [e[0]] + [b for b, _ in e[2]]}
    if chat:
        def item(t, lp):
            return {"token": names[t], "logprob": lp, "bytes": list(names[t].encode())}
        return {"content": [item(t, lp) | {"top_logprobs": [item(b, blp) for b, blp in best]}
                            for t, lp, best in entries]}
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(names[t])
    return {"tokens": [names[t] for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{names[b]: blp for b, blp in best} for _, _, best in entries],
            "text_offset": offsets}


def _answer(server, jobs: list[Job], rid: str, created: int, chat: bool) -> dict:
    choices = []
    for i, job in enumerate(jobs):
        reason = FINISH[job.finish_reason]
        lps = _logprobs(server, job, server.scheduler.logprob_entries(job), chat)
        if chat:
            message = {"role": "assistant", "content": job.text}
            if job.calls:   # the text before the calls, if any
                message |= {"content": job.text or None, "tool_calls": job.calls}
            choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": _finish(job)})
        else:
            choices.append({"index": i, "text": job.text, "logprobs": lps, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.name, "choices": choices, "usage": server.usage_of(jobs)}


async def _not_found(request: Request, exc) -> Response:
    status = getattr(exc, "status_code", 404)
    msg = "no such route" if status == 404 else f"{request.method} is not allowed here"
    return JSONResponse(ApiError(status, f"{msg}: {request.method} {request.url.path}").body(), status_code=status)


async def _crashed(request: Request, exc: Exception) -> Response:
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)


async def _until_done(events: asyncio.Queue, n: int) -> None:
    """Returns when all n choices' jobs are done."""
    while n:
        _, (kind, _) = await events.get()
        n -= kind == "done"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def warnings_of(req, jobs: list[Job]) -> list[str]:
    """What hd changed of a request or left undone, one line each: an answer's `warnings` (a field
    OpenAI's responses do not have, which its clients keep as an extra; absent when empty)."""
    out = [f"{name}: taken and not acted on (hd serve does not implement it)" for name in req.ignored()]
    return out + (list(jobs[0].warnings) if jobs else [])


async def _sse(server, jobs: list[Job], events: asyncio.Queue, rid: str, created: int, chat: bool,
               include_usage: bool, endpoint: str, warned: list[str] = ()):
    """Server-sent events: one chunk per text piece of a choice (its `index`), a last one per choice
    with its finish_reason, the usage chunk when asked (after every choice ended), then [DONE].
    The first chunk carries the request's `warnings` (warnings_of), where it has any. Leaving
    early (the client disconnected) cancels the jobs."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = [0] * len(jobs)   # characters sent per choice: completions' text_offset
    unsaid = list(warned)

    def chunk(i: int, piece: str | None, finish: str | None, usage=None, choices=True, role=False,
              entries=None, calls=None) -> bytes:
        lps = _logprobs(server, jobs[i], entries, chat, offsets[i]) if entries else None
        offsets[i] += len(piece or "")
        if chat:
            delta = ({"role": "assistant"} if role else {}) | ({} if piece is None else {"content": piece})
            delta |= {"tool_calls": calls} if calls else {}
            choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": i, "text": piece or "", "logprobs": lps, "finish_reason": finish}
        doc = {"id": rid, "object": obj, "created": created, "model": server.name,
               "choices": [choice] if choices else []}
        if usage is not None or include_usage:
            doc["usage"] = usage
        if unsaid:
            doc["warnings"] = list(unsaid)
            unsaid.clear()
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    left = len(jobs)
    try:
        if chat:
            for i in range(len(jobs)):
                yield chunk(i, "", None, role=True)
        while left:
            i, (kind, value) = await events.get()
            job = jobs[i]
            if kind == "text":
                yield chunk(i, value[0], None, entries=value[1])
                continue
            left -= 1
            if job.finish_reason == "error":
                for other in jobs:
                    other.cancel()
                server.metrics.requests.labels(endpoint, "500").inc()
                yield b"data: " + json.dumps(ApiError(500, f"generation failed: {job.error}").body()).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                left = -1
                return
            for k, call in enumerate(job.calls or []):   # OpenAI's deltas: id and name, then the arguments
                fn = call["function"]
                yield chunk(i, None, None, calls=[{"index": k, "id": call["id"], "type": "function",
                                                   "function": {"name": fn["name"], "arguments": ""}}])
                yield chunk(i, None, None, calls=[{"index": k, "function": {"arguments": fn["arguments"]}}])
            yield chunk(i, None, _finish(job), entries=job.lp_rest)
        if include_usage:
            yield chunk(0, None, None, server.usage_of(jobs), choices=False)
        server.metrics.requests.labels(endpoint, "200").inc()
        yield b"data: [DONE]\n\n"
    finally:
        if left > 0:
            for job in jobs:
                job.cancel()
            server.metrics.requests.labels(endpoint, "499").inc()

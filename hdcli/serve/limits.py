"""What bounds the connections `hd serve` holds, and the log they can cause.

  http_protocol(server)  uvicorn's HTTP protocol (h11, or httptools where installed) with a header
                         timeout and a connection cap, read from the Server at each connection
  RateLimited            a logging filter: a kind of record at most once per period, the next one
                         let through counting those dropped meanwhile

Invariants
  * A connection that has not sent a whole request header within `server.header_timeout`
    seconds, counted from its opening or from the end of its last response, is closed: idle
    sockets and slow partial headers cannot hold file descriptors (uvicorn's keep-alive timeout
    starts only after a first response, and stops at the first byte of the next request).
    A request being answered is never cut by it.
  * At most `server.max_connections` connections are open: one beyond is answered 503 (OpenAI's
    error schema) and closed at once, so the process keeps file descriptors to accept with
    (1,100 idle sockets under `ulimit -n 1024` used to time every request out).
  * A connection closed while its request's body is still coming (408, 413, an error before the
    body was read) is closed gracefully: its answer is written, then the write side shut, and what
    the client still sends is read and dropped until it closes or LINGER_SECONDS pass. Closing a
    socket with unread bytes makes the kernel send a reset, which can destroy the answer before
    the client reads it (a 408 to a trickled body arrived as "Connection reset by peer").
  * A request task uvicorn cancels at a stop is logged in one line, without a traceback.
  * Running out of file descriptors is logged once per period with a count, not once per failed
    accept (asyncio logs each, with a traceback: tens of megabytes in seconds).
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import threading
import time
from typing import Callable

OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# Seconds a connection closed mid-body is still read (and the bytes dropped) after its answer, for
# the client to see the answer and close; Apache's lingering close waits as long.
LINGER_SECONDS = 2.0


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {"message": f"the server holds its limit of {max_connections} connections: "
                                            "retry later", "type": "server_error", "param": None,
                                 "code": "overloaded"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class LingeringClose:
    """A connection's transport whose close() lingers where the request's body was not read whole
    (the module's invariants): the write side is shut once the answer is written, and the socket
    closed when the client closes or LINGER_SECONDS later. Everything else is the transport's."""

    def __init__(self, transport, protocol):
        self.transport, self.protocol = transport, protocol
        self.timer = None   # set while lingering: the socket's close, LINGER_SECONDS on

    def __getattr__(self, name):
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.timer is not None or self.transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        cycle = self.protocol.cycle
        if cycle is None or not getattr(cycle, "more_body", False) or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()          # after the answer still buffered
        self.timer = self.protocol.loop.call_later(LINGER_SECONDS, self.transport.close)
        self.transport.resume_reading()     # flow control may have paused it: the client's bytes are read

    @property
    def lingering(self) -> bool:
        return self.timer is not None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def http_protocol(server):
    """A subclass of uvicorn's HTTP protocol bounded by server.header_timeout (seconds) and
    server.max_connections, both read when a connection opens (tests change them on a live server)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Bounded(AutoHTTPProtocol):
        header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > server.max_connections:
                transport.write(_refusal(server.max_connections))
                transport.close()
                return
            self.transport = LingeringClose(transport, self)   # what the request cycles write to
            self._arm()

        def _lingering(self) -> bool:
            return isinstance(self.transport, LingeringClose) and self.transport.lingering

        def data_received(self, data: bytes) -> None:
            if self._lingering():
                return   # the rest of a body no one reads
            super().data_received(data)

        def eof_received(self):
            if self._lingering():
                self.transport.transport.close()   # the client has read the answer and closed
                return None
            return super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()   # the next request's header has the same time, from now

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            if isinstance(self.transport, LingeringClose):
                self.transport.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = self.loop.call_later(server.header_timeout, self._header_timed_out)

        def _header_timed_out(self) -> None:
            self.header_timer = None
            if self.transport.is_closing():
                return
            # no cycle, or a finished one: still waiting for a whole header (a request being
            # answered is left alone; its response re-arms the timer)
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return Bounded


def out_of_files(record: logging.LogRecord) -> bool:
    """A record of a failed accept for want of file descriptors (asyncio's, or uvicorn's)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in OUT_OF_FILES:
        return True
    text = str(record.msg)
    return "out of system resource" in text or "Too many open files" in text


class RateLimited(logging.Filter):
    """Lets one record that `match` picks through per `every` seconds; the next one let through
    says how many were dropped in between. Records it does not pick pass untouched."""

    def __init__(self, every: float = 10.0, match: Callable[[logging.LogRecord], bool] = out_of_files,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.every, self.match, self.clock = every, match, clock
        self.last: float | None = None
        self.dropped = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.match(record):
            return True
        now = self.clock()
        with self.lock:
            if self.last is not None and now - self.last < self.every:
                self.dropped += 1
                return False
            self.last, dropped, self.dropped = now, self.dropped, 0
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.every:g} s not logged)"
        return True


LOGGERS = ("asyncio", "uvicorn.error")


class CutAtShutdown(logging.Filter):
    """uvicorn logs a request task it cancels (a stop that cannot wait longer) as "Exception in
    ASGI application" with a CancelledError traceback, and the lifespan cancelled by a forced
    stop as its traceback's text: one line says each instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "a request still running was cut as the server stopped", None, None, None)
        elif isinstance(record.msg, str) and record.msg.rstrip().endswith("CancelledError"):
            # starlette hands the lifespan's traceback to uvicorn as the message's text
            record.msg, record.args = "the app's lifespan was cut as the server stopped", None
        return True


def limit_log(every: float = 10.0) -> None:
    """Rate-limit out-of-files records on the loggers that write them, and log requests cut at a
    stop in one line (once per process)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimited) for f in logger.filters):
            logger.addFilter(RateLimited(every))
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, CutAtShutdown) for f in logger.filters):
        logger.addFilter(CutAtShutdown())


__all__ = ["http_protocol", "RateLimited", "CutAtShutdown", "out_of_files", "limit_log"]

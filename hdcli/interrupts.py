"""How an `hd` command ends on SIGINT (Ctrl-C) and SIGTERM: at once, at any moment from its first
import to its last write, with exit code 128 + the signal (130, 143), one line on stderr and
nothing left running.

The handler (`install`, by the command line's entry points) ends the process itself instead of
raising KeyboardInterrupt: raised inside an import or a library, that exception can be swallowed
there (numpy's imports did: the answer ran on to exit 0) or end the process as a traceback, and no
thread or child process stops for it. Before the process ends (`end`):
  * every process it started, and theirs, is stopped and then killed (a compiler under ninja, a
    worker pool, a peer server): all are frozen first, pass after pass until none is new, so
    none can start another meanwhile;
  * the cleanups registered with `at_exit` run (a kernel build's lock, a layout cache's
    temporary file): each removes or empties a file of this process and waits for nothing;
  * one line goes straight to file descriptor 2 (the handler may run in the middle of a print).
Where a command cleans up after itself on KeyboardInterrupt (a DB written to a temporary file),
it runs inside `deferred()`: there the first signal raises KeyboardInterrupt, the region's own
cleanup runs, and the process ends as the region is left; a second signal ends it at once.
A signal ignored when hd started (a background job of a shell without job control) stays ignored.
The command line's process also ends through here once its command is done (`run`): the
interpreter's own teardown sets every signal back to its default action first, and a signal in
those last few hundred milliseconds killed hd by the signal (no line, exit -2) after its answer.
Nothing here is installed but by the command line: a program using the Python API keeps Python's
own KeyboardInterrupt.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: int | None = None   # the first signal handled
_ending = False
_deferring = 0                 # deferred() regions the main thread is in
_cleanups: dict[int, Callable[[], None]] = {}
_lock = threading.RLock()      # the handler and the relay thread (_relay_signals) may race
_keys = itertools.count()


def install() -> dict:
    """Handle SIGINT and SIGTERM as the module says. Returns the handlers replaced, for restore();
    nothing off the main thread (only it may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    if previous:
        _relay_signals()
    return previous


# How long the relay leaves the main thread to run the handler itself: it does so at once
# unless it is blocked in a call (a wait on a compiler).
RELAY_GRACE = 0.2
_relaying: tuple[int, int] | bool = False   # (the wakeup fd before, the pipe's write end)


def _relay_signals() -> None:
    """Python runs a signal's handler on the main thread only, between bytecodes; the kernel gives
    a process's signal to any of its threads, and one given to another thread (OpenMP's, a build's)
    leaves a main thread blocked in a call (waiting on a compiler for minutes) unaware of it. The
    C handler writes every signal's number to the wakeup fd, whichever thread took it: a thread of
    hd's reads it and ends the process itself where the main thread has not run the handler
    within RELAY_GRACE. (A deferred region is left to the main thread: it cleans up first.)"""
    global _relaying
    if _relaying:
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        before = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):   # not the main thread of the main interpreter
        os.close(r), os.close(w)
        return
    _relaying = (before, w)   # restore() puts the fd back and closes the pipe: the thread ends
    threading.Thread(target=_relay, args=(r,), name="hd-signals", daemon=True).start()


def _relay(r: int) -> None:
    while True:
        try:
            got = os.read(r, 64)
        except OSError:
            return
        if not got:
            return
        for sig in got:
            # only a signal that came to hd's own handler, judged as it is read (at once): a
            # command with handlers of its own keeps its signals, also where it puts hd's back
            # within the grace (hd serve's drain ends, and restores them)
            if sig not in SIGNALS or signal.getsignal(sig) is not _handle:
                continue
            time.sleep(RELAY_GRACE)
            # and only where the handler has not run meanwhile (_take: this is the first)
            if not _deferring and signal.getsignal(sig) is _handle and _take(sig):
                end(sig)


def _take(sig: int) -> bool:
    """Record the first signal; whether this was it."""
    global _received
    with _lock:
        first = _received is None
        if first:
            _received = sig
    return first


def restore(previous: dict) -> None:
    global _relaying
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if previous and _relaying and all(h is not _handle for h in previous.values()):
        # hd's handlers are gone (not an inner install's undone): the relay stops with them
        signal.set_wakeup_fd(_relaying[0])
        os.close(_relaying[1])
        _relaying = False


def stopping() -> bool:
    """Whether a signal was handled: the process is ending (nothing new should begin)."""
    return _received is not None


def _handle(sig: int, frame) -> None:
    first = _take(sig)
    if first and _deferring:
        raise KeyboardInterrupt   # the region cleans up; deferred() ends the process as it is left
    end(sig)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A region that cleans up after itself on KeyboardInterrupt: the first signal raises it here,
    and the process ends (end) once the outermost region is left. Off the main thread, or where
    hd's handler is not installed, nothing changes."""
    global _deferring
    main = threading.current_thread() is threading.main_thread()
    _deferring += main
    try:
        yield
    finally:
        _deferring -= main
        if main and not _deferring and _received is not None:
            end(_received)


def at_exit(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run `cleanup` if the process is ended by a signal (or by finish() while it is registered);
    returns the function that unregisters it."""
    key = next(_keys)
    _cleanups[key] = cleanup
    return lambda: _cleanups.pop(key, None)


def finish() -> None:
    """At a command's normal end: what is still registered (a kernel build on a thread that was
    never waited for) is stopped and cleaned up as a signal would, so no compiler outlives hd."""
    if _cleanups:
        _stop_children()
        _run_cleanups()


def run(command: Callable[[], None]) -> None:
    """Run the command line's `command`, then end the process with its exit code, with hd's
    handler in place to the last: what the interpreter's exit does first (non-daemon threads
    joined, atexit functions, the standard streams flushed) is done here, then os._exit. An
    exception other than SystemExit goes on as Python's (a traceback: a bug to report)."""
    try:
        command()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a reader gone (| head): the answer was given as far as it wanted
            pass
    os._exit(code)


def end(sig: int) -> None:
    """End the process now: children stopped, cleanups run, one line, exit 128 + sig."""
    global _ending
    with _lock:
        ending, _ending = _ending, True
    if ending:   # a second signal while ending (or the relay beside the handler): one does it
        if threading.current_thread() is threading.main_thread():
            # the relay is ending the process: the main thread, back from a wait on a child the
            # relay killed, runs the signal's pending handler (here) before anything else, and
            # waits here for the exit instead of going on to end the command with exit 0
            while True:
                time.sleep(60)
        return
    # the children are frozen first and killed last, and waited for on either thread (a main
    # thread whose wait on a child returns comes here first and waits: above)
    frozen = _freeze_children()
    _run_cleanups()
    for stream in (sys.stdout, sys.stderr):
        try:   # what the command printed so far (a stream written when the signal came may refuse)
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing may stop the exit
            pass
    what = "interrupted" if sig == signal.SIGINT else "terminated"
    try:
        # after a terminal's ^C echo the line starts on a line of its own
        lead = "\n" if sig == signal.SIGINT and os.isatty(2) else ""
        os.write(2, f"{lead}error: {what} ({signal.Signals(sig).name})\n".encode())
    except OSError:
        pass
    _kill(frozen)
    os._exit(128 + sig)


def _run_cleanups() -> None:
    for cleanup in list(_cleanups.values()):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - one that fails leaves the others to run
            pass
    _cleanups.clear()


def _stop_children() -> None:
    _kill(_freeze_children())


def _freeze_children() -> set[int]:
    """Every descendant of this process frozen (SIGSTOP), pass after pass until a pass finds none
    new (a frozen process starts none)."""
    frozen: set[int] = set()
    for _ in range(64):   # a bound; a pass finds none new once every descendant is frozen
        new = _descendants(os.getpid()) - frozen
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        frozen |= new
    return frozen


def _kill(frozen: set[int]) -> None:
    """The frozen processes killed and waited for until each is gone (a zombie is: it runs
    nothing; this process's own are reaped by whoever inherits them)."""
    for pid in frozen:
        _signal(pid, signal.SIGKILL)
    for _ in range(2000):   # a bound of ~2 s: a killed process is gone in a moment
        if not any(_running(pid) for pid in frozen):
            break
        time.sleep(0.001)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:   # gone already
        pass


def _descendants(root: int) -> set[int]:
    """The processes under `root` by their parents in /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ')'
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found

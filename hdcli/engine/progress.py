"""Progress bars on stderr (tqdm), for every long job: on a terminal a bar redrawn in place;
elsewhere (a file, a pipe, a CI log) whole lines, one every LINE_SECONDS at most and the last state
at the end, never a bar's carriage returns or a blank line that erases it.
"""
from __future__ import annotations

import sys

# where stderr is not a terminal, a bar's lines come at most this often (its first and last besides)
LINE_SECONDS = 10.0


class _Lines:
    """tqdm's stream where stderr is not a terminal: each redraw written as one line."""

    def __init__(self, err):
        self.err = err

    def write(self, s: str) -> None:
        text = s.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            self.err.write(text + "\n")

    def flush(self) -> None:
        self.err.flush()


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bar(**kw):
    """A tqdm bar on stderr (kw: tqdm's own: total, desc, unit, disable, ...)."""
    from tqdm import tqdm
    err = sys.stderr
    if is_terminal(err):
        return tqdm(file=err, **kw)
    kw.update(file=_Lines(err), mininterval=max(kw.get("mininterval", 0.1), LINE_SECONDS), leave=True,
              ascii=True, ncols=100)
    return tqdm(**kw)

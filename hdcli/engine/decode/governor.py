"""Governor: a request stops drafting where drafting does not pay, and tries it again later.

The cost curve caps each step's tree by what its nodes are expected to earn, but it prices the
forward alone: asking the layers, building the tree and a forward that runs slower after them are
paid on every step, and on answers that copy nothing (a short paraphrase) the drafts earn less
than that. The governor judges by the request's own wall clock instead: a drafted step's
tokens per second against a plain step's one token in its seconds, both timed in this request
(so a machine's speed and load, the same for both, cancel out).

Every parameter is a number of steps:
  WINDOW        drafted steps judged together (the latest ones): drafting pays while their tokens
                per second are at least a plain step's (gain >= 1);
  PROBES        plain steps timed when a judgement needs a plain step's seconds and the request
                has timed none yet (their mean is then kept, and updated by every later plain step);
  FIRST_PAUSE   plain steps after drafting is first judged not to pay, doubled after each try
                that does not pay either, up to LONGEST_PAUSE, and reset once one does.
Invariant: the governor decides only whether a step drafts. A plain step is what plain decoding
runs (the same token under greedy and, seeded, under sampling: verify.coupled_choice), so no
output token depends on it, only the speed does.
"""
from __future__ import annotations

WINDOW = 8
PROBES = 2
FIRST_PAUSE = 8
LONGEST_PAUSE = 64


class Governor:
    """One request's judgement of its drafting (module docstring). drafts(): whether the next
    step drafts; observe(): what that step gave, and in how many seconds (None where it was not
    timed alone: a step whose forward was shared with other requests' rows)."""

    def __init__(self):
        self.plain_seconds: float | None = None   # a plain step's seconds in this request
        self._plain_timed = 0
        self._window: list[tuple[int, float]] = []   # (tokens, seconds) of the latest drafted steps
        self._pause = FIRST_PAUSE
        self._plain_left = 0      # plain steps to go before drafting again
        self.plain_steps = 0      # steps it left undrafted
        self.pauses = 0           # times it judged drafting not to pay
        self.last_gain: float | None = None

    def drafts(self) -> bool:
        return self._plain_left == 0

    def observe(self, drafted: bool, tokens: int, seconds: float | None) -> None:
        if not drafted:
            self.plain_steps += 1
            self._plain_left = max(0, self._plain_left - 1)
            if seconds is not None:
                self._plain_timed += 1
                n = min(self._plain_timed, PROBES)   # the probes' mean, then a moving one
                self.plain_seconds = seconds if self.plain_seconds is None else \
                    self.plain_seconds + (seconds - self.plain_seconds) / n
                if self._plain_timed == PROBES and len(self._window) == WINDOW:
                    self._judge()   # the probes were what the judgement waited for
            return
        if seconds is None:
            return
        self._window.append((tokens, seconds))
        del self._window[:-WINDOW]
        if len(self._window) < WINDOW:
            return
        if self._plain_timed < PROBES:
            self._plain_left = PROBES - self._plain_timed   # time plain steps, then judge
            return
        self._judge()

    def _judge(self) -> None:
        """Drafting goes on while the window's tokens per second are at least a plain step's."""
        made, spent = sum(t for t, _ in self._window), sum(s for _, s in self._window)
        self.last_gain = made * self.plain_seconds / spent if spent > 0 else float("inf")
        if self.last_gain >= 1.0:
            self._pause = FIRST_PAUSE
            return
        self.pauses += 1
        self._plain_left = self._pause
        self._pause = min(2 * self._pause, LONGEST_PAUSE)
        self._window.clear()   # the next try is judged on its own steps

"""Governor: a request stops drafting where drafting does not pay, and tries it again later.

The cost curve caps each step's tree by what its nodes are expected to earn, but it prices the
forward alone: asking the layers, building the tree, the verification's bookkeeping and a
forward that runs slower after them are paid on every step, and on answers that copy nothing (a
short paraphrase) the drafts earn less than that. The governor judges by the request's own wall
clock instead: its drafted steps' tokens per second against a plain step's one token in its
seconds, both timed in this request (so a machine's speed and load, the same for both, cancel).

Drafts come in bursts (a copied span, then nothing), so a short window judges a dry spell and
pauses before the next burst: on Spec-Bench an 8-step window lost 5% of hd's speed to such pauses
(docs/benchmarks.md, "A wall-clock governor"). The judgement is over every drafted step of the
request. Even so it cost hd 1-4% there, so it is off by default.

Every parameter is a number of steps:
  WINDOW        drafted steps before the first judgement, and in each try after a pause: drafting
                goes on while all the request's drafted steps' tokens per second are at least
                LEAST_GAIN of a plain step's (below 1: a pause just before a burst costs more than
                drafting that just fails to pay);
  PROBES        plain steps timed when a judgement needs a plain step's seconds and the request
                has timed none yet (their mean is then kept, and updated by every later plain step);
  FIRST_PAUSE   plain steps after drafting is first judged not to pay, doubled after each try
                that does not pay either, up to LONGEST_PAUSE, and reset once one does.
Invariant: the governor decides only whether a step drafts. A plain step is what plain decoding
runs (the same token under greedy and, seeded, under sampling: verify.coupled_choice), so no
output token depends on it, only the speed does.
"""
from __future__ import annotations

WINDOW = 16
LEAST_GAIN = 0.9
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
        self._made = self._spent = 0.0   # tokens and seconds of all the timed drafted steps
        self._tried = 0                  # timed drafted steps since the last judgement's pause
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
                if self._plain_timed == PROBES and self._tried >= WINDOW:
                    self._judge()   # the probes were what the judgement waited for
            return
        if seconds is None:
            return
        self._made += tokens
        self._spent += seconds
        self._tried += 1
        if self._tried < WINDOW:
            return
        if self._plain_timed < PROBES:
            self._plain_left = PROBES - self._plain_timed   # time plain steps, then judge
            return
        self._judge()

    def _judge(self) -> None:
        """Drafting goes on while its tokens per second are at least a plain step's."""
        self.last_gain = self._made * self.plain_seconds / self._spent if self._spent > 0 else float("inf")
        if self.last_gain >= LEAST_GAIN:
            self._pause = FIRST_PAUSE
            return
        self.pauses += 1
        self._plain_left = self._pause
        self._pause = min(2 * self._pause, LONGEST_PAUSE)
        self._tried = 0   # the next try runs WINDOW drafted steps before it is judged

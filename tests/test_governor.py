"""The governor (engine/decode/governor.py): a request stops drafting where drafting does not pay on
its own clock and tries again later, and no output token depends on it.

Its judgements are tested on given step times; the decode loop's on a clock of the test's own
(the seconds a step reports are replaced), never the machine's. It is off by default (on our sets
it cost more than it saved: docs/benchmarks.md); a request asks for it (Speculation.governed)."""
from __future__ import annotations

import pytest

from hdcli.config import DecodingConfig
from hdcli.drafting import ContextDB, Hierarchy
from hdcli.engine.decode import governor
from hdcli.engine.decode.governor import FIRST_PAUSE, LONGEST_PAUSE, PROBES, WINDOW, Governor
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.request import Request, Speculation
from hdcli.engine.decode.verify import Sampling
from hdcli.serve.protocol import ChatRequest

from conftest import tiny_llama

GOVERNED = Speculation(governed=True)
PROMPT = [1, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11]


def run(g: Governor, steps: int, drafted_seconds: float, plain_seconds: float = 1.0, tokens: int = 2) -> list[bool]:
    """Whether each of `steps` steps drafted, each drafted one giving `tokens` in drafted_seconds."""
    out = []
    for _ in range(steps):
        d = g.drafts()
        out.append(d)
        g.observe(d, tokens if d else 1, drafted_seconds if d else plain_seconds)
    return out


def test_drafting_that_pays_is_never_paused_after_the_plain_probes():
    g = Governor()
    steps = run(g, 200, drafted_seconds=1.5)   # 2 tokens in 1.5 plain steps' time: gain 1.33
    assert steps[:WINDOW] == [True] * WINDOW
    assert steps[WINDOW:WINDOW + PROBES] == [False] * PROBES   # a plain step's seconds, timed once
    assert all(steps[WINDOW + PROBES:]) and g.pauses == 0 and g.plain_steps == PROBES
    assert g.last_gain == pytest.approx(2 / 1.5)


def test_drafting_that_does_not_pay_pauses_for_longer_each_try_and_comes_back():
    g = Governor()
    steps = run(g, 600, drafted_seconds=2.5)   # gain 0.8
    # runs of plain steps after the probes: each try of WINDOW drafted steps, then a pause doubled
    runs, n = [], 0
    for d in steps[WINDOW + PROBES:]:
        if d and n:
            runs.append(n)
            n = 0
        n += not d
    assert runs[:4] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE, 8 * FIRST_PAUSE]
    assert max(runs) == LONGEST_PAUSE and g.pauses == len(runs) + (n > 0)
    assert sum(steps) > WINDOW * 4   # it keeps trying: drafting may pay again later


def test_a_dry_spell_in_an_answer_whose_drafting_pays_is_no_pause():
    """Drafts come in bursts: a copied span, then steps that keep nothing. Judged over the whole
    request, a dry spell of WINDOW steps after a burst does not stop drafting."""
    g = Governor()
    run(g, WINDOW + PROBES, drafted_seconds=1.3, tokens=6)
    steps = run(g, 3 * WINDOW, drafted_seconds=1.3, tokens=1)   # each step dearer than a plain one
    assert all(steps) and g.pauses == 0


def test_a_try_that_pays_again_resets_the_pause():
    g = Governor()
    run(g, WINDOW + PROBES + FIRST_PAUSE + WINDOW, drafted_seconds=2.5)   # two failed tries
    assert g._pause == 4 * FIRST_PAUSE
    run(g, 2 * FIRST_PAUSE, drafted_seconds=2.5, plain_seconds=1.0)   # the second pause runs out
    steps = run(g, 3 * WINDOW, drafted_seconds=0.5)   # now 2 tokens in half a plain step's time
    assert all(steps) and g._pause == FIRST_PAUSE


def test_steps_not_timed_alone_count_down_a_pause_and_are_never_judged():
    g = Governor()
    run(g, WINDOW + PROBES, drafted_seconds=3.0)
    assert not g.drafts()
    left = g._plain_left
    for _ in range(left):   # shared forwards (hd serve's batches): no seconds
        assert not g.drafts()
        g.observe(False, 1, None)
    assert g.drafts()
    for _ in range(5 * WINDOW):
        g.observe(True, 1, None)
    assert g.drafts() and g.pauses == 1


def fake_clock(monkeypatch, drafted_seconds: float, plain_seconds: float = 1.0) -> None:
    """Every step the decode loop times reports these seconds instead of the machine's."""
    real = Governor.observe

    def observe(self, drafted, tokens, seconds):
        real(self, drafted, tokens, None if seconds is None else drafted_seconds if drafted else plain_seconds)
    monkeypatch.setattr(governor.Governor, "observe", observe)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=50, seed=1, scale=4.0)


def decode(model, request: Request, drafter=True):
    return Decoder(model, (), Hierarchy([ContextDB(1, 4)], policy="fill", max_candidates=3) if drafter else None
                   ).generate(request)


@pytest.mark.parametrize("sampling,seed", [(Sampling(), None), (Sampling(temperature=0.8, top_k=10), 7)])
def test_governed_output_is_plain_decodings_token_for_token(model, monkeypatch, sampling, seed):
    """Greedy, and seeded sampling: the steps the governor leaves plain and the drafted ones
    between them give plain decoding's tokens. Control: it did switch (both kinds of step ran),
    and with the governor off nothing was left plain."""
    request = Request(PROMPT, 120, sampling, seed, speculation=GOVERNED)
    plain = decode(model, request, drafter=False).tokens
    fake_clock(monkeypatch, drafted_seconds=50.0)   # drafting never pays
    g = decode(model, request)
    assert g.tokens == plain
    assert g.stats.governed_steps >= FIRST_PAUSE and g.stats.draft_tokens["verified"] > 0
    for off in (Speculation(governed=False), Speculation()):   # off, and the default
        got = decode(model, request.replace(speculation=off))
        assert got.tokens == plain and got.stats.governed_steps == 0


def test_drafting_that_pays_keeps_drafting(model, monkeypatch):
    fake_clock(monkeypatch, drafted_seconds=0.5)
    g = decode(model, Request(PROMPT, 120, speculation=GOVERNED))
    assert g.stats.governed_steps == PROBES


def test_the_runs_and_the_requests_switch_reach_the_request():
    assert DecodingConfig().request([1, 2]).speculation.governed is False
    assert DecodingConfig(governor=True).request([1, 2]).speculation.governed is True
    # a request that leaves it unset gets the run's (its own cap kept); one that sets it, its own
    own = DecodingConfig(governor=True).request([1, 2], speculation=Speculation(max_draft=3)).speculation
    assert own.max_draft == 3 and own.governed is True
    assert DecodingConfig(governor=True).request([1, 2], speculation=Speculation(governed=False)).speculation.governed is False
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatRequest(**body).speculation()[3] is None
    assert ChatRequest(**body, speculative={"governor": True}).speculation()[3] is True

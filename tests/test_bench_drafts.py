"""hd bench drafts: the replay of drafting configurations over recorded greedy answers.

The replay runs the decode loop itself against recorded rows, so without the recycle layer it
must take the live engine's every step (the same accepted lengths, answer for answer); a wrong
recorded row must stop it, not be replayed past. With recycle it differs only by the rows off the
greedy path, which it cannot know and withholds (drafts.py's module docstring)."""
from __future__ import annotations

import json

import pytest

from conftest import hd_main
from hdcli.bench import drafts, runner
from hdcli.config import DecodingConfig
from hdcli.drafting import ContextDB, Hierarchy, RecycledLayer, RecycledTable
from hdcli.engine.decode.costs import CostCurve
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.request import Request
from hdcli.errors import HdError

QUESTIONS = [{"category": c, "turns": [t]} for c, t in (
    ("a", "the cat sat on the mat and then the cat sat on the mat"),
    ("a", "we run fast . we run fast . they run slow"),
    ("b", "hello world ! the sun is big and the moon is small"),
    ("b", "one two three four five one two three four five"))]
# a curve that keeps some trees and cuts others: the cap must decide alike live and replayed
CURVE = CostCurve({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.2, 64: 7.0}, one_token_seconds=0.001)


def live(lm, rec, make):
    """Each recorded prompt decoded by the model, with make()'s drafter: accepted lengths per answer."""
    out = []
    for a in rec.answers:
        g = Decoder(lm.model, lm.eos_ids, make(), cost=CURVE).generate(Request(a.prompt, a.limit))
        assert g.tokens == a.answer   # drafts never change greedy output
        out.append(list(g.stats.accept_lengths))
    return out


@pytest.fixture(scope="module")
def rec(tiny_lm):
    return drafts.record(tiny_lm, QUESTIONS, 40)


def test_recording_holds_the_greedy_answer_and_its_rows(tiny_lm, rec):
    plain = [Decoder(tiny_lm.model, tiny_lm.eos_ids).generate(Request(a.prompt, a.limit)).tokens for a in rec.answers]
    assert [a.answer for a in rec.answers] == plain
    for a in rec.answers:
        assert [row[0] for row in a.top] == a.answer and len(a.prompt_top) == len(a.prompt)
        assert all(len(row) == drafts.TOP_K for row in a.top)


@pytest.mark.parametrize("policy,candidates", [("fill-tracked", 4), ("first-hit", 1), ("adaptive", 4)])
def test_replay_takes_the_live_engines_every_step(tiny_lm, rec, policy, candidates):
    make = lambda: Hierarchy([ContextDB(1, 3)], policy=policy, max_candidates=candidates)
    got = drafts.replay(rec, make, tiny_lm.model.config.vocab_size, tiny_lm.eos_ids, price=CURVE, cap=CURVE)
    assert got.accept_lengths == live(tiny_lm, rec, make)
    assert got.tokens == sum(len(a.answer) for a in rec.answers)
    assert max(max(x) for x in got.accept_lengths) > 1   # something was drafted and kept


def test_replay_stops_at_a_row_that_is_not_the_recorded_answer(tiny_lm, rec):
    """Negative control: the replay reads the recorded rows (a row naming another best token is
    not replayed past)."""
    import copy
    bad = copy.deepcopy(rec)
    a = bad.answers[0]
    a.top[5] = [(a.answer[5] + 1) % tiny_lm.model.config.vocab_size] + a.top[5][1:]
    make = lambda: Hierarchy([ContextDB(1, 3)], policy="fill-tracked", max_candidates=4)
    with pytest.raises(AssertionError, match="left the recorded answer"):
        drafts.replay(bad, make, tiny_lm.model.config.vocab_size, tiny_lm.eos_ids, price=CURVE, cap=CURVE)


def test_replay_with_recycle_keeps_the_answer_and_is_told_only_path_rows(tiny_lm, rec):
    """Recycle learns from rows; replay tells it the path's only (never a flat stand-in row):
    every row it records names the recorded best token of its position."""
    told = []

    class Watching(RecycledLayer):
        def record(self, before, tokens, parents, top, probs=None):
            told.append((list(tokens), [list(t) for t in top]))
            super().record(before, tokens, parents, top, probs)

    table = RecycledTable(top_k=8)
    make = lambda: Hierarchy([ContextDB(1, 3), Watching(table)], policy="fill-tracked", max_candidates=4)
    got = drafts.replay(rec, make, tiny_lm.model.config.vocab_size, tiny_lm.eos_ids, price=CURVE, cap=CURVE)
    assert got.tokens == sum(len(a.answer) for a in rec.answers)
    rows = {row[0] for a in rec.answers for row in a.top}
    assert told and all(t[0] in rows for _, tops in told for t in tops)
    assert all(len(t) == 8 and len(set(t)) == 8 for _, tops in told for t in tops)   # no flat row (ids 0..7)


def test_greedy_recycle_tree_equals_plain_greedy(tiny_lm, rec):
    """The recycle layer's best-first greedy tree (rank estimates as the tree's prices) is exact."""
    table = RecycledTable(top_k=8)
    make = lambda: Hierarchy([ContextDB(1, 3), RecycledLayer(table, greedy_tree=True)], policy="fill-tracked",
                             max_candidates=4)
    lengths = live(tiny_lm, rec, make) + live(tiny_lm, rec, make)   # the table warm the second time
    assert max(max(x) for x in lengths) > 1


def test_a_recording_for_anything_else_is_refused_in_one_line(tiny_lm, rec, tmp_path):
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"key": rec.key, "answers": [a.__dict__ for a in rec.answers]}))
    assert drafts.load(path, rec.key).answers[0].answer == rec.answers[0].answer
    for field in ("model", "tokenizer", "questions", "max_new_tokens"):
        other = {**rec.key, field: "something else"}
        with pytest.raises(HdError, match=f"recorded for another {field} .*--record"):
            drafts.load(path, other)
    path.write_text("{not json")
    with pytest.raises(HdError, match="not a recording"):
        drafts.load(path, rec.key)
    assert drafts.recording_key(tiny_lm, QUESTIONS[:2], 40)["questions"] != rec.key["questions"]


def test_ablation_leaves_one_default_layer_out():
    cfg = DecodingConfig(stats_dbs=["s.lmdb"])
    # stats: in no default hierarchy; model: in every one (without a DB, the run's own answers)
    assert runner.ablations(cfg) == ["hd-no-context", "hd-no-model"]
    assert runner.ablations(cfg.replace(model_db="m.lmdb")) == ["hd-no-context", "hd-no-model"]
    assert runner.method_config("hd-no-model", cfg.replace(model_db="m.lmdb")).layers == ["context"]
    assert runner.method_config("hd-governor", cfg).governor is True


def test_bench_drafts_command(tiny_model_dir, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    r = hd_main("bench", "drafts", "--model", tiny_model_dir, "--data", data, "-n", "16", "--methods",
                "context,recycle", "--ablate", "--budgets", "4,16", "--cache", tmp_path / "rec.json", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report["methods"]) == {"context", "recycle", "hd-no-context", "hd-no-model"}
    row = report["methods"]["context"]
    assert set(row["budgets"]) == {"4", "16"} and row["machine"]["mean_accepted"] >= 1.0
    assert (tmp_path / "rec.json").exists()
    again = hd_main("bench", "drafts", "--model", tiny_model_dir, "--data", data, "-n", "8", "--methods", "context",
                    "--cache", tmp_path / "rec.json", "--json")   # another answer length: refused
    assert again.returncode != 0 and "recorded for another max_new_tokens" in again.stderr
    assert [line for line in again.stderr.splitlines() if "error" in line] == [again.stderr.splitlines()[-1]]
    assert "Traceback" not in again.stderr
    bad = hd_main("bench", "drafts", "--model", tiny_model_dir, "--data", data, "--budgets", "65")
    assert bad.returncode != 0 and "--budgets: 65" in bad.stderr and "Traceback" not in bad.stderr


def test_spec_bench_ablate_adds_one_method_per_default_layer(tiny_model_dir, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS[:2]))
    r = hd_main("bench", "spec-bench", "--data", data, "--model", tiny_model_dir, "--methods", "ar,hd", "--ablate",
                "-n", "4", "--dtype", "fp32", "--json")
    assert r.returncode == 0, r.stderr
    assert list(json.loads(r.stdout)["methods"]) == ["ar", "hd", "hd-no-context", "hd-no-model"]


def test_price_by_replays_under_another_models_curve(tiny_model_dir, tmp_path):
    """--price-by: the trees are cut by the given curve (an `hd costs --json` report), not this
    machine's: a flat curve keeps wider trees than one where every row costs a whole forward; a
    file that is no such report is refused in one line."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))

    def curve_file(name, cost):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"model": name, "kernels": "gguf-int8", "cpu": "somewhere", "curves": {"gguf-int8": {
            "one_token_ms": 300.0, "cost": {str(w): cost(w) for w in (1, 2, 4, 8, 16, 64)}, "branch": 0.0,
            "stream": 0.0, "measured_at": 1.0}}}))
        return f

    trees = {}
    for name, cost in (("flat", lambda w: 1.0), ("steep", lambda w: float(w))):
        r = hd_main("bench", "drafts", "--model", tiny_model_dir, "--data", data, "-n", "24", "--methods", "context",
                    "--budgets", "4", "--cache", tmp_path / "rec.json", "--price-by", curve_file(name, cost), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["priced_by"]["model"] == name and report["one_token_ms"] == 300.0
        assert report["cost_curve"]["64"] == cost(64)
        trees[name] = report["methods"]["context"]["machine"]["mean_tree"]
    assert trees["flat"] > trees["steep"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"curves": {}}))
    r = hd_main("bench", "drafts", "--model", tiny_model_dir, "--data", data, "-n", "24", "--methods", "context",
                "--cache", tmp_path / "rec.json", "--price-by", bad)
    assert r.returncode != 0 and "--price-by" in r.stderr and "hd costs" in r.stderr and "Traceback" not in r.stderr

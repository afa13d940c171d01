"""`hd bench spec-bench` end to end on the tiny model, its progress on stderr, and its arithmetic on
recorded timings."""
from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest

from hdcli import bench
from hdcli.bench import specbench
from hdcli.errors import HdError

from test_cli import hd, run

WORDS = "the cat sat on the mat and then the dog ran up and down the red mat".split()


@pytest.fixture
def spec_file(tmp_path):
    """One question per Spec-Bench category; mt_bench's with two turns, as in the real file."""
    rows = [{"question_id": 81, "category": "writing",
             "turns": ["the cat sat on the mat", "and then the dog ran"]}]
    for i, cat in enumerate(specbench.CATEGORIES[1:]):
        rows.append({"question_id": 100 + i, "category": cat,
                     "turns": [" ".join(WORDS[i:i + 8]) + " the cat sat on the"]})
    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.fixture
def stats_db(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(10)))
    out = tmp_path / "s.lmdb"
    hd("build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir), "--min-count", "1", "--json")
    return out


def test_spec_bench_end_to_end(tiny_model_dir, spec_file, stats_db, tmp_path):
    out = tmp_path / "run"
    r = hd("bench", "spec-bench", "--data", str(spec_file), "--model", str(tiny_model_dir),
           "--methods", "ar,hf-ar,context,stats,hd,hd-chain,hf-pld,suffix", "--stats-db", str(stats_db),
           "-n", "16", "--dtype", "fp32", "--out", str(out), "--json")
    report = json.loads(r.stdout)
    assert report["questions"] == 6 and set(report["methods"]) == {"ar", "hf-ar", "context", "stats", "hd",
                                                                   "hd-chain", "hf-pld", "suffix"}
    assert (out / "speedup.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"] == report["methods"]
    for m in report["methods"]:
        recs = [json.loads(line) for line in open(out / "answers" / f"{m}.jsonl")]
        assert len(recs) == 6
        for rec in recs:
            assert set(rec) >= {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
            ch = rec["choices"][0]
            n_turns = 2 if rec["category"] == "writing" else 1
            assert len(ch["turns"]) == len(ch["new_tokens"]) == len(ch["wall_time"]) == n_turns
            if not m.startswith("hf-"):
                assert sum(ch["accept_lengths"]) == sum(ch["new_tokens"])
        # the speedups, recomputed by hand from the answer files
        tps = {}
        for name in ("ar", "hf-ar", m):
            tps[name] = statistics.mean(
                sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"])
                for r in map(json.loads, open(out / "answers" / f"{name}.jsonl")))
        assert report["methods"][m]["overall"]["speedup"] == pytest.approx(tps[m] / tps["ar"], rel=1e-9)
        assert report["methods"][m]["overall"]["speedup_over_hf_ar"] == pytest.approx(tps[m] / tps["hf-ar"],
                                                                                      rel=1e-9)
        # greedy fp32: every method answers exactly as plain decoding does
        assert report["methods"][m]["overall"]["differ_from_ar"] == 0
        assert report["methods"][m]["overall"]["differ_from_hf_ar"] == 0
        assert set(report["methods"][m]["categories"]) == set(specbench.CATEGORIES)
    assert report["methods"]["hd"]["overall"]["layers"]["context"]["accepted"] > 0
    assert "stats" in report["methods"]["stats"]["overall"]["layers"]
    assert report["methods"]["suffix"]["overall"]["layers"]["suffix"]["accepted"] > 0
    assert report["methods_run"][1] == "hf-ar" and report["suffix"]["max_tree_depth"] == 24
    # the saved run renders again, over both baselines
    shown = hd("bench", "report", str(out)).output
    assert "speedup over ar by category" in shown and "speedup over hf-ar by category" in shown


def test_progress_shows_on_stderr_under_json_and_stdout_keeps_the_report(tiny_model_dir, spec_file):
    """A ten-minute run said nothing under --json: now stderr shows answers done of all, the
    question's category and method, and the time elapsed, as plain lines where stderr is not a
    terminal (here: a file), while stdout holds the JSON document alone."""
    from conftest import hd_main
    r = hd_main("bench", "spec-bench", "--data", spec_file, "--model", tiny_model_dir, "--methods", "ar,context",
                "-n", "4", "--dtype", "fp32", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["questions"] == 6
    # each a line of its own (the load's and the cost measurement's bars, cleared with a \r, may
    # share its start)
    lines = [line.rsplit("\r", 1)[-1] for line in r.stderr.split("\n") if " answers · " in line]
    assert lines[0].startswith("1/12 answers · ") and lines[0].endswith(" elapsed"), r.stderr
    assert lines[-1].startswith("12/12 answers · ") and " · context · " in lines[-1], r.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    from hdcli import show
    monkeypatch.setattr(show, "LINE_SECONDS", float("inf"))   # the first answer and the last alone
    questions = [{"category": c} for c in ("qa", "math", "rag")]
    bar, log = Terminal(), io.StringIO()
    for err in (bar, log):
        progress = show.Answered(lambda q: q["category"], err=err)
        for q in questions:
            for method in ("ar", "hd"):
                progress(method, q, 6)
        progress.close()
    assert "\r" in bar.getvalue() and "6/6" in bar.getvalue() and "rag · hd" in bar.getvalue()
    # elsewhere: plain lines, the first answer's and the last's (and one each LINE_SECONDS)
    assert [line.split(" · ")[:3] for line in log.getvalue().splitlines()] == [["1/6 answers", "qa", "ar"],
                                                                               ["6/6 answers", "rag", "hd"]]
    monkeypatch.setattr(show, "LINE_SECONDS", 0.0)
    every = io.StringIO()
    progress = show.Answered(lambda q: q["category"], err=every)
    for i in range(4):
        progress("ar", questions[0], 4)
    assert [line.split(" · ")[0] for line in every.getvalue().splitlines()] == [f"{i}/4 answers" for i in range(1, 5)]


def test_a_long_jobs_bar_is_whole_lines_where_stderr_is_a_log(monkeypatch):
    """engine/progress.bar (the load, the layout cache, hd costs, build-model-db, build-stats):
    redrawn in place on a terminal; in a file or a pipe one line a redraw, with no carriage return
    and the last state kept (a bar left on a terminal is erased); nothing where disabled."""
    import sys
    from hdcli.engine import progress
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    outs = {}
    for name, err in (("terminal", Terminal()), ("log", io.StringIO()), ("quiet", io.StringIO())):
        monkeypatch.setattr(sys, "stderr", err)
        with progress.bar(total=3, desc="loading m", unit=" layers", leave=False, disable=name == "quiet") as b:
            for _ in range(3):
                b.update()
        outs[name] = err.getvalue()
    assert "\r" in outs["terminal"]
    lines = outs["log"].splitlines()
    assert "\r" not in outs["log"] and lines and all(line.startswith("loading m:") for line in lines)
    assert "3/3" in lines[-1] and outs["quiet"] == ""


def test_suffix_without_its_package_is_refused_in_one_line(tiny_model_dir, spec_file, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_arctic(name, *a, **kw):
        if name.startswith("arctic_inference"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_arctic)
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", str(tiny_model_dir),
            "--methods", "ar,suffix", "-n", "4", "--json")
    assert isinstance(r, HdError)
    msg = str(r)
    assert "arctic-inference" in msg and "pip install" in msg and "\n" not in msg


def _turn(n, wall, steps):
    return bench.Turn(text="", tokens=list(range(n)), wall_time=wall, accept_lengths=steps)


def test_summary_arithmetic_on_recorded_timings():
    qa = {"question_id": 1, "category": "qa", "subcategory": "qa", "turns": ["x"]}
    mt = {"question_id": 2, "category": "mt_bench", "subcategory": "writing", "turns": ["x", "y"]}
    results = {
        "ar": [(qa, [_turn(10, 1.0, [1] * 10)]), (mt, [_turn(10, 2.0, [1] * 10), _turn(20, 2.0, [1] * 20)])],
        "m": [(qa, [_turn(10, 0.5, [2] * 5)]), (mt, [_turn(10, 1.0, [5, 5]), _turn(20, 1.0, [4] * 4 + [4])])],
    }
    results["m"][1][1][1].tokens[3] = 99  # differs from ar at token 3 of the second turn
    s = bench.summarize(results)
    # per-question tokens/s: ar 10 and 7.5; m 20 and 15 -> speedup (17.5) / (8.75) = 2
    assert s["m"]["overall"]["speedup"] == pytest.approx(2.0)
    assert s["m"]["categories"]["qa"]["speedup"] == pytest.approx(20 / 10)
    # pooled steps: 5 x 2, 2 x 5, 5 x 4 -> 40 tokens over 12 steps
    assert s["m"]["overall"]["mean_accepted_tokens"] == pytest.approx(40 / 12)
    assert s["m"]["overall"]["differ_from_ar"] == 1 and s["m"]["overall"]["first_differences"] == [13]


def test_spec_bench_bad_input(tiny_model_dir, spec_file, tmp_path):
    m = str(tiny_model_dir)
    r = run("bench", "spec-bench", "--data", str(tmp_path / "none.jsonl"), "--model", m)
    assert isinstance(r, HdError) and "not found" in str(r)
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", m, "--categories", "poetry")
    assert isinstance(r, HdError) and "poetry" in str(r)
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", m, "--methods", "ar,warp")
    assert isinstance(r, HdError) and "warp" in str(r)
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", m, "--methods", "context")
    assert isinstance(r, HdError) and "'ar'" in str(r)
    r = run("bench", "spec-bench", "--data", str(spec_file), "--model", m, "--methods", "ar,stats")
    assert isinstance(r, HdError) and "--stats-db" in str(r)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": []}) + "\n")
    r = run("bench", "spec-bench", "--data", str(bad), "--model", m)
    assert isinstance(r, HdError) and "turns" in str(r) and "bad.jsonl:1" in str(r)
    r = run("bench", "report", str(tmp_path))
    assert isinstance(r, HdError) and "summary.json" in str(r)


def test_a_question_file_of_ones_own_categories_is_selected_in_file_order():
    """`hd bench spec-bench --data mine.jsonl` with categories Spec-Bench does not have (the user-like
    questions of benchmarks/prompts/user_questions.jsonl): every category runs, in file order."""
    from hdcli.bench import specbench
    qs = [{"question_id": i, "category": c, "subcategory": c, "turns": ["q"]}
          for i, c in enumerate(["code", "math", "code", "qa", "chat", "math"])]
    got = specbench.select(qs, 1)
    assert [q["category"] for q in got] == ["qa", "code", "math", "chat"]
    assert len(specbench.select(qs)) == 6
    shipped = specbench.load(Path(__file__).resolve().parents[1] / "benchmarks/prompts/user_questions.jsonl")
    assert [q["category"] for q in specbench.select(shipped, 1)] == ["code", "math-word", "chat", "summarize", "rewrite"]

"""build-stats, merge-stats, db info/query and generate --stats-db through the CLI."""
from __future__ import annotations

import json

import pytest

from conftest import hd_main, one_line_error
from test_cli import hd, run
from hdcli.errors import HdError


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "c.jsonl"
    rows = [{"prompt": "p", "text": "the cat sat on the mat and the cat sat on the red mat"},
            {"prompt": "q", "text": "one two three one two three four"},
            "this line is not json {",
            {"prompt": "r", "text": "the cat sat on the mat again"}]
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return f


def test_build_info_query_generate(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "s.lmdb"
    m = str(tiny_model_dir)
    r = hd("build-stats", str(corpus), "-o", str(out), "--model", m, "--min-count", "1", "--json")
    data = json.loads(r.stdout)
    assert data["read"]["skipped_malformed"] == 1 and data["header"]["documents"] == 3
    assert data["header"]["sources"][0]["sha256"]
    info = json.loads(hd("db", "info", str(out), "--json").stdout)
    assert info["header"]["model"] == m and info["size"]["entries"] > 0
    q = json.loads(hd("db", "query", str(out), "--text", "the cat sat on", "--json").stdout)
    assert q["keys"][0]["found"] and q["draft"].startswith("the mat")
    # fp32: transformers' generate on the stock model is compared token for token (in bf16 its
    # rounding differs from the invariant forward's: docs/dtype.md)
    g = json.loads(hd("generate", "--model", m, "-p", "the cat sat on the", "-n", "20", "--dtype", "fp32",
                      "--stats-db", str(out), "--layers", "context,stats", "--json", "--compare").stdout)
    assert g["compare"]["identical"] and set(g["stats"]["layers"]) <= {"context", "recycle", "stats"}
    assert g["compare"]["identical_to_hf_ar"] and g["compare"]["speedup_over_hf_ar"] > 0
    assert "stats" in g["stats"]["layers"]
    assert "stats" in hd("generate", "--model", m, "-p", "the cat", "-n", "10", "--stats-db", str(out),
                         "--layers", "context,stats", "--no-color").output
    # not in the default hierarchy: a DB given alone is opened, not drafted from, and hd says so
    alone = hd("generate", "--model", m, "-p", "the cat sat on the", "-n", "10", "--stats-db", str(out), "--json")
    assert "stats" not in json.loads(alone.stdout)["stats"]["layers"]
    told = hd("generate", "--model", m, "-p", "the cat sat on the", "-n", "10", "--stats-db", str(out), "--no-color")
    assert "add --layers context,stats to draft from it" in told.stderr


def test_shard_and_merge_cli(tiny_model_dir, corpus, tmp_path):
    m = str(tiny_model_dir)
    hd("build-stats", str(corpus), "-o", str(tmp_path / "all.lmdb"), "--model", m)
    for i in range(2):
        hd("build-stats", str(corpus), "-o", str(tmp_path / f"s{i}.lmdb"), "--model", m, "--shard", f"{i}/2")
    r = hd("merge-stats", str(tmp_path / "s0.lmdb"), str(tmp_path / "s1.lmdb"), "-o", str(tmp_path / "m.lmdb"),
           "--json")
    merged = json.loads(r.stdout)["header"]
    single = json.loads(hd("db", "info", str(tmp_path / "all.lmdb"), "--json").stdout)["header"]
    assert merged["continuations"] == single["continuations"] and merged["tokens"] == single["tokens"]


@pytest.mark.parametrize("args,msg", [
    (["missing.jsonl"], "does not exist"),
    (["CORPUS", "--shard", "3/2"], "--shard"),
    (["CORPUS", "--field", "body"], "no field 'body'"),
    (["CORPUS", "--strict"], "malformed"),
    (["CORPUS", "-o", "/nonexistent/dir/s.lmdb"], "does not exist"),
])
def test_build_stats_bad_input(tiny_model_dir, corpus, tmp_path, args, msg):
    args = [str(corpus) if a == "CORPUS" else a for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "s.lmdb")]
    r = run("build-stats", *args, "--model", str(tiny_model_dir))
    assert isinstance(r, HdError) and msg in str(r) and "\n" not in str(r)
    assert not (tmp_path / "s.lmdb").exists()


def test_existing_output_needs_overwrite(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "s.lmdb"
    hd("build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir))
    r = run("build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir))
    assert isinstance(r, HdError) and "--overwrite" in str(r)
    hd("build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir), "--overwrite")


def test_generate_refuses_foreign_or_missing_db(tiny_model_dir, tmp_path):
    r = run("generate", "--model", str(tiny_model_dir), "-p", "hi", "--stats-db", str(tmp_path / "none.lmdb"))
    assert isinstance(r, HdError) and "does not exist" in str(r)
    r = run("generate", "--model", str(tiny_model_dir), "-p", "hi", "--layers", "context,stats")
    assert isinstance(r, HdError) and "--stats-db" in str(r)


def test_the_counting_options_take_their_names_and_their_older_spellings(tiny_model_dir, corpus, tmp_path):
    """build-stats' key sizes, continuation length and continuations kept are named apart from
    hd generate's --min-n, --max-n, --draft-len and --top-k, which they once shared: both
    spellings build the same DB."""
    m = str(tiny_model_dir)
    new = ["--min-key", "2", "--max-key", "3", "--continuation-len", "2", "--keep", "2"]
    old = ["--min-n", "2", "--max-n", "3", "--draft-len", "2", "--top-k", "2"]
    headers = [json.loads(hd("build-stats", str(corpus), "-o", str(tmp_path / f"{i}.lmdb"), "--model", m,
                             "--min-count", "1", "--json", *args).stdout)["header"] for i, args in enumerate((new, old))]
    assert headers[0]["content_digest"] == headers[1]["content_digest"]
    assert (headers[0]["n_range"], headers[0]["draft_len"], headers[0]["top_k"]) == ([2, 3], 2, 2)


def test_empty_corpus_and_missing_file(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for corpus in (empty, tmp_path / "missing.jsonl"):
        err = one_line_error(hd_main("build-stats", corpus, "-o", tmp_path / "s.lmdb", "--model", tiny_model_dir))
        assert corpus.name in err
    assert not (tmp_path / "s.lmdb").exists()

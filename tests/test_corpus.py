"""hdcli.db.corpus: each input format, the error messages users see, sharding, limit, the report."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from hdcli.db.corpus import ReadReport, expand_inputs, iter_documents, read_corpus
from hdcli.errors import HdError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def docs(paths, **kwargs):
    report = ReadReport()
    return list(iter_documents(paths, report=report, **kwargs)), report


# ---------------------------------------------------------------------------------------- jsonl


def test_jsonl_field_prompt_and_blank_lines(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "one", "prompt": "Q1", "body": "b1"}\n'
                 '\n   \n'                                   # blank lines: ignored, not counted
                 '{"text": "two", "prompt": ""}\r\n'         # empty prompt: text alone
                 '{"text": "  ", "body": "b3"}\n'            # empty text: skipped and counted
                 '{"text": null, "body": "b4"}\n'            # null text: the same
                 '{"text": "four\\u2028five"}',              # no final newline; U+2028 inside
                 encoding="utf-8")
    out, report = docs([p])
    assert out == ["one", "two", "four\u2028five"]
    assert (report.documents, report.skipped_empty, report.skipped_malformed) == (3, 2, 0)
    out, _ = docs([p], with_prompt=True)
    assert out == ["Q1\n\none", "two", "four\u2028five"]
    with pytest.raises(HdError, match=r"c.jsonl:4: no field 'body'"):  # blank lines count too
        docs([p], field="body")


def test_malformed_lines_skipped_counted_or_strict(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"\n[1, 2]\n"just a string"\n{"text": "c"}\n',
                 encoding="utf-8")
    out, report = docs([p])
    assert out == ["a", "c"] and report.skipped_malformed == 3
    with pytest.raises(HdError, match=r"m.jsonl:2: malformed JSON line \(") as err:
        docs([p], strict=True)
    assert "\n" not in str(err.value)
    p.write_text('{"text": "a"}\n[1]\n', encoding="utf-8")
    with pytest.raises(HdError, match=r"m.jsonl:2: malformed JSON line \(a list, not a JSON obj"):
        docs([p], strict=True)


def test_missing_or_non_string_field_names_file_line_and_fields(tmp_path):
    p = write_jsonl(tmp_path / "corpus.jsonl",
                    [{"text": "x"}, {"text": "y"}, {"id": 3, "prompt": "p", "answer": "a"}])
    with pytest.raises(HdError) as err:
        docs([p])
    assert str(err.value) == (f"{p}:3: no field 'text' (fields: id, prompt, answer); "
                              f"pass --field NAME")
    # a text field that is not a string is a malformed record: counted and skipped like a broken
    # line (the behaviour docs/stats-db.md promises), an error naming file and line with strict
    p = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "x"}, {"text": ["y"]}, {"text": 7},
                                                {"text": {"a": 1}}, {"text": "z"}])
    out, report = docs([p])
    assert out == ["x", "z"] and report.skipped_malformed == 3
    assert report.first_malformed == f"{p}:2: field 'text' is a list, not a string"
    with pytest.raises(HdError, match=r"corpus.jsonl:2: malformed record \(field 'text' is a list, not a string"):
        docs([p], strict=True)


def test_non_utf8_bytes_replaced_and_counted(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "caf\xe9"}\n{"text": "ok \xc3\xa9"}\n'
                  b'{"text": "\xff\xfe x"}\n')                 # with a BOM first, as Windows writes
    out, report = docs([p])
    assert out == ["caf\ufffd", "ok \u00e9", "\ufffd\ufffd x"]
    assert report.replaced_non_utf8 == 2 and report.skipped_malformed == 0


def test_huge_single_line(tmp_path):
    big = "word " * 4_000_000  # 20 MB in one JSON line
    p = write_jsonl(tmp_path / "huge.jsonl", [{"text": "small"}, {"text": big}, {"text": "end"}])
    out, report = docs([p])
    assert [len(d) for d in out] == [5, len(big), 3] and out[1] == big
    assert report.documents == 3


def test_json_array_and_json_lines_in_dot_json(tmp_path):
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"text": "a"}, 5, {"text": "b", "prompt": "p"}], indent=2))
    out, report = docs([arr], with_prompt=True)
    assert out == ["a", "p\n\nb"] and report.skipped_malformed == 1
    with pytest.raises(HdError, match=r"arr.json: item 2: malformed JSON item \(a number"):
        docs([arr], strict=True)
    lines = write_jsonl(tmp_path / "lines.json", [{"text": "c"}, {"text": "d"}])
    assert docs([lines])[0] == ["c", "d"]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "a"},')  # a broken array fails the file, even without strict
    with pytest.raises(HdError, match=r"bad.json: not valid JSON"):
        docs([bad])


# ------------------------------------------------------------------------------------------ txt


def test_txt_paragraphs(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"\n\nFirst line\nsecond line\n\n  \n\nSecond para\r\n\r\nThird \xff\n")
    out, report = docs([p])
    assert out == ["First line\nsecond line", "Second para", "Third \ufffd"]
    assert report.replaced_non_utf8 == 1 and report.documents == 3


def test_txt_long_paragraph_is_cut_without_splitting_characters(tmp_path):
    text = "a\u00e9\u20ac" * 700_000  # 4.2 MB on one line, 1-, 2- and 3-byte characters
    p = tmp_path / "long.txt"
    p.write_text(text + "\n\nafter\n", encoding="utf-8")
    out, report = docs([p])
    assert len(out) >= 4 and out[-1] == "after"
    assert all(len(d.encode()) <= 2 << 20 for d in out)
    assert "".join(out[:-1]) == text and report.replaced_non_utf8 == 0


# ------------------------------------------------------------------- parquet, csv, datasets


@pytest.fixture(scope="module")
def table():
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"text": ["alpha", "", "NA", "1984"],
                                       "prompt": ["P", "Q", None, "R"],
                                       "n": [1, 2, 3, 4]})


def test_parquet_and_csv_via_datasets(tmp_path, table):
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.to_csv(str(tmp_path / "t.csv"), index=False)
    for name in ("t.parquet", "t.csv"):
        out, report = docs([tmp_path / name], with_prompt=True)
        # "NA" stays text in CSV, and a column of years in CSV is still read as strings
        assert out == ["P\n\nalpha", "NA", "R\n\n1984"], name
        assert report.skipped_empty == 1
        with pytest.raises(HdError, match=rf"{name}: no column 'body' \(columns: text, prompt, n"):
            docs([tmp_path / name], field="body")
    with pytest.raises(HdError, match=r"t.parquet: column 'n' holds int64, not text"):
        docs([tmp_path / "t.parquet"], field="n")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(HdError, match=r"cannot read corpus parquet file .*broken.parquet"):
        docs([tmp_path / "broken.parquet"])


def test_datasets_folder(tmp_path, table):
    import datasets
    table.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": table.select([0]), "train": table.select([3])}).save_to_disk(
        str(tmp_path / "dd"))
    assert docs([tmp_path / "ds"])[0] == ["alpha", "NA", "1984"]
    assert docs([tmp_path / "dd"])[0] == ["1984"]  # the train split
    with pytest.raises(HdError, match=r"ds: no column 'body' \(columns: text, prompt, n\)"):
        docs([tmp_path / "ds"], field="body")
    # a folder saved by datasets is one input, also inside a folder or under a ** glob
    (tmp_path / "x.jsonl").write_text('{"text": "x"}\n')
    expected = [tmp_path / "dd", tmp_path / "ds", tmp_path / "x.jsonl"]
    assert expand_inputs([str(tmp_path)]) == expected
    assert expand_inputs([str(tmp_path / "**")]) == expected
    its, report = read_corpus([str(tmp_path / "ds")])
    assert list(its) == ["alpha", "NA", "1984"]
    folder = tmp_path / "ds"
    assert report.files[0]["bytes"] == sum(f.stat().st_size for f in folder.iterdir())


# ------------------------------------------------------------------------------------ inputs


def test_globs_and_folder_expansion(tmp_path, monkeypatch):
    for rel in ("a/1.jsonl", "a/b/2.txt", "a/b/3.CSV", "a/notes.md", "a/.hidden/4.jsonl", "c.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.chdir(tmp_path)
    P = type(tmp_path)
    assert expand_inputs(["a"]) == [P("a/1.jsonl"), P("a/b/2.txt"), P("a/b/3.CSV")]
    assert expand_inputs(["a/**/*.txt", "c.json"]) == [P("a/b/2.txt"), P("c.json")]
    assert expand_inputs(["a/**/*"]) == expand_inputs(["a"])  # notes.md is dropped, not refused
    # sorted and deduplicated across inputs and spellings
    assert expand_inputs(["c.json", "./a/1.jsonl", "a/*.jsonl", "c.json"]) == [
        P("a/1.jsonl"), P("c.json")]
    (tmp_path / "[x].jsonl").write_text("")  # a real name with glob characters is taken as is
    assert expand_inputs(["[x].jsonl"]) == [P("[x].jsonl")]


def test_missing_and_unsupported_inputs(tmp_path):
    with pytest.raises(HdError, match=r"corpus file .*nope.jsonl does not exist"):
        expand_inputs([str(tmp_path / "nope.jsonl")])
    with pytest.raises(HdError, match=r"corpus pattern .*\*.jsonl matches no files"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(HdError, match=r"notes.md has an unsupported type \(supported: .jsonl "
                                      r".json .txt .parquet .csv, or a folder saved by datasets"):
        expand_inputs([str(tmp_path / "notes.md")])
    with pytest.raises(HdError, match=r"matches no corpus files"):
        expand_inputs([str(tmp_path / "*.md")])
    with pytest.raises(HdError, match=r"contains no corpus files"):
        expand_inputs([str(tmp_path)])
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(HdError, match=r"dir.jsonl is a directory"):
        docs([tmp_path / "dir.jsonl"])
    with pytest.raises(HdError, match=r"cannot read corpus file .*gone.jsonl"):
        docs([tmp_path / "gone.jsonl"])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    p = write_jsonl(tmp_path / "secret.jsonl", [{"text": "x"}])
    p.chmod(0)
    with pytest.raises(HdError, match=r"cannot read corpus file .*secret.jsonl: Permission denied"):
        read_corpus([str(p)])
    with pytest.raises(HdError, match=r"secret.jsonl: Permission denied"):
        docs([p])


# ---------------------------------------------------------------------- shards, limit, report


def test_shards_partition_the_stream_and_limit(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(7)] + [{"text": ""}])
    b = tmp_path / "b.txt"
    b.write_text("\n\n".join(f"b{i}" for i in range(6)))
    full, _ = docs([a, b])
    assert len(full) == 13
    for n in (1, 2, 3, 5):
        parts = [docs([a, b], shard=(i, n))[0] for i in range(n)]
        assert sum(map(len, parts)) == len(full)
        assert sorted(d for part in parts for d in part) == sorted(full)
        assert parts[n - 1] == full[n - 1::n]  # the documents whose index is i mod n, in order
    out, report = docs([a, b], limit=4)
    assert out == full[:4] and report.documents == 4
    assert docs([a, b], shard=(1, 3), limit=2)[0] == full[1::3][:2]
    assert docs([a, b], limit=0)[0] == []
    for bad in ({"shard": (3, 3)}, {"shard": (0, 0)}, {"limit": -1}):
        with pytest.raises(HdError, match="invalid"):
            iter_documents([a], **bad)


def test_read_corpus_report_and_sha256(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_bytes(b'{"text": "x"}\nbroken\n{"text": ""}\n{"text": "y\xff"}\n')
    b = tmp_path / "b.txt"
    b.write_bytes(b"")  # an empty input is fine: it yields nothing
    it, report = read_corpus([str(tmp_path / "*")])
    sha_a = hashlib.sha256(a.read_bytes()).hexdigest()
    assert report.files == [
        {"path": str(a), "bytes": a.stat().st_size, "sha256": sha_a},
        {"path": str(b), "bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()},
    ]
    assert report.documents == 0  # counts grow as the iterator is read
    assert list(it) == ["x", "y\ufffd"]
    assert (report.documents, report.skipped_malformed, report.skipped_empty,
            report.replaced_non_utf8) == (2, 1, 1, 1)


def test_fsspec_urls_are_read_like_local_files(tmp_path):
    """Remote storage goes through fsspec (file:// here; s3://, gs://, https:// where their
    packages are installed): fetched once, read by the same code, recorded under the URL."""
    from hdcli.db.corpus import read_corpus
    (tmp_path / "d").mkdir()
    for i in range(2):
        write_jsonl(tmp_path / "d" / f"part{i}.jsonl", [{"text": f"doc {i} a"}, {"text": f"doc {i} b"}])
    texts, report = read_corpus([f"file://{tmp_path}/d/*.jsonl"])
    assert list(texts) == ["doc 0 a", "doc 0 b", "doc 1 a", "doc 1 b"]
    assert [f["path"] for f in report.files] == [f"file://{tmp_path}/d/part{i}.jsonl" for i in range(2)]
    with pytest.raises(HdError, match="does not exist"):
        read_corpus([f"file://{tmp_path}/nothing.jsonl"])
    with pytest.raises(HdError, match="needs its fsspec filesystem package|unknown protocol|not known"):
        read_corpus(["nosuchproto://bucket/x.jsonl"])

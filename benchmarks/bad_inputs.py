"""What a user sees for each bad input: runs `hd` on each case and prints a markdown table of the
exit code and the last line on stderr (the tests in tests/test_cli.py, test_cli_stats.py,
test_models.py, test_statsdb.py, test_corpus.py and test_bench.py assert these; this script shows
them with the bundled model).

    python benchmarks/bad_inputs.py > docs/bad-inputs.md.part
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HD = [sys.executable, "-m", "hdcli.cli"]


def main():
    d = Path(tempfile.mkdtemp())
    (d / "empty.jsonl").write_text("")
    (d / "bad.jsonl").write_text('{"text": "fine"}\nthis is not json {\n{"other": "no text"}\n')
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (d / "huge.jsonl").write_text(json.dumps({"text": "word " * 5_000_000}) + "\n")
    (d / "notgguf.gguf").write_bytes(b"hello, not a model")
    (d / "cut.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x05\x00")
    (d / "notdb.lmdb").write_bytes(b"\x00" * 4096)
    (d / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "qa", "turns": []}) + "\n")
    (d / "q2.jsonl").write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}) + "\n")
    (d / "good.jsonl").write_text(json.dumps({"text": "a good document"}) + "\n")
    (d / "p.txt").write_text("Hello there")
    subprocess.run(HD + ["build-stats", str(d / "good.jsonl"), "-o", str(d / "ok.lmdb"), "--min-count", "1",
                         "--json"], capture_output=True)
    cases = [
        ("missing corpus file", ["build-stats", d / "missing.jsonl", "-o", d / "o1.lmdb"]),
        ("empty corpus", ["build-stats", d / "empty.jsonl", "-o", d / "o2.lmdb"]),
        ("malformed json lines, missing fields", ["build-stats", d / "bad.jsonl", "-o", d / "o3.lmdb", "--min-count", "1"]),
        ("malformed line with --strict", ["build-stats", d / "bad.jsonl", "-o", d / "o4.lmdb", "--strict"]),
        ("non-UTF-8 text", ["build-stats", d / "latin1.txt", "-o", d / "o5.lmdb", "--min-count", "1"]),
        ("one 25 MB single-line document", ["build-stats", d / "huge.jsonl", "-o", d / "o6.lmdb", "--min-count", "1"]),
        ("existing output", ["build-stats", d / "good.jsonl", "-o", d / "ok.lmdb"]),
        ("unknown model name", ["generate", "-m", "no-org/no-model", "-p", "hi"]),
        ("a .gguf that is not GGUF", ["generate", "-m", d / "notgguf.gguf", "-p", "hi"]),
        ("a truncated .gguf", ["generate", "-m", d / "cut.gguf", "-p", "hi"]),
        ("a DB file that is not an hd DB", ["db", "info", d / "notdb.lmdb"]),
        ("prompt longer than the context", ["generate", "--raw", "-p", "word " * 9000, "-n", "4"]),
        ("--max-new-tokens 0", ["generate", "-p", "hi", "-n", "0"]),
        ("--prompt and --prompt-file", ["generate", "-p", "hi", "--prompt-file", d / "p.txt"]),
        ("--learn without --model-db", ["generate", "-p", "hi", "--learn"]),
        ("--no-db without --draft-models", ["generate", "-p", "hi", "--no-db"]),
        ("unknown drafting layer", ["generate", "-p", "hi", "--layers", "context,web"]),
        ("Spec-Bench file with empty turns", ["bench", "spec-bench", "--data", d / "q.jsonl"]),
        ("Spec-Bench category not in the file", ["bench", "spec-bench", "--data", d / "q2.jsonl", "--categories", "rag"]),
    ]
    print("| bad input | exit code | what the user sees (last line on stderr) |")
    print("|---|---|---|")
    for name, args in cases:
        p = subprocess.run(HD + [str(a) for a in args], capture_output=True, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith(("counting", "loading"))]
        last = lines[-1] if lines else "(runs normally)"
        last = last.replace(str(d), "DIR").replace("|", "\\|")
        print(f"| {name} | {p.returncode} | {last[:220]} |", flush=True)


if __name__ == "__main__":
    main()

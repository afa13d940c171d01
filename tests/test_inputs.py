"""Bounded inputs and model stores (issue 61, round five).

Every file argument is read no further than its bound (hdcli/inputs.py): /dev/zero or a file
past the bound is one line naming the flag, the file and the bound, in bounded memory. A DB path
that is a symlink loop or a FIFO says so. A model store's bad entry is one line and the rest are
listed; a store name stays inside its store. A UTF-8 BOM is not data; an output path that cannot
be a DB file is one line."""
from __future__ import annotations

import json
import os
import resource

import pytest

from hdcli.commands import generate as generate_commands
from hdcli.bench import specbench
from hdcli.config import DecodingConfig
from hdcli.engine import loader, local_models
from hdcli.errors import HdError
from hdcli.commands import plan as plan_commands
from hdcli.hsd import planner
from hdcli.serve import tenants

from conftest import hd_main, hd_sub, one_line_error, write_corpus
from test_local_models import HEX, gguf_file, stores   # noqa: F401 - fixtures

MiB = 1 << 20

# flag -> (what reads a file given with it, the file's bound: hdcli/inputs.py's, written out so
# that this file also runs on the code before it)
READERS = {
    "--prompt-file": (lambda p: generate_commands.read_prompt(None, p), 16 * MiB),
    "--json-schema": (lambda p: generate_commands.output_from_files(p, False, None, None, None), MiB),
    "--grammar": (lambda p: generate_commands.output_from_files(None, False, p, "lark", None), MiB),
    "--prediction": (lambda p: generate_commands.output_from_files(None, False, None, None, p), 16 * MiB),
    "--config": (DecodingConfig.from_file, 16 * MiB),
    "--plan": (planner.read_plan_file, 16 * MiB),
    "--prompts": (lambda p: plan_commands.calibration_prompts(None, p, 1), 16 * MiB),
    "--api-keys-file": (lambda p: tenants.Keys.load((), p), MiB),
    "Spec-Bench file": (specbench.load, 64 * MiB),     # hd bench spec-bench --data
}


def test_the_bounds_are_the_declared_ones():
    from hdcli import inputs
    from hdcli.engine.text import constrain
    assert (inputs.TEXT_BYTES, inputs.DOCUMENT_BYTES, inputs.KEYS_BYTES, inputs.BENCH_BYTES,
            constrain.MAX_SOURCE_BYTES) == (16 * MiB, 16 * MiB, MiB, 64 * MiB, MiB)


def sparse(path, size: int):
    """A file of `size` zero bytes that takes no disk."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("flag", READERS)
@pytest.mark.parametrize("source", ["sparse", "/dev/zero"])
def test_a_file_argument_over_its_bound_is_one_line(tmp_path, flag, source):
    read, limit = READERS[flag]
    path = sparse(tmp_path / "big", limit + 1) if source == "sparse" else "/dev/zero"
    with pytest.raises(HdError) as err:
        read(path)
    line = str(err.value)
    assert line.startswith(f"{flag} {path}: over {limit // MiB} MiB; ") and "\n" not in line


def test_a_file_at_its_bound_is_read_whole(tmp_path):
    from hdcli import inputs
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbf" + b"a" * (100 - 3))   # the BOM counts as bytes, not as text
    assert inputs.read_text(f, "--prompt-file", 100, "") == "a" * 97


def test_hd_generate_json_schema_of_dev_zero_is_one_line():
    err = one_line_error(hd_main("generate", "-p", "hi", "--json-schema", "/dev/zero"))
    assert err.startswith("error: --json-schema /dev/zero: over 1 MiB; "), err


def test_dev_zero_under_a_memory_limit_is_one_line_not_a_memory_error():
    """The issue's 24 GB: under a 2 GiB address-space limit a whole read ended in a MemoryError
    traceback; a bounded read fits (hd's imports take about 0.6 GiB of addresses)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    p = hd_sub("generate", "-p", "hi", "--grammar", "/dev/zero", "--grammar-format", "lark",
               preexec_fn=limit, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one_line_error(p).startswith("error: --grammar /dev/zero: over 1 MiB; ")

def test_a_model_db_prompts_line_over_its_bound_is_one_line(tmp_path):
    from hdcli.db import modeldb
    f = sparse(tmp_path / "prompts.jsonl", 16 * MiB + 2)   # zeros: no line ends
    with pytest.raises(HdError, match=rf"^{f}:1: a line over 16 MiB; "):
        modeldb.load_prompts(f)


def test_hd_plan_reads_its_prompts_before_loading_any_model():
    err = one_line_error(hd_main("plan", "--model", "no-such-model", "--draft-models", "self:int8",
                                 "--prompts", "/dev/zero"))
    assert err.startswith("error: --prompts /dev/zero: over 16 MiB; "), err


# --- DB paths that are no file ----------------------------------------------------------------

def _loop(tmp_path):
    a, b = tmp_path / "a.lmdb", tmp_path / "b.lmdb"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


def _fifo(tmp_path):
    f = tmp_path / "f.lmdb"
    os.mkfifo(f)
    return f


@pytest.mark.parametrize("make,said", [(_loop, "is a symlink loop, not a regular file or folder"),
                                       (_fifo, "is a FIFO, not a regular file or folder")])
@pytest.mark.parametrize("command", [["db", "info"], ["db", "verify"], ["db", "query", "--text", "x"],
                                     ["merge-stats", "-o", "OUT"]])
def test_a_db_path_that_is_no_file_says_what_it_is(tmp_path, make, said, command):
    path = make(tmp_path)
    args = [str(tmp_path / "out.lmdb") if a == "OUT" else a for a in command]
    err = one_line_error(hd_main(*args[:2], path, *args[2:]) if command[0] == "db" else hd_main(*args, path))
    assert f"DB {path} {said}" in err and "does not exist" not in err


def test_a_db_path_too_long_for_the_file_system_is_one_line(tmp_path):
    path = tmp_path / ("d" * 300)
    err = one_line_error(hd_main("db", "info", path))
    assert "File name too long" in err

def test_a_db_path_that_is_a_broken_symlink_names_its_target(tmp_path):
    path = tmp_path / "s.lmdb"
    path.symlink_to(tmp_path / "gone.lmdb")
    err = one_line_error(hd_main("db", "info", path))
    assert f"DB {path} is a broken symlink (to {tmp_path / 'gone.lmdb'}, which does not exist)" in err


# --- model stores -----------------------------------------------------------------------------

BAD_MANIFESTS = {
    "layers of numbers": {"layers": [1, 2, 3]},
    "layers a string": {"layers": "abc"},
    "a 5000-character digest": {"layers": [{"mediaType": local_models.OLLAMA_MODEL_LAYER,
                                            "digest": "sha256:" + "a" * 5000}]},
    "the manifest a list": [1],
}


@pytest.mark.parametrize("fault", BAD_MANIFESTS)
def test_a_malformed_manifest_is_one_line_and_the_rest_are_listed(stores, fault):   # noqa: F811
    ollama, _, manifest = stores
    p = manifest("library", "bad", "latest", [])
    p.write_text(json.dumps(BAD_MANIFESTS[fault]))
    with pytest.raises(HdError) as err:
        loader.resolve("ollama:bad")
    assert str(p) in str(err.value) and "\n" not in str(err.value)
    assert len(str(err.value)) < 400   # the digest is shown cut
    out = hd_main("models", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert len(rep["models"]) == 6 and [s["name"] for s in rep["skipped"]] == ["ollama:bad:latest"]
    table = hd_main("models")
    warnings = [line for line in table.stderr.splitlines() if line.strip()]
    assert table.returncode == 0 and "ollama:smollm2:latest" in table.stdout
    assert len(warnings) == 1 and warnings[0].startswith("warning: skipped ollama:bad:latest: ollama manifest")


@pytest.mark.parametrize("name,said", [
    ("ollama:" + "n" * 300, "its name 'nnnn"),
    ("ollama:smollm2:" + "t" * 300, "its tag 'tttt"),
    ("ollama:" + "s" * 300 + "/smollm2", "its namespace 'ssss"),
    ("ollama:../../outside", "its registry '..'"),
    ("ollama:library/../x", "its namespace '..'"),
    ("lmstudio:" + "p" * 300 + "/x", "is longer than a file name can be (255 bytes)"),
    ("lmstudio:pub/" + "f" * 300 + ".gguf", "is longer than a file name can be (255 bytes)"),
    ("lmstudio:/etc/passwd", "expected a name inside the store"),
    ("lmstudio:../outside/x.gguf", "expected a name inside the store"),
    ("lmstudio:pub/./one", "expected a name inside the store"),
    ("lmstudio:pub/one/mmproj-one-f16.gguf", "is a vision projector (mmproj), not a model"),
    ("lmstudio:two-Q8_?", "not found under"),      # a name, not a glob pattern
])
def test_a_store_name_stays_a_name_inside_its_store(stores, tmp_path, name, said):   # noqa: F811
    ollama, lms, _ = stores
    outside = tmp_path / "outside"        # what ../ reached: a model, and a manifest of one
    outside.mkdir()
    (outside / "x.gguf").symlink_to(lms / "pub" / "one" / "one-Q4_1.gguf")
    (outside / "latest").write_text(json.dumps({"layers": [{"mediaType": local_models.OLLAMA_MODEL_LAYER,
                                                            "digest": f"sha256:{HEX}"}]}))
    with pytest.raises(HdError) as err:
        loader.resolve(name)
    line = str(err.value)
    assert said in line and "\n" not in line and len(line) < 400, line


def test_hd_generate_on_a_bad_store_name_is_one_line(stores):   # noqa: F811
    err = one_line_error(hd_main("generate", "-p", "hi", "--model", "lmstudio:/etc/passwd"))
    assert "lmstudio:/etc/passwd: expected a name inside the store" in err


# --- a UTF-8 BOM is not data; output paths that cannot be a DB file ---------------------------

def test_a_utf8_bom_is_not_data(tiny_model_dir, tmp_path):
    """Files saved by editors that write a BOM read like any other JSON lines."""
    from hdcli.db import modeldb
    from hdcli.bench import specbench
    q = tmp_path / "question.jsonl"
    q.write_text('\ufeff{"question_id": 1, "category": "qa", "turns": ["the cat"]}\n', encoding="utf-8")
    assert specbench.load(q)[0]["turns"] == ["the cat"]
    p = tmp_path / "prompts.jsonl"
    p.write_text('\ufeff{"prompt": "the cat sat"}\n', encoding="utf-8")
    assert modeldb.load_prompts(p)[0] == ["the cat sat"]


def test_a_prompt_file_with_a_bom_is_the_prompt_alone(tmp_path):
    from hdcli.commands.generate import read_prompt
    f = tmp_path / "p.txt"
    f.write_text("\ufeffthe cat sat", encoding="utf-8")
    assert read_prompt(None, f) == "the cat sat"


def test_output_paths_that_cannot_be_a_db_file(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 8)
    folder = tmp_path / "folder.lmdb"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    m = str(tiny_model_dir)
    assert "is a folder: -o takes a file path" in one_line_error(
        hd_main("build-stats", corpus, "-o", folder, "--overwrite", "-m", m))
    assert "a_file is a file, not a folder" in one_line_error(
        hd_main("build-stats", corpus, "-o", a_file / "x.lmdb", "-m", m))
    assert "is a folder, not a DB file" in one_line_error(hd_main("db", "info", folder))
    assert "is a folder: -o takes a file path" in one_line_error(
        hd_main("build-model-db", "-o", folder, "--overwrite", "-m", m))

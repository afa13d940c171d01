"""A transformers checkpoint (a model folder: config.json and safetensors files, or a hub id
resolved to one in the local cache) read as hd's forwards read a GGUF file (gguf.GGUFFile).

Why: hd's forwards (llama.py, gemma3.py) are built from a source that answers `arch`, `has(name)`,
`raw(name)`, `config()`, `release()` and `type_counts()`, in GGUF tensor names. A checkpoint
answers the same, so a folder saved by transformers' save_pretrained runs on the same forward,
kernels and M-invariant mode as a GGUF of the same model.

Names. The forwards ask for GGUF names (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...);
`hf_name` maps them to transformers' (`model.layers.{i}.self_attn.q_proj.weight`, ...) under
the prefix the checkpoint keeps its decoder at (`model.` for *ForCausalLM, `model.language_model.`
or `language_model.model.` for Gemma 3's image-text checkpoints, whose vision tower is not read).

Invariants
  * Tensors are the files' own, memory-mapped by the safetensors library; raw() hands back a view
    in the file's dtype (F32, F16 or BF16) and the forward casts one tensor at a time to the model
    dtype as it builds that tensor's layer (numerics.py): the model is never whole in a dtype wider
    than the file's, and never twice in memory.
  * The embedding stays in the file (parts.Embedding reads the rows it looks up) through a map
    of its own; release() drops every other map, so the pages a load has read stop counting in
    the process's memory once their layer holds its copy.
  * q and k rows are in transformers' order: the rotary halves pair dimension j with j + d/2
    (ModelConfig.rope_interleaved False), unlike llama.cpp's `llama` files.
  * Gemma 3's norm weights are w as transformers stores them (a GGUF holds 1 + w): the config's
    extra["norm_plus_one"] is False, and gemma3.py reads them as they are.
  * A checkpoint holds nothing the forward would leave unread: `unsupported()` names a tensor
    or setting hd's forward does not compute (an o_proj bias, MLP biases, soft-capping, another
    activation), and such a model runs on transformers' forward instead (engine/loader.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import HdError
from . import checks
from .gguf import ModelConfig
from . import family_of

# transformers' model_type -> the architecture name model/__init__.py's FAMILIES knows
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "gemma3": "gemma3", "gemma3_text": "gemma3"}

# a block's GGUF tensor (without "blk.{i}." and ".weight"/".bias") -> transformers' module in
# model.layers.{i}
BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gemma 3 norms around both halves of a block: its ffn_norm is the one before the MLP
GEMMA3_BLOCK = dict(BLOCK, ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm",
                    post_ffw_norm="post_feedforward_layernorm")
TOP = {"token_embd": "embed_tokens", "output_norm": "norm"}
ACTIVATIONS = {"llama": ("silu",), "qwen2": ("silu",), "qwen3": ("silu",), "gemma3": ("gelu_pytorch_tanh",)}
KEPT = ("token_embd.weight",)   # stays mapped while the model lives (parts.Embedding)


def model_type(folder: Path) -> str | None:
    """config.json's model_type (None where the folder has none)."""
    import json
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


class Checkpoint:
    """An open checkpoint folder: its config, tensors by GGUF name, the files they are in."""

    def __init__(self, folder: str | Path, name: str | None = None):
        from safetensors import safe_open
        from transformers import AutoConfig
        self.path = Path(folder)
        self.name = name or self.path.name
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise HdError(f"model folder {self.path} has no .safetensors weights")
        self.files: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    self.files.update(dict.fromkeys(h.keys(), f))
            except Exception as exc:   # safetensors raises its own kinds for a damaged file
                raise HdError(f"could not read {f}: {str(exc).splitlines()[0]}") from None
        try:
            self.hf = AutoConfig.from_pretrained(str(self.path))
        except (OSError, ValueError, KeyError) as exc:
            raise HdError(f"could not read {self.path / 'config.json'}: {str(exc).splitlines()[0]}") from None
        self.text = self.hf.get_text_config()
        self.model_type = self.hf.model_type
        self.arch = ARCHS.get(self.model_type, self.model_type)
        self.prefix = self._prefix()
        self.block = GEMMA3_BLOCK if self.arch == "gemma3" else BLOCK
        head = [k for k in self.files if k.endswith("lm_head.weight")]
        self.head = None if self._tied() or not head else head[0]
        self._handles: dict = {}

    def _prefix(self) -> str:
        """Where the decoder's tensors are: the name of the embedding, less `embed_tokens.weight`."""
        found = [k[:-len("embed_tokens.weight")] for k in self.files if k.endswith("embed_tokens.weight")]
        if len(found) != 1:
            raise HdError(f"{self.path}: {len(found)} token embeddings (embed_tokens.weight) in its "
                          "safetensors files; not a decoder checkpoint hd can read")
        return found[0]

    def _tied(self) -> bool:
        tied = getattr(self.hf, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(self.text, "tie_word_embeddings", False)
        return bool(tied)

    # ------------------------------------------------------------ what the forwards read

    def hf_name(self, name: str) -> str | None:
        """transformers' name of a GGUF tensor name (None: the checkpoint has no such tensor)."""
        base, kind = name.rsplit(".", 1)
        if base.startswith("blk."):
            _, i, part = base.split(".", 2)
            module = self.block.get(part)
            return None if module is None else f"{self.prefix}layers.{i}.{module}.{kind}"
        if base == "output":
            return self.head
        return f"{self.prefix}{TOP[base]}.{kind}" if base in TOP else None

    def has(self, name: str) -> bool:
        return self.hf_name(name) in self.files

    def raw(self, name: str) -> tuple[str, np.ndarray, tuple[int, ...]]:
        """(type name F32/F16/BF16, the values as a numpy view of the file's map, shape [N, K] or
        [N]) of a GGUF-named tensor. BF16 values come as their bits (uint16), as numpy has no bf16."""
        import torch
        key = self.hf_name(name)
        if key not in self.files:
            raise HdError(f"{self.path}: tensor {key or name} is missing; the checkpoint is incomplete "
                          "or of another architecture")
        t = self._handle(self.files[key], private=name in KEPT).get_tensor(key)
        types = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
        if t.dtype not in types:
            raise HdError(f"{self.path}: tensor {key} is {t.dtype}; hd reads fp32, fp16 and bf16 checkpoints")
        values = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        return types[t.dtype], values, tuple(t.shape)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A GGUF-named tensor's shape (torch order), from the file's header; None where absent."""
        key = self.hf_name(name)
        if key not in self.files:
            return None
        return tuple(self._handle(self.files[key]).get_slice(key).get_shape())

    def check(self) -> None:
        """config.json's numbers, and every tensor the forward reads against them (checks.py):
        before the forward is built, one line naming the field or tensor."""
        cfg = self.config()
        checks.check_config(cfg, str(self.path / "config.json"), lambda attr: attr)
        checks.check_tensors(self, cfg, family_of(self.arch), str(self.path), label=self.hf_name)
        self.release()   # the headers read: their maps go

    def _handle(self, file: Path, private: bool = False):
        """An open safetensors file (its map); `private`: one of its own, not dropped by release()."""
        from safetensors import safe_open
        if private:
            return safe_open(str(file), framework="pt")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def release(self) -> None:
        """Drop the maps of the tensors read so far (the layers hold their own copies): their
        pages stop counting in this process's memory. The next raw() maps the file again."""
        self._handles.clear()

    def type_counts(self) -> dict:
        from safetensors import safe_open
        out: dict = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as h:
                for key in h.keys():
                    if key.startswith(self.prefix) or key == self.head:
                        dtype = h.get_slice(key).get_dtype()
                        out[dtype] = out.get(dtype, 0) + 1
        return out

    # ------------------------------------------------------------ the configuration

    def unsupported(self) -> str | None:
        """Why hd's forward cannot compute this checkpoint as transformers does (None: it can)."""
        if self.arch not in ACTIVATIONS:
            return f"model_type {self.model_type}"
        t = self.text
        act = getattr(t, "hidden_activation", None) or getattr(t, "hidden_act", None)
        if act not in ACTIVATIONS[self.arch]:
            return f"the activation {act}"
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(t, cap, None):
                return f"{cap} {getattr(t, cap)}"
        rope = self._rope("full_attention")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return "a partial rotary embedding"
        layer = f"{self.prefix}layers.0."
        known = {f"{layer}{m}.weight" for m in self.block.values()} | {f"{layer}self_attn.{x}_proj.bias" for x in "qkv"}
        unread = sorted(k for k in self.files if k.startswith(layer) and k not in known
                        and not k.endswith("rotary_emb.inv_freq"))   # (a buffer older checkpoints saved)
        if unread:
            return f"tensors it does not read ({', '.join(unread[:3])})"
        return None

    def _rope(self, layer_type: str) -> dict:
        """transformers' rope parameters of a layer type ({"rope_type", "rope_theta", ...})."""
        params = getattr(self.text, "rope_parameters", None) or {}
        if layer_type in params:       # per layer type (Gemma 3)
            params = params[layer_type]
        elif "full_attention" in params:
            params = params["full_attention"]
        params = dict(params)
        params.setdefault("rope_theta", getattr(self.text, "rope_theta", None) or 10000.0)
        params.setdefault("rope_type", params.pop("type", "default"))
        return params

    def _layer_types(self) -> list[str] | None:
        """Each block's attention ("sliding_attention" or "full_attention") where any slides."""
        t, n = self.text, self.text.num_hidden_layers
        types = getattr(t, "layer_types", None)
        if types is None and self.model_type == "mistral" and getattr(t, "sliding_window", None):
            types = ["sliding_attention"] * n   # Mistral's window holds in every block
        if not types or "sliding_attention" not in types[:n]:
            return None
        return list(types[:n])

    def _eos(self):
        """generation_config.json's end-of-sequence ids (Llama 3 ends turns with another id than
        its tokenizer's EOS), else config.json's."""
        import json
        try:
            eos = json.loads((self.path / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        return eos if eos is not None else getattr(self.text, "eos_token_id", None)

    def config(self) -> ModelConfig:
        t = self.text
        heads = t.num_attention_heads
        full = self._rope("full_attention")
        scaling = None if full["rope_type"] == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
        types = self._layer_types()
        extra: dict = {"norm_plus_one": False}
        if types:
            extra["layer_types"] = types
        if self.arch == "gemma3":
            extra["query_pre_attn_scalar"] = t.query_pre_attn_scalar
            extra["rope_local_base_freq"] = float(self._rope("sliding_attention")["rope_theta"])
        if not heads or not isinstance(heads, int):   # checks.check_config says what it must be
            checks.positive_int(heads, str(self.path / "config.json"), "num_attention_heads")
        return ModelConfig(
            architecture=self.arch, vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, rms_norm_eps=float(t.rms_norm_eps),
            rope_theta=float(full["rope_theta"]), max_position_embeddings=int(t.max_position_embeddings),
            rope_scaling=scaling, rope_interleaved=False, tie_word_embeddings=self.head is None,
            sliding_window=getattr(t, "sliding_window", None) if types else None,
            bos_token_id=getattr(t, "bos_token_id", None), eos_token_id=self._eos(),
            pad_token_id=getattr(t, "pad_token_id", None), name=self.name, extra=extra)

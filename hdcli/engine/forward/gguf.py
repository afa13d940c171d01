"""A GGUF file as hd reads it: its metadata as a model configuration, its tensors in their own bits.

Why: the file is the model users have. Nothing here builds the model in a wider dtype: the
header is parsed here and the file mapped (one read-only numpy memmap), each tensor's bytes are handed to
the kernel that multiplies by them (engine/quants.py: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) or,
for a type without one, dequantized one tensor at a time. The embedding stays in the file:
only the rows a forward looks up are dequantized.

Names. Tensors are read by their GGUF names (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...),
the ones llama.cpp writes for every architecture hd owns a forward for (hdcli/engine/forward/).
Shapes: gguf-py gives a 2-D tensor's shape as [K, N] (ggml order) and its data as [N, bytes per
row]: rows are output features.

The tokenizer is transformers' (built from the file's vocabulary once, ~2-5 s, then kept as
tokenizer.json under the cache folder: no weights are ever written there).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...errors import HdError


@dataclass
class ModelConfig:
    """What a forward needs of a model, read from the file's metadata (names as in transformers'
    configs, so that the rest of hd reads it alike)."""
    architecture: str                 # GGUF general.architecture: llama, qwen2, qwen3, gemma3, ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None  # transformers' rope_parameters of a scaled rope, or None
    rope_interleaved: bool = True     # rotary pairs (2i, 2i+1) as llama.cpp's "normal" rope; else halves (NeoX)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    name: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def get_text_config(self):
        return self


# Architectures whose attention uses interleaved rotary pairs in the GGUF layout (llama.cpp's
# LLM_ARCH_* with rope type NORM); the others (qwen2, qwen3, gemma3) rotate halves.
INTERLEAVED_ROPE = {"llama", "mistral", "granite"}


# GGUF metadata value types (the format's enum) -> struct format of one item; 8 string, 9 array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_KEPT = 4096   # numeric arrays up to this many items are read (per-layer head counts); longer ones
                     # (the tokenizer's) and every string array are skipped: transformers reads those


class Tensor:
    """One tensor of the file: name, ggml type, shape in ggml order [K, N], its bytes (a view of
    the map, [N rows, bytes a row] for 2-D tensors)."""

    def __init__(self, name: str, type_id: int, shape: list[int], data: np.ndarray):
        import gguf
        self.name, self.shape, self.data = name, shape, data
        self.tensor_type = gguf.GGMLQuantizationType(type_id)


class GGUFFile:
    """An open GGUF file: its metadata, tensors by name, the configuration.

    The header is parsed here (gguf-py's GGUFReader builds a numpy view of every item of every
    array: ~25 s for a Llama 3 vocabulary of 128k tokens on a 2-core EPYC, most of an 8B model's
    later start); the tensors are views of one read-only map of the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._parse()
        except HdError:
            raise
        except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as exc:
            raise HdError(f"could not read GGUF {self.path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                          " (the file is truncated or not a GGUF); download it again") from None
        self.arch = str(self.field("general.architecture", "llama"))

    def _parse(self) -> None:
        import gguf
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise HdError(f"{self.path} is not a GGUF file (bad magic bytes); pass a .gguf model file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise HdError(f"{self.path}: GGUF version {version} is too old; convert it again with llama.cpp")

            def read(fmt):
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            def string() -> str:
                return f.read(read("<Q")).decode("utf-8")

            def value(kind: int):
                if kind in _SCALAR:
                    return read(_SCALAR[kind])
                if kind == 8:
                    return string()
                if kind != 9:
                    raise ValueError(f"unknown metadata type {kind}")
                item, count = read("<I"), read("<Q")
                if item == 8:
                    for _ in range(count):
                        f.seek(read("<Q"), 1)
                    return None
                size = struct.calcsize(_SCALAR[item])
                if count > _ARRAY_KEPT:
                    f.seek(size * count, 1)
                    return None
                return list(struct.unpack(f"<{count}{_SCALAR[item][1]}", f.read(size * count)))
            self.fields = {}
            for _ in range(n_kv):
                key = string()
                self.fields[key] = value(read("<I"))
            infos = []
            for _ in range(n_tensors):
                name = string()
                dims = [read("<Q") for _ in range(read("<I"))]
                infos.append((name, dims, read("<I"), read("<Q")))
            align = int(self.fields.get("general.alignment") or 32)
            start = -(-f.tell() // align) * align
        spans = []
        for name, dims, type_id, offset in infos:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            spans.append((rows, dims[0] // block * nbytes, start + offset))
        size = self.path.stat().st_size
        need = max((a + rows * row_bytes for rows, row_bytes, a in spans), default=start)
        if need > size:   # checked before any tensor is read: an interrupted download or copy
            raise HdError(f"{self.path} is truncated ({size} bytes, its tensors need {need}): download it again")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = {}
        for (name, dims, type_id, _), (rows, row_bytes, a) in zip(infos, spans):
            data = self._map[a:a + rows * row_bytes]
            self.tensors[name] = Tensor(name, type_id, dims, data.reshape(rows, row_bytes) if len(dims) > 1 else data)

    def release(self) -> None:
        """Let the kernel drop the file's pages this process has read (they stay in the page
        cache): a load reads every tensor once to repack it, and the mapped pages would count in
        the process's resident memory beside the repacked copy, doubling it."""
        import mmap
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def field(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise HdError(f"{self.path}: tensor {name} is missing; the file is incomplete or of another architecture")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors

    def type_counts(self) -> dict:
        out: dict = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    def config(self) -> ModelConfig:
        a = self.arch_field
        need = {"block_count": a("block_count"), "embedding_length": a("embedding_length"),
                "attention.head_count": a("attention.head_count")}
        missing = [k for k, v in need.items() if v is None]
        if missing:
            raise HdError(f"{self.path}: metadata {', '.join(f'{self.arch}.{k}' for k in missing)} missing; "
                          "not a model file hd can run")
        hidden, heads = int(need["embedding_length"]), int(need["attention.head_count"])
        kv = a("attention.head_count_kv", heads)
        kv = int(kv[0] if isinstance(kv, list) else kv)
        head_dim = int(a("attention.key_length", 0) or a("rope.dimension_count", 0) or hidden // heads)
        emb = self.tensor("token_embd.weight")
        vocab = int(a("vocab_size", 0) or emb.shape[1])
        ff = a("feed_forward_length", 4 * hidden)
        ff = int(ff[0] if isinstance(ff, list) else ff)
        scaling = None
        kind = a("rope.scaling.type")
        if self.arch == "llama" and self.has("rope_freqs.weight"):
            # llama 3.1+: llama.cpp stores the scaled frequencies' factors; transformers' config
            # names the same parameters (the published ones of the llama3 rope)
            scaling = {"rope_type": "llama3", "factor": float(a("rope.scaling.factor", 8.0) or 8.0),
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": int(a("rope.scaling.original_context_length", 8192) or 8192)}
        elif kind in ("linear", "yarn"):
            scaling = {"rope_type": kind, "factor": float(a("rope.scaling.factor", 1.0))}
            if kind == "yarn":
                scaling["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length", 4096))
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=self.arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=ff,
            num_hidden_layers=int(need["block_count"]), num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=head_dim, rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            max_position_embeddings=int(a("context_length", 4096)), rope_scaling=scaling,
            rope_interleaved=self.arch in INTERLEAVED_ROPE,
            tie_word_embeddings=not self.has("output.weight"),
            sliding_window=a("attention.sliding_window"),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"), eos_token_id=eos,
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
            name=str(self.field("general.name", self.path.stem)))

    def raw(self, name: str) -> tuple[str, np.ndarray, tuple[int, ...]]:
        """(type name, bytes or values as the file holds them, shape in torch order [N, K] or [N])."""
        t = self.tensor(name)
        shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
        return t.tensor_type.name, t.data, shape

    def key(self) -> str:
        """What identifies this file's content for caches: path, size, modification time."""
        st = self.path.stat()
        return hashlib.sha256(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def tokenizer(gf: GGUFFile, cache_dir: Path):
    """transformers' tokenizer of the file, built once and kept as tokenizer files (no weights)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    folder = cache_dir / "tokenizers" / f"{gf.path.stem}-{gf.key()}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception:  # noqa: BLE001 - a damaged copy (transformers raises many kinds): built again below
            import shutil
            import sys
            print(f"warning: {folder}: the cached tokenizer is malformed; rebuilding it", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)
    except Exception as exc:  # transformers raises many kinds for a file it cannot read
        raise HdError(f"could not read the tokenizer of GGUF {gf.path}: {str(exc).splitlines()[0]}") from None
    import shutil
    import tempfile
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        tok.save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(folder)
    except OSError:
        pass   # a cache that cannot be written: the tokenizer is built again next time
    return tok

"""A GGUF file as hd reads it: its metadata as a model configuration, its tensors in their own bits.

Why: the file is the model users have. Nothing here builds the model in a wider dtype: the
header is parsed here and the file mapped (one read-only numpy memmap), each tensor's bytes are handed to
the kernel that multiplies by them (engine/kernels/quants.py: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) or,
for a type without one, dequantized one tensor at a time. The embedding stays in the file:
only the rows a forward looks up are dequantized.

Names. Tensors are read by their GGUF names (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...),
the ones llama.cpp writes for every architecture hd owns a forward for (hdcli/engine/model/).
Shapes: gguf-py gives a 2-D tensor's shape as [K, N] (ggml order) and its data as [N, bytes per
row]: rows are output features.

The tokenizer is transformers' (built from the file's vocabulary once, in seconds, then kept as
tokenizer.json under the cache folder: no weights are ever written there).
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...errors import HdError
from . import checks
from ..kernels import quants
from . import family_of


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
    # Granite's multipliers (transformers' GraniteConfig names; llama.cpp's granite.*_scale):
    # the embedding times embedding_multiplier, each sublayer's output times residual_multiplier
    # before its residual add, attention scores times attention_multiplier (None: head_dim ** -0.5),
    # logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
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
STRINGS_READ = 1 << 20    # bytes read at a time to walk a string array (a 128k vocabulary's ~2 MB)
_ARRAY_KEPT = 4096   # numeric arrays up to this many items are read (per-block head counts); longer ones
                     # (the tokenizer's) and every string array are skipped: transformers reads those


def readable_types() -> set[str]:
    """The tensor types hd's forward reads as weights: its own kernels', the float ones, and every
    type gguf-py dequantizes."""
    import gguf
    return set(quants.TYPES) | {"F32", "F16", "BF16"} | {t.name for t in gguf.quants._type_traits}


# ggml's type ids of the types hd reads itself (quants.TYPES and the floats), as gguf-py's
# GGMLQuantizationType numbers them (tests/test_owned.py compares them); their blocks are quants.BLOCK's.
# Other ids are asked of gguf-py, whose import a later start of a usual file spares.
TYPE_IDS = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
            12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def type_of(type_id: int) -> tuple[str, int, int]:
    """(name, weights a block, bytes a block) of a ggml type id; ValueError for an id gguf-py does
    not know."""
    name = TYPE_IDS.get(type_id)
    if name is not None:
        return (name, *quants.BLOCK[name]) if name in quants.BLOCK else (name, 1, FLOAT_BYTES[name])
    import gguf
    qtype = gguf.GGMLQuantizationType(type_id)
    return (qtype.name, *gguf.GGML_QUANT_SIZES[qtype])


class Tensor:
    """One tensor of the file: name, ggml type (its id and name), shape in ggml order [K, N], its
    bytes (a view of the map, [N rows, bytes a row] for 2-D tensors)."""

    def __init__(self, name: str, type_id: int, shape: list[int], data: np.ndarray):
        self.name, self.shape, self.data = name, shape, data
        self.type_id, self.type_name = type_id, type_of(type_id)[0]

    @property
    def tensor_type(self):
        """gguf-py's enum of the type (as GGUFReader's tensors have it)."""
        import gguf
        return gguf.GGMLQuantizationType(self.type_id)


def _skip_strings(f, size: int, count: int, where: str) -> None:
    """Past an array of count strings at f's position (a vocabulary: 128k-256k of them), walked over
    the file's bytes read STRINGS_READ at a time (read string by string, it was most of a later
    start's opening). where: the file and array, for the error."""
    start = f.tell()
    buf, at, length = b"", 0, struct.Struct("<Q").unpack_from
    for _ in range(count):
        if at + 8 > len(buf):    # the next length is past what was read: read on
            if start + len(buf) >= size:
                break
            if at > len(buf):    # the last string ends past what was read
                f.seek(start + at)
            buf = buf[at:] + f.read(STRINGS_READ + 8)
            start, at = start + at, 0
            if at + 8 > len(buf):
                break
        at += 8 + length(buf, at)[0]
    else:
        if start + at <= size:
            f.seek(start + at)
            return
    raise HdError(f"{where} run past the end of the file ({size} bytes); the file is truncated or damaged")


class GGUFFile:
    """An open GGUF file: its metadata, tensors by name, the configuration.

    The header is parsed here (gguf-py's GGUFReader builds a numpy view of every item of every
    array: for a Llama 3 vocabulary of 128k tokens, most of an 8B model's later start); the tensors are views of one read-only map of the file."""

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
        self._config = None
        self.layouts = None   # while a model is built: its layout cache (model/layouts.py), set by the loader
        self._check()

    def _parse(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise HdError(f"{self.path} is not a GGUF file (bad magic bytes); pass a .gguf model file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise HdError(f"{self.path}: GGUF version {version} is too old; convert it again with llama.cpp")

            def read(fmt):
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            def fits(count: int, item_bytes: int, what: str) -> int:
                """count items of at least item_bytes each must fit in the rest of the file: checked
                before anything is read or allocated for them (a count of 2**63 is one header word)."""
                if count * item_bytes > size - f.tell():
                    raise HdError(f"{self.path}: the header says {count} {what}, more than the file's {size} bytes "
                                  "can hold; the file is damaged or not a GGUF")
                return count

            def string() -> str:
                return f.read(fits(read("<Q"), 1, "bytes in a string")).decode("utf-8")

            def value(key: str, kind: int):
                if kind in _SCALAR:
                    return read(_SCALAR[kind])
                if kind == 8:
                    return string()
                if kind != 9:
                    raise ValueError(f"unknown metadata type {kind} of {key}")
                item, count = read("<I"), read("<Q")
                if item not in _SCALAR and item != 8:
                    raise ValueError(f"unknown array item type {item} of {key}")
                size_of = 8 if item == 8 else struct.calcsize(_SCALAR[item])
                self.array_lengths[key] = fits(count, size_of, f"items in {key}")
                if item == 8:
                    _skip_strings(f, size, count, f"{self.path}: the strings of {key}")
                    return None
                if count > _ARRAY_KEPT:
                    f.seek(size_of * count, 1)
                    return None
                return list(struct.unpack(f"<{count}{_SCALAR[item][1]}", f.read(size_of * count)))
            self.fields, self.array_lengths = {}, {}
            for _ in range(fits(n_kv, 12, "metadata fields")):       # key length, a key, a type
                key = string()
                self.fields[key] = value(key, read("<I"))
            infos = []
            for _ in range(fits(n_tensors, 24, "tensors")):          # name length, name, dims, type, offset
                name = string()
                dims = [read("<Q") for _ in range(fits(read("<I"), 8, f"dimensions of tensor {name}"))]
                infos.append((name, dims, read("<I"), read("<Q")))
            align = self.fields.get("general.alignment") or 32
            if not isinstance(align, int) or align <= 0 or align & (align - 1):
                raise HdError(f"{self.path}: general.alignment is {align!r}; expected a power of two (32 by default)")
            start = -(-f.tell() // align) * align
        spans = self._spans(infos, start, align)
        need = max((a + nbytes for _, a, nbytes in spans), default=start)
        if need > size:   # checked before any tensor is read: an interrupted download or copy
            raise HdError(f"{self.path} is truncated ({size} bytes, its tensors need {need}): download it again")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = {}
        for (name, dims, type_id, _), (rows, a, nbytes) in zip(infos, spans):
            data = self._map[a:a + nbytes]
            self.tensors[name] = Tensor(name, type_id, dims, data.reshape(rows, nbytes // rows) if len(dims) > 1 else data)

    def _spans(self, infos, start: int, align: int) -> list[tuple[int, int, int]]:
        """(rows, first byte, bytes) of each tensor, after checking what gguf-py and the kernels take
        for granted: a known type, 1 to 4 dimensions none of them 0, a row length its type's block
        divides, an aligned offset, one name per tensor, no two tensors sharing bytes."""
        spans, names = [], set()
        for name, dims, type_id, offset in infos:
            where = f"{self.path}: tensor {name}"
            if name in names:
                raise HdError(f"{where} appears twice; the file is damaged")
            names.add(name)
            try:
                type_name, block, block_bytes = type_of(type_id)
            except ValueError:
                raise HdError(f"{where} has type id {type_id}, which hd's GGUF reader (gguf-py) does not know; "
                              "the file is damaged or newer than hd") from None
            if not 1 <= len(dims) <= 4 or 0 in dims:
                raise HdError(f"{where} has shape {dims}; expected 1 to 4 dimensions, none of them 0")
            if dims[0] % block:
                raise HdError(f"{where}: its row length {dims[0]} is not a multiple of {type_name}'s block of "
                              f"{block} values; the file is damaged")
            if offset % align:
                raise HdError(f"{where}: its data offset {offset} is not a multiple of the alignment {align}")
            rows = math.prod(dims[1:])
            spans.append((rows, start + offset, rows * (dims[0] // block) * block_bytes))
        order = sorted(range(len(spans)), key=lambda i: spans[i][1])
        for i, j in zip(order, order[1:]):
            if spans[i][1] + spans[i][2] > spans[j][1]:
                raise HdError(f"{self.path}: tensors {infos[i][0]} and {infos[j][0]} overlap (their data share "
                              "bytes); the file is damaged")
        return spans

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
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out

    def config(self) -> ModelConfig:
        if self._config is None:
            self._config = self._read_config()
        return self._config

    def _int(self, key: str, default=None) -> int | None:
        """A count or length of the architecture's metadata (`{arch}.{key}`), checked; one value
        where the file gives one per block (hd's forwards have no per-block head counts)."""
        value = self.arch_field(key, default)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise HdError(f"{self.path}: {self.arch}.{key} differs between blocks ({value[:8]}); "
                              "hd's forward needs one value for every block")
            value = value[0]
        return None if value is None else checks.positive_int(value, str(self.path), f"{self.arch}.{key}")

    def _float(self, key: str, default: float) -> float:
        return checks.positive_float(self.arch_field(key, default), str(self.path), f"{self.arch}.{key}")

    def _read_config(self) -> ModelConfig:
        need = ("block_count", "embedding_length", "attention.head_count")
        missing = [k for k in need if self.arch_field(k) is None]
        if missing:
            raise HdError(f"{self.path}: metadata {', '.join(f'{self.arch}.{k}' for k in missing)} missing; "
                          "not a model file hd can run")
        hidden, heads = self._int("embedding_length"), self._int("attention.head_count")
        kv = self._int("attention.head_count_kv", heads)
        key_length = self._int("attention.key_length") or self._int("rope.dimension_count")
        if key_length is None and hidden % heads:
            raise HdError(f"{self.path}: {self.arch}.embedding_length {hidden} is not a multiple of "
                          f"{self.arch}.attention.head_count {heads} and no {self.arch}.attention.key_length "
                          "gives the head size")
        head_dim = key_length or hidden // heads
        value_length = self._int("attention.value_length")
        if value_length is not None and value_length != head_dim:
            raise HdError(f"{self.path}: {self.arch}.attention.value_length {value_length} differs from the key "
                          f"length {head_dim}; hd's forward needs them equal")
        emb = self.tensor("token_embd.weight")
        vocab = self._int("vocab_size") or int(emb.shape[-1])
        scaling = None
        kind = self.arch_field("rope.scaling.type")
        if self.arch == "llama" and self.has("rope_freqs.weight"):
            # llama 3.1+: llama.cpp stores the scaled frequencies' factors; transformers' config
            # names the same parameters (the published ones of the llama3 rope)
            scaling = {"rope_type": "llama3", "factor": self._float("rope.scaling.factor", 8.0),
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": self._int("rope.scaling.original_context_length", 8192)}
        elif kind in ("linear", "yarn"):
            scaling = {"rope_type": kind, "factor": self._float("rope.scaling.factor", 1.0)}
            if kind == "yarn":
                scaling["original_max_position_embeddings"] = self._int("rope.scaling.original_context_length", 4096)
        granite = {}
        if self.arch == "granite":   # llama.cpp reads these for granite only
            granite = {"embedding_multiplier": self._float("embedding_scale", 1.0),
                       "residual_multiplier": self._float("residual_scale", 1.0),
                       "attention_multiplier": self._float("attention.scale", head_dim ** -0.5),
                       "logits_scaling": self._float("logit_scale", 1.0)}
        return ModelConfig(
            **granite,
            architecture=self.arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=self._int("feed_forward_length", 4 * hidden),
            num_hidden_layers=self._int("block_count"), num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=head_dim, rms_norm_eps=self._float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self._float("rope.freq_base", 10000.0),
            max_position_embeddings=self._int("context_length", 4096), rope_scaling=scaling,
            rope_interleaved=self.arch in INTERLEAVED_ROPE,
            tie_word_embeddings=not self.has("output.weight"),
            sliding_window=None if self.arch_field("attention.sliding_window") == 0 else self._int("attention.sliding_window"),   # 0: none (llama.cpp's converter writes it so)
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
            name=str(self.field("general.name", self.path.stem)))

    def unsupported(self) -> str | None:
        """Why hd's forward cannot compute this file of an architecture it owns as llama.cpp does
        (None: it can): Phi-3's long-context rope (rope_factors_long/short: Phi-3-128k, Phi-3.5,
        Phi-4-mini) and a rotary embedding over part of each head (Phi-4-mini's 0.75)."""
        if self.has("rope_factors_long.weight") or self.has("rope_factors_short.weight"):
            return "a long-context rope with per-frequency factors (rope_factors_long/short)"
        if self.arch == "olmo2" and self.arch_field("attention.sliding_window"):
            return "OLMo 3's sliding-window blocks (an olmo2 file with attention.sliding_window)"
        dims, hidden = self.arch_field("rope.dimension_count"), self.arch_field("embedding_length")
        heads, key = self.arch_field("attention.head_count"), self.arch_field("attention.key_length")
        if isinstance(heads, list):
            heads = heads[0] if heads else None
        if (isinstance(dims, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0
                and dims != (key if isinstance(key, int) else hidden // heads)):
            return f"a rotary embedding over {dims} of each head's {key or hidden // heads} dimensions"
        return None

    def _check(self) -> None:
        """What any forward (hd's or transformers') takes for granted: every tokenizer id has an
        embedding row; and for an architecture hd owns a forward for, the configuration's numbers
        and every tensor's shape and type (checks.py)."""
        emb = self.tensors.get("token_embd.weight")
        if emb is not None:
            checks.check_token_ids(str(self.path), int(emb.shape[-1]), self.array_lengths.get("tokenizer.ggml.tokens"),
                                   {f"tokenizer.ggml.{k}_token_id": self.fields.get(f"tokenizer.ggml.{k}_token_id")
                                    for k in ("bos", "eos")})
        family = family_of(self.arch)
        if family is None or self.unsupported():   # transformers' forward runs it (loader._owned_source)
            return
        cfg = self.config()
        names = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "num_hidden_layers": "block_count",
                 "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
                 "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
                 "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
                 "max_position_embeddings": "context_length", "sliding_window": "attention.sliding_window",
                 "rope_scaling": "rope.scaling.factor"}
        checks.check_config(cfg, str(self.path), lambda attr: f"{self.arch}.{names.get(attr, attr)}")
        types = {t.type_name for t in self.tensors.values()}
        own = set(quants.TYPES) | set(quants.FLOATS)   # readable without asking gguf-py (its import)
        checks.check_tensors(self, cfg, family, str(self.path), readable=own if types <= own else readable_types())
        if cfg.vocab_size != int(emb.shape[-1]):
            raise HdError(f"{self.path}: {self.arch}.vocab_size is {cfg.vocab_size} but token_embd.weight has "
                          f"{emb.shape[-1]} rows; the file is damaged")

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape in torch order ([N, K] or [N]), None where the file has none."""
        t = self.tensors.get(name)
        return None if t is None else tuple(int(x) for x in reversed(t.shape))

    def qtype(self, name: str) -> str:
        return self.tensors[name].type_name

    def raw(self, name: str) -> tuple[str, np.ndarray, tuple[int, ...]]:
        """(type name, bytes or values as the file holds them, shape in torch order [N, K] or [N])."""
        t = self.tensor(name)
        shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
        return t.type_name, t.data, shape

    def key(self) -> str:
        """What identifies this file's content for caches: path, size, modification time."""
        st = self.path.stat()
        return hashlib.sha256(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _saved_tokenizer(folder: Path):
    """A tokenizer saved by `tokenizer` below: its class read from its config and loaded directly
    where it is transformers' plain tokenizers one (what a GGUF's llama/qwen vocabularies give),
    else through AutoTokenizer. The same object either way; the direct class spares importing
    transformers' auto classes (a noticeable part of a later start)."""
    import json
    try:
        kind = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


# transformers' model_type of the GGUF architectures hd owns, as its GGUF config reader names them
# (modeling_gguf_pytorch_utils: a llama file named "mistral" is mistral, gemma3 is gemma3_text)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "phi3": "phi3", "olmo2": "olmo2", "granite": "granite"}


def built_tokenizer(gf: GGUFFile):
    """transformers' tokenizer of the file, the class AutoTokenizer picks for its model_type.

    Why not AutoTokenizer itself: for these architectures it first builds the file's whole model
    config with gguf-py's reader, only to learn the model_type (most of a first start of a Llama 3
    file, for its 128k vocabulary); the tokenizer itself reads the file much faster.
    tests/test_architectures.py checks both give the same tokenizer on every such file (olmo2,
    whose GGUF config transformers does not read, against the model's own tokenizer)."""
    from transformers import AutoTokenizer
    model_type = MODEL_TYPES.get(gf.arch)
    if gf.arch == "llama" and gf.field("general.name") == "mistral":
        model_type = "mistral"
    if model_type is None:
        return AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return cls.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)


def tokenizer(gf: GGUFFile, cache_dir: Path):
    """transformers' tokenizer of the file, built once and kept as tokenizer files (no weights)."""
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    folder = cache_dir / "tokenizers" / f"{gf.path.stem}-{gf.key()}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            return _saved_tokenizer(folder)
        except Exception:  # noqa: BLE001 - a damaged copy (transformers raises many kinds): built again below
            import shutil
            import sys
            print(f"warning: {folder}: the cached tokenizer is malformed; rebuilding it", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    try:
        tok = built_tokenizer(gf)
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

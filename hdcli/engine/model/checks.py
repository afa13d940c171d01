"""What hd's forwards expect of a model file, checked once when it is opened: the configuration's
numbers and every tensor's shape and type, before any kernel or allocation sees them.

Why: the forwards take the file at its word. A head count of 0 divides by zero in a compiled
kernel (SIGFPE), a key length of 2**62 allocates a rope table of 2**61 rows, a q projection
whose rows are not heads * head_dim fails deep in a reshape, an embedding with fewer rows than
the tokenizer has ids raises IndexError in the middle of a request. Each becomes one line here
naming the file, the field or tensor and what was expected.

A source (gguf.GGUFFile, checkpoint.Checkpoint) answers `shape(name)` (torch order [N, K] or
[N], None where it has no such tensor) and `qtype(name)` in GGUF tensor names; `field(attr)`
below is the source's own name of a ModelConfig attribute (`llama.attention.head_count_kv`,
`num_key_value_heads`), so the line names what the user can find in the file.
"""
from __future__ import annotations

import math

from ...errors import HdError

MAX_INT = 2**31 - 1   # every count and length of a model hd can run is far below it


def positive_int(value, where: str, field: str) -> int:
    """value as a count or length of a model: an integer 1 .. 2**31 - 1."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise HdError(f"{where}: {field} is {value!r}; expected a positive integer below 2**31")
    return value


def positive_float(value, where: str, field: str) -> float:
    """value as a rope base, epsilon or factor: a finite number above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HdError(f"{where}: {field} is {value!r}; expected a finite number above 0")
    return float(value)


def check_config(cfg, where: str, field) -> None:
    """The numbers of a ModelConfig hd's forward divides and allocates by. field(attr): the
    source's name of a ModelConfig attribute."""
    for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        positive_int(getattr(cfg, attr), where, field(attr))
    positive_float(cfg.rms_norm_eps, where, field("rms_norm_eps"))
    positive_float(cfg.rope_theta, where, field("rope_theta"))
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise HdError(f"{where}: {field('num_attention_heads')} {cfg.num_attention_heads} is not a multiple of "
                      f"{field('num_key_value_heads')} {cfg.num_key_value_heads}; each key/value head must serve "
                      "a whole group of query heads")
    if cfg.head_dim % 2:
        raise HdError(f"{where}: {field('head_dim')} {cfg.head_dim} is odd; the rotary embedding rotates pairs")
    if cfg.sliding_window is not None:
        positive_int(cfg.sliding_window, where, field("sliding_window"))
    factor = (cfg.rope_scaling or {}).get("factor")
    if factor is not None:
        positive_float(factor, where, field("rope_scaling"))


def expected_shapes(src, cfg, family: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (shape in torch order, required) of every tensor the forward reads."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    emb = src.shape("token_embd.weight")
    vocab = emb[0] if emb else cfg.vocab_size
    out = {"token_embd.weight": ((vocab, h), True), "output_norm.weight": ((h,), True),
           "output.weight": ((vocab, h), False)}
    for i in range(cfg.num_hidden_layers):
        p = f"blk.{i}."
        gate = src.shape(p + "ffn_gate.weight")
        ff = gate[0] if gate and len(gate) == 2 else cfg.intermediate_size
        if src.arch == "phi3":   # q, k, v in one tensor; ffn_up holds gate and up, in that order
            out.update({p + "attn_qkv.weight": ((q + 2 * kv, h), True), p + "ffn_up.weight": ((2 * ff, h), True)})
        else:
            out.update({p + "attn_q.weight": ((q, h), True), p + "attn_k.weight": ((kv, h), True),
                        p + "attn_v.weight": ((kv, h), True), p + "ffn_gate.weight": ((ff, h), True),
                        p + "ffn_up.weight": ((ff, h), True)})
        olmo2 = src.arch == "olmo2"   # norms after the sublayers, q and k normed over their whole width
        out.update({p + "attn_norm.weight": ((h,), not olmo2), p + "ffn_norm.weight": ((h,), not olmo2),
                    p + "attn_output.weight": ((h, q), True),
                    p + "ffn_down.weight": ((h, ff), True),
                    p + "attn_q.bias": ((q,), False), p + "attn_k.bias": ((kv,), False), p + "attn_v.bias": ((kv,), False),
                    p + "attn_q_norm.weight": ((q if olmo2 else d,), family == "gemma3" or olmo2),
                    p + "attn_k_norm.weight": ((kv if olmo2 else d,), family == "gemma3" or olmo2)})
        if family == "gemma3" or olmo2:
            out.update({p + "post_attention_norm.weight": ((h,), True), p + "post_ffw_norm.weight": ((h,), True)})
    return out


def check_tensors(src, cfg, family: str, where: str, readable=None, label=None) -> None:
    """Every tensor the forward reads is there, of the shape the configuration implies (and of a
    type in `readable`, where given). label(GGUF name): the source's own name of a tensor."""
    for gguf_name, (want, required) in expected_shapes(src, cfg, family).items():
        got = src.shape(gguf_name)
        name = label(gguf_name) or gguf_name if label else gguf_name
        if got is None:
            if required:
                raise HdError(f"{where}: tensor {name} is missing; the file is incomplete or of another architecture")
            continue
        if tuple(got) != want:
            raise HdError(f"{where}: tensor {name} has shape {list(got)}; the configuration implies {list(want)} "
                          f"(hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads of {cfg.head_dim}, "
                          f"{cfg.num_key_value_heads} key/value heads)")
        if readable is not None and src.qtype(gguf_name) not in readable:
            raise HdError(f"{where}: tensor {name} is of type {src.qtype(gguf_name)}, which hd cannot read as a weight "
                          f"(types: {', '.join(sorted(readable))})")


def check_token_ids(where: str, rows: int, tokens: int | None, ids: dict[str, object]) -> None:
    """The tokenizer's ids all have an embedding row: its id count and the special ids it names."""
    if tokens is not None and tokens > rows:
        raise HdError(f"{where}: the tokenizer has {tokens} ids but the embedding has {rows} rows; ids "
                      f"{rows}..{tokens - 1} would have no embedding: the file is damaged")
    limit = min(rows, tokens) if tokens is not None else rows
    for field, value in ids.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < limit):
                raise HdError(f"{where}: {field} is {v!r}; expected an id of the vocabulary (0..{limit - 1})")

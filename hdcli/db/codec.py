"""A store's records as bytes: n-gram keys, values (a total and its ranked continuations), the
keys of answers kept whole, and each record's share of the content digest. The layout and its
invariants: hdcli/db/stores.py."""
from __future__ import annotations

import hashlib

import numpy as np

PAD = 0xFFFFFFFF
DIGEST_MOD = 1 << 128
SEQ_PREFIX = b"__hd_seq__"      # + 8-byte index: 18 bytes, never a multiple of 4
SCOPED_SEQ_PREFIX = b"__hd_sqs__"   # + 8-byte scope tag + 8-byte index: 26 bytes, never a multiple of 4
SCOPE_TAG_BYTES = 8
MAX_DRAFT_LEN = 1 << 16   # a record's entries are draft_len + 2 words each
MAX_KEY_TOKENS = 63       # record_hash prefixes a key with its byte length in one byte (4 * 63 = 252)


def sequence_key(index: int, scope: bytes | None = None) -> bytes:
    if scope is None:
        return SEQ_PREFIX + int(index).to_bytes(8, "big")
    if len(scope) != SCOPE_TAG_BYTES:
        raise ValueError(f"a scope tag is {SCOPE_TAG_BYTES} bytes")
    return SCOPED_SEQ_PREFIX + scope + int(index).to_bytes(8, "big")


def is_sequence_key(key) -> bool:
    """An answer kept whole, shared or a tenant's (not an n-gram record)."""
    head = bytes(key[:len(SEQ_PREFIX)])
    return ((len(key) == len(SEQ_PREFIX) + 8 and head == SEQ_PREFIX)
            or (len(key) == len(SCOPED_SEQ_PREFIX) + SCOPE_TAG_BYTES + 8 and head == SCOPED_SEQ_PREFIX))


def record_hash(key, value) -> int:
    """One record's share of the content digest (the key length first: keys have 1..max_n tokens)."""
    key = bytes(key)
    return int.from_bytes(hashlib.blake2b(bytes([len(key)]) + key + bytes(value), digest_size=16).digest(),
                          "little")


def digest_hex(total: int) -> str:
    return f"{total % DIGEST_MOD:032x}"


def encode_key(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


class MalformedRecord(ValueError):
    """A stored value of a shape no build writes (Store.get/items: `damaged`, naming `hd db verify`)."""


def decode_value(buf, draft_len: int) -> tuple[int, list[tuple[list[int], int]]]:
    """(total, [(continuation tokens, count), ...]) from a stored value; MalformedRecord where its
    length is not 4 bytes times 1 + k * (draft_len + 2), or an entry claims more than draft_len
    tokens (it would read the next entry's words as tokens)."""
    width = draft_len + 2
    if len(buf) % 4 or not len(buf) or (len(buf) // 4 - 1) % width:
        raise MalformedRecord(f"a record of {len(buf)} bytes is malformed")
    arr = np.frombuffer(buf, dtype="<u4")
    out = []
    for j in range(1, len(arr), width):
        count, length = int(arr[j]), int(arr[j + 1])
        if length > draft_len:
            raise MalformedRecord(f"an entry of {length} tokens exceeds the header's draft_len {draft_len}")
        out.append((arr[j + 2:j + 2 + length].tolist(), count))
    return int(arr[0]), out


def encode_value(total: int, entries: list[tuple[list[int], int]], draft_len: int) -> bytes:
    rows = np.full((len(entries), draft_len + 2), PAD, dtype="<u4")
    for r, (cont, count) in enumerate(entries):
        rows[r, 0], rows[r, 1] = count, len(cont)
        rows[r, 2:2 + len(cont)] = cont
    return np.concatenate([np.array([total], dtype="<u4"), rows.ravel()]).tobytes()

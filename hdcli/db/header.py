"""A store's header record: its key, reading and writing it, and the schema of every field a reader
uses, checked once where the header is read (Store)."""
from __future__ import annotations

import json

from ..errors import HdError
from .codec import MAX_DRAFT_LEN, MAX_KEY_TOKENS, PAD

FORMAT_VERSION = 1
HEADER_KEY = b"__hd_header__"   # 13 bytes: never a multiple of 4


class HeaderError(HdError):
    """A DB header readers cannot use (header_problem): Store refuses the file in one line (exit 2),
    `hd db verify` reports it DAMAGED (verify_file)."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: its header {problem}: the DB is damaged or was not written by hd; "
                         "rebuild it or restore a good copy")
        self.problem = problem


def _is_int(v, low: int = 0, high: int | None = None) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)   # JSON true is no count
            and v >= low and (high is None or v <= high))


# Every header field a reader uses: (required, test, what is expected). Checked once, where the
# header is read (Store), so that no reader meets a field of another type or range.
HEADER_FIELDS = {
    "draft_len": (True, lambda v: _is_int(v, 1, MAX_DRAFT_LEN), f"an integer 1..{MAX_DRAFT_LEN}"),
    "n_range": (True, lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x, 1) for x in v)
                and v[0] <= v[1] <= MAX_KEY_TOKENS,
                f"[min_n, max_n] with 1 <= min_n <= max_n <= {MAX_KEY_TOKENS}"),
    "kind": (False, lambda v: v in ("stats", "model"), '"stats" or "model"'),
    "model": (False, lambda v: isinstance(v, str), "a model name (a string)"),
    "tokenizer_fingerprint": (False, lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "vocab_size": (False, lambda v: _is_int(v, 1, PAD), f"an integer 1..{PAD}"),
    "top_k": (False, _is_int, "an integer >= 0"),
    "min_count": (False, lambda v: _is_int(v, 1), "an integer >= 1"),
    "pruned": (False, lambda v: isinstance(v, bool), "true or false"),
    "shard": (False, lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_int, v)) and v[0] < v[1],
              "[i, n] with 0 <= i < n"),
    "content_digest": (False, lambda v: isinstance(v, str) and len(v) == 32
                       and all(c in "0123456789abcdef" for c in v), "32 hexadecimal digits"),
    "sources": (False, lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
                "a list of objects"),
    **{f: (False, _is_int, "an integer >= 0") for f in ("keys", "sequences", "scoped_sequences", "documents",
                                                        "tokens", "continuations", "learned_tokens",
                                                        "learned_updates")},
}
_JSON_TYPES = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def header_problem(header) -> str | None:
    """What is wrong with a DB header, as the end of "its header ...", or None."""
    if not isinstance(header, dict):
        return f"is a JSON {_JSON_TYPES.get(type(header), 'null')}, expected an object"
    for field, (required, ok, expected) in HEADER_FIELDS.items():
        if field not in header:
            if required:
                return f"has no {field} (expected {expected})"
        elif not ok(header[field]):
            shown = json.dumps(header[field])
            return f"{field} is {shown if len(shown) <= 40 else shown[:37] + '...'}, expected {expected}"
    return None


def read_header(txn) -> dict:
    raw = txn.get(HEADER_KEY)
    return None if raw is None else json.loads(bytes(raw))


def write_header(txn, header: dict) -> None:
    txn.put(HEADER_KEY, json.dumps(header).encode())

"""Which tokenization a DB is valid for: the fingerprint and vocabulary size its header records."""
from __future__ import annotations

import hashlib
import json


def tokenizer_vocab_size(tokenizer) -> int:
    """Ids the tokenizer can give: its largest id + 1 (added tokens included). A DB records it
    (header `vocab_size`): every id it stores must be below it (`hd db verify`)."""
    return max(tokenizer.get_vocab().values()) + 1


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and special tokens: a DB is valid only for one tokenization."""
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:32]

"""Which tokenization a DB is valid for: the fingerprint and vocabulary size its header records."""
from __future__ import annotations

import hashlib
import json
import weakref


def tokenizer_vocab_size(tokenizer) -> int:
    """Ids the tokenizer can give: its largest id + 1 (added tokens included). A DB records it
    (header `vocab_size`): every id it stores must be below it (`hd db verify`)."""
    return max(tokenizer.get_vocab().values()) + 1


# tokenizer -> (what it was hashed as: its length and special tokens, its fingerprint): every Run
# with a DB checks it (api.generate builds a Run a call), and hashing a 49k-token vocabulary takes
# tens of milliseconds, a few tokens' worth of decoding; a token added or made special since hashes
# it again
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and special tokens: a DB is valid only for one tokenization."""
    try:
        state = (len(tokenizer), tuple(map(str, tokenizer.all_special_tokens)))
        kept = _FINGERPRINTS.get(tokenizer)
    except (TypeError, AttributeError):   # no length, or not weakly referable: hashed each time
        return _fingerprint(tokenizer)
    if kept is not None and kept[0] == state:
        return kept[1]
    fp = _fingerprint(tokenizer)
    _FINGERPRINTS[tokenizer] = (state, fp)
    return fp


def _fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:32]

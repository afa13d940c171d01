"""Who sends a request to `hd serve`, and whose learned drafts it may use.

Output never depends on drafts, but speed does: a request whose text another client already
generated is drafted from that text and completes faster, so its timing (and its own `usage.hd`,
which says which layer drafted) tells one client what another generated. This is the side channel
that made vLLM salt its prefix cache (CVE-2025-46570). So everything a server learns from
requests is kept per *scope*, and a request draws only from its own scope's:

  shared  one scope for all requests (a single-user server): what anyone taught, all use
  key     one scope per API key (the default when the server has more than one key)
  user    one per API key and request `user` field (apps that pass their end users' ids; a
          request without one shares its key's anonymous scope)

Scoped are: the recycled predictions (drafting/recycle.py), the model DB answers learned while
serving (drafting/model.ScopedAnswers, written to the DB with the scope's tag by --learn, so a
restart keeps them apart), without a model DB the answers the model layer learns in memory (an
index of its own a scope, its latest drafting/model.SCOPE_ANSWERS answers), and the prefix cache
(engine/decode/prefix.py). Not scoped, because no request
writes them: the model DB as built by `hd build-model-db`, statistics DBs, the context layer
(one request's own text).

Parameters and invariants
  * A scope is a tuple, never a joined string: () for shared, ("key", name), ("user", name,
    user). A string "user:<name>:<user>" was ambiguous (key `acme` with user `eu:bob` and key
    `acme:eu` with user `bob` shared one). Its tag in a DB is the first 8 bytes of the BLAKE2b
    digest of its parts, each length-prefixed (`encoded`), so no key or user id is written to the
    file. A key scope keeps the tag it had as the string "key:<name>" (unambiguous: the name is all
    the rest), so keys' learned answers stay theirs; user scopes learned before are read by no one.
  * Key names are unique. Names hd makes up ("--api-key 1", "<file> line 3", "open server") hold a
    space, which a keys file's NAME cannot: no line of a file can take over a generated name's scope.
  * API keys are compared in constant time against every key (no early exit that would time
    which one matched). A key must be printable ASCII without spaces (an HTTP header carries it).
  * At most max_scopes scopes keep learned state in memory; beyond, the least recently used
    scope's is dropped (its DB records stay on disk and are read again when it returns).
"""
from __future__ import annotations

import hashlib
import hmac
import string
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

from .. import inputs
from ..errors import HdError
from ..drafting import RecycledTable
from ..drafting.model import SCOPE_ANSWERS, AnswerIndex
from ..drafting.model import ScopedAnswers
from ..drafting.model import index_for

SCOPES = ("shared", "key", "user")
PRINTABLE = set(string.printable) - set(string.whitespace)
Scope = tuple   # () shared, ("key", name) or ("user", name, user): module header
SHARED: Scope = ()
OPEN = "open server"   # the key name of requests to a server without keys


def check_key(key: str, where: str) -> str:
    """The key, or HdError naming where it came from and what is wrong."""
    if not key:
        raise HdError(f"{where} is empty: give a token, or leave it out for an open server")
    bad = next((c for c in key if c not in PRINTABLE), None)
    if bad is not None:
        raise HdError(f"{where} holds {bad!r}: an API key must be printable ASCII without spaces "
                      "(clients send it in an HTTP header)")
    return key


class Keys:
    """The API keys a server takes, each with a name (the tenant it identifies)."""

    def __init__(self, named: Sequence[tuple[str, str]]):
        self.named = [(name, key.encode()) for name, key in named]
        seen, names = set(), set()
        for name, key in self.named:
            if key in seen:
                raise HdError(f"API key '{name}' is given twice: each tenant needs a key of its own")
            if name in names:
                raise HdError(f"two API keys are named '{name}': each tenant needs a name of its own")
            seen.add(key)
            names.add(name)

    @classmethod
    def load(cls, keys: Sequence[str] = (), file: str | Path | None = None) -> "Keys | None":
        """From --api-key values (named "--api-key 1", "--api-key 2", ...) and a keys file: one key
        a line (named "<file> line N"), or `NAME KEY`; blank lines and lines starting with # are
        skipped. A generated name holds a space, which a file's NAME cannot (module header).
        None: no key, an open server."""
        named = [(f"--api-key {i + 1}", check_key(k, "--api-key" if i else "--api-key (or HD_API_KEY)"))
                 for i, k in enumerate(keys)]
        lines_of: dict[str, int] = {}   # a name of the file -> its line
        if file is not None:
            lines = inputs.read_text(file, "--api-keys-file", inputs.KEYS_BYTES,
                                     "a key a line is far less: pass the keys file itself").splitlines()
            for n, line in enumerate(lines, 1):
                parts = line.split()
                if not parts or parts[0].startswith("#"):
                    continue
                if len(parts) > 2:
                    raise HdError(f"{file} line {n}: give KEY or NAME KEY")
                name, key = parts if len(parts) == 2 else (f"{Path(file).name} line {n}", parts[0])
                if name in lines_of:
                    raise HdError(f"{file} line {n}: the name '{name}' is also on line {lines_of[name]}: "
                                  "give each key a name of its own (its tenant's learned drafts go by it)")
                lines_of[name] = n
                named.append((name, check_key(key, f"{file} line {n}")))
            if len(named) == len(keys):
                raise HdError(f"--api-keys-file {file} holds no key")
        return cls(named) if named else None

    def __len__(self) -> int:
        return len(self.named)

    def identify(self, token: str) -> str | None:
        """The name of the key `token` is, or None; every key is compared, in constant time each."""
        got = token.encode("utf-8", "replace")
        found = None
        for name, key in self.named:
            if hmac.compare_digest(got, key) and found is None:
                found = name
        return found


def default_scope(keys: Keys | None) -> str:
    """`key` where the server has several keys (tenants), else `shared`."""
    return "key" if keys is not None and len(keys) > 1 else "shared"


def scope_of(mode: str, key_name: str | None, user: str | None) -> Scope:
    if mode == "shared":
        return SHARED
    key = key_name or OPEN
    return ("key", key) if mode == "key" else ("user", key, user or "")


def _utf8(part: str) -> bytes:
    return part.encode("utf-8", "surrogatepass")   # a JSON `user` may hold a lone surrogate


def encoded(scope: Scope) -> bytes:
    """A scope as bytes that no other scope has: its parts length-prefixed after a zero byte. A
    key scope keeps the bytes of its former string "key:<name>" (module header): never a zero first."""
    if scope[0] == "key":
        return b"key:" + _utf8(scope[1])
    return b"\0" + b"".join(len(b).to_bytes(4, "big") + b for b in map(_utf8, scope))


def tag(scope: Scope) -> bytes | None:
    """A scope's tag in a model DB (None: shared)."""
    return hashlib.blake2b(encoded(scope), digest_size=8).digest() if scope else None


class Tenants:
    """Per-scope learned state: each scope's recycled-prediction table and, where the model layer
    drafts from answers, its answers: with a model DB its ScopedAnswers, without one an index of
    its own (uses_answers: the model layer drafts from answers, a DB's or the process's)."""

    def __init__(self, model_db=None, uses_answers: bool = False, max_scopes: int = 256):
        self.model_db, self.uses_answers, self.max_scopes = model_db, uses_answers, max_scopes
        self.shared_table = RecycledTable()
        self._scopes: OrderedDict[Scope, tuple] = OrderedDict()

    def _state(self, scope: Scope) -> tuple:
        if scope in self._scopes:
            self._scopes.move_to_end(scope)
            return self._scopes[scope]
        answers = None
        if self.uses_answers and self.model_db is None:
            answers = AnswerIndex(max_answers=SCOPE_ANSWERS)
        elif self.uses_answers:
            own = AnswerIndex(self.model_db.sequences(scope=tag(scope)))
            answers = ScopedAnswers(index_for(self.model_db), own)
        state = (RecycledTable(), answers)
        self._scopes[scope] = state
        while len(self._scopes) > self.max_scopes:
            self._scopes.popitem(last=False)
        return state

    def recycled(self, scope: Scope):
        return self.shared_table if not scope else self._state(scope)[0]

    def answers(self, scope: Scope):
        """The answer index a request of this scope drafts from and grows (None: the shared one,
        the DB's or, without a DB, the process's)."""
        return None if not scope else self._state(scope)[1]

    def count(self) -> int:
        return len(self._scopes)

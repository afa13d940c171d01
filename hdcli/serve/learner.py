"""`hd serve --learn`: finished generations go into the model DB, off the decode thread.

One writer thread takes (prompt ids, tokens) from a queue and adds each generation's n-grams in
one LMDB write transaction (modeldb.learn -> statsdb.add_counts), through a Store of its own, so the
decode thread's read snapshot is never aborted under it. Drafting sees what was learned from the
next request on (the model layer refreshes its snapshot when a request starts).

Invariants
  * A generation is in the DB whole or not at all: one transaction each, header (key count,
    content digest) updated in the same transaction. A SIGKILL at any moment leaves the last
    committed state, which `hd db verify` accepts.
  * Decoding never waits for the writer: put() only queues; when more than max_pending
    generations wait, the oldest are dropped and counted (a slow disk loses learning, not speed).
  * close() writes what is queued, then stops.
  * `learned` counts committed writes into the file at the DB's path, no other: where that file
    was replaced since the learner opened it (`hd build-model-db -o M --overwrite` while serving),
    the learner says so once (on_error) and stops learning, rather than write on into a file
    nobody reads (stores.Store.update checks the file's identity around each transaction).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable
from ..db.modeldb import learn
from ..db.stores import Replaced, Store


class Learner:
    def __init__(self, path, max_pending: int = 256, on_error: Callable[[str], None] = lambda m: None,
                 on_learned: Callable[[int], None] = lambda keys: None,
                 on_dropped: Callable[[], None] = lambda: None):
        self.store = Store(path, writable=True)
        self.max_pending = max_pending
        self.on_error, self.on_learned, self.on_dropped = on_error, on_learned, on_dropped
        self.learned = self.keys = self.dropped = self.failed = 0
        self.stopped: str | None = None   # why learning stopped (the file was replaced)
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hd-learn", daemon=True)
        self._thread.start()

    def put(self, prompt_ids: list[int], tokens: list[int], scope: bytes | None = None) -> None:
        """Queue a generation; scope: its tenant's tag (serve/tenants.py), None: shared."""
        if not tokens:
            return
        while self._q.qsize() >= self.max_pending:
            try:
                self._q.get_nowait()
                self.dropped += 1
                self.on_dropped()
            except queue.Empty:
                break
        self._q.put((list(prompt_ids), list(tokens), scope))

    def pending(self) -> int:
        return self._q.qsize()

    def close(self, timeout: float | None = None) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self.stopped:
                self.failed += 1
                continue
            try:
                keys = learn(self.store, *item)
                self.keys += keys
                self.learned += 1
                self.on_learned(keys)
            except Replaced as exc:
                self.failed += 1
                self.stopped = str(exc)
                self.on_error(f"--learn stopped after {self.learned} generations: {exc}")
            except Exception as exc:  # noqa: BLE001 - a failed write must not stop serving
                self.failed += 1
                self.on_error(f"learning failed ({self.store.path}): {exc}")

"""`hd serve` in a process of its own, for programs that drive it (tests, benchmarks, an app's own
integration tests): started on a free loopback port (`--port 0`), its address read from the line
it logs when it listens.

    proc, url, log = spawn(["--model-db", "model.lmdb"])   # url: http://127.0.0.1:PORT/v1
    ...                                                     # openai.OpenAI(base_url=url, ...)
    proc.send_signal(signal.SIGTERM); proc.communicate()    # drains, then exits 0

Invariants
  * The server's stderr keeps being read (into `log`) by a daemon thread once it listens, so a
    chatty server never blocks on a full pipe; stdout is left to the caller (`--json` writes the
    summary there at exit).
  * Start-up failures raise RuntimeError with what the process logged.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

LISTENING = re.compile(r"at (http://127\.0\.0\.1:\d+/v1)")


def spawn(args: list[str], timeout: float = 300.0, env: dict | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `hd serve --port 0 ARGS`; return (process, base URL, its stderr lines so far and to come)."""
    proc = subprocess.Popen([sys.executable, "-m", "hdcli.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + timeout
    log: list[str] = []
    for line in proc.stderr:
        log.append(line)
        found = LISTENING.search(line)
        if found:
            threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
            return proc, found.group(1), log
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("hd serve did not start:\n" + "".join(log))

"""llama.cpp's own server, plain and with its own n-gram speculation, as peers on the same GGUF.

`llama-server` is built from the same pinned llama-cpp-python sdist as the `llama-cpp` method
(`make llama-server`: its vendored llama.cpp, the `llama-server` target, into .venv/bin; or the
binary HD_LLAMA_SERVER names). Each method is one server for the whole bench run, started once
(waited for on /health), asked every question, stopped at the end:

  llama-server                  plain decoding
  llama-server-<type>           with `--spec-type <type>`, one of SPEC_TYPES (drafting without a
                                model, as hd's context layer), each with llama.cpp's own defaults

Every answer is one POST /completion with hd's prompt token ids as the prompt (no tokenizing on
its side, no BOS added), greedy (temperature 0, top k 1) or hd's sampling settings with the run's
seed, n_predict the bench's max new tokens, cache_prompt false (no prefix reuse, as hd's answers),
return_tokens so that its token ids are compared with hd's. Its answer is cut at hd's first
end-of-sequence id, the rule every method stops by (llama.cpp stops at its own end-of-generation
tokens, which the same file names).

Its speed is the server's own: the response's `timings` (prompt_ms + predicted_ms as the wall time,
prefill included as in hd's tok/s; predicted_n, predicted_ms and its decode-only
predicted_per_second are kept beside it), so HTTP and JSON are not charged to it. Threads: as many
as torch uses, as the other peers.

A method whose binary is missing, or that does not offer the --spec-type, is skipped with the
reason (`unavailable`); a server that exits is one line naming the method, its exit status, the
first error it logged and where its whole log is.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

import torch

from ..engine import environment
from ..errors import HdError
from .llamacpp import MAX_CONTEXT, amx_off

# the n-gram drafters of the vendored llama.cpp (common/speculative.cpp; `llama-server --help`
# lists them under --spec-type, beside the draft-model ones: draft-simple, -eagle3, -mtp, ...)
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
METHODS = {"llama-server": None, **{f"llama-server-{t}": t for t in SPEC_TYPES}}
BUILD = "run `make llama-server` (builds it from the pinned llama-cpp-python sdist) or set HD_LLAMA_SERVER"
PATIENCE = 600.0   # seconds a server may take to load its model or to answer: loads of 8B files take ~1 min
LOG_TAIL = 200     # characters of its log a failure quotes


def binary() -> Path:
    """HD_LLAMA_SERVER, else the llama-server beside hd's Python (where `make llama-server` puts it);
    where hd runs as an AVX2 CPU (HD_CPU), the AVX2 build beside it if there is one (`make
    llama-server-avx2`), so that hd and its peer take the same CPU's instructions."""
    named = environment.llama_server()
    if named:
        return Path(named)
    here = Path(sys.executable).parent
    if environment.cpu_cap() and (here / "llama-server-avx2").is_file():
        return here / "llama-server-avx2"
    return here / "llama-server"


@lru_cache(maxsize=8)
def offered(path: str) -> tuple[str, ...]:
    """The --spec-type values `path --help` lists (empty where it lists none)."""
    try:
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=PATIENCE).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"--spec-type\s+\[?([\w,|-]+)", out)
    return tuple(re.split(r"[,|]", m.group(1))) if m else ()


def unavailable(method: str) -> str | None:
    """Why `method` cannot run here, in one line; None where it can."""
    path = binary()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"{method} skipped: no llama-server binary at {path}: {BUILD}"
    spec = METHODS[method]
    types = offered(str(path))
    if spec is not None and spec not in types:
        return (f"{method} skipped: {path} does not offer --spec-type {spec} "
                f"(it offers: {', '.join(types) or 'none'})")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _death_signal():
    """A function for the server's process to call before it starts, so that it gets SIGTERM when hd
    exits however hd exits (Linux's PR_SET_PDEATHSIG); None elsewhere. prctl is looked up here, in
    hd's process: the forked child only calls it."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        import signal
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG


class LlamaServer:
    """One llama-server on lm's GGUF file, ready once constructed; answer() is one /completion."""

    def __init__(self, method: str, lm, threads: int | None = None):
        if not str(lm.source).lower().endswith(".gguf"):
            raise HdError(f"method '{method}' runs a GGUF file; model '{lm.name}' was loaded from "
                          f"{lm.source}: pass a .gguf file or a bundled name with --model")
        why = unavailable(method)
        if why:
            raise HdError(why)
        self.method, self.lm, self.spec = method, lm, METHODS[method]
        self.threads = threads or torch.get_num_threads()
        self.n_ctx = min(lm.max_context, MAX_CONTEXT)
        self.path, self.port = binary(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(self.path), "-m", str(lm.source), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.n_ctx), "-np", "1",
                "-ngl", "0", "--cache-ram", "0", "--no-webui"]
        if self.spec:
            args += ["--spec-type", self.spec]
        if amx_off():   # its AMX weight buffers crash its decode (llamacpp.amx_off)
            args += ["--no-repack"]
        self.args, self.keep_log = args, False
        self.log = tempfile.NamedTemporaryFile("w+b", prefix=f"hd-{method}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=_death_signal())
        try:
            self._wait_ready()
            self._check_vocab()
        except BaseException:
            self.close()
            raise

    def settings(self) -> dict:
        """What a bench run records of it."""
        return {"binary": str(self.path), "version": self._version(), "spec_type": self.spec,
                "threads": self.threads, "n_ctx": self.n_ctx, "args": self.args[1:]}

    def _version(self) -> str | None:
        try:
            out = subprocess.run([str(self.path), "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        m = re.search(r"version: *(.+)", out.stdout + out.stderr)
        return m.group(1).strip() if m else None

    def _died(self, doing: str) -> HdError:
        """The line for a server that exited (or will not answer): its status and last logged error."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.log.flush()
        lines = [ln.strip() for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        # the first error is the cause (llama.cpp's later ones say what gave up because of it),
        # else its last word
        said = (errors[:1] or lines[-1:] or ["(it logged nothing)"])[0][:LOG_TAIL]
        status = "did not answer" if code is None else f"exited with status {code}"
        self.keep_log = True   # the line names it
        return HdError(f"method '{self.method}': llama-server {status} {doing}: {said} (its log: {self.log.name})")

    def _get(self, route: str, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, {}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._died(f"loading {self.lm.source}")
            try:
                if self._get("/health")[0] == 200:
                    return
            except (OSError, ValueError):  # not listening yet
                pass
            time.sleep(0.1)
        raise self._died(f"within {PATIENCE:.0f} s of starting")

    def _check_vocab(self) -> None:
        """llama.cpp's vocabulary size (GET /v1/models, where it says it) must be hd's: else token ids differ."""
        try:
            meta = (self._get("/v1/models")[1].get("data") or [{}])[0].get("meta") or {}
        except (OSError, ValueError, AttributeError, IndexError):
            return
        n = meta.get("n_vocab")
        if n is not None and n != self.lm.model.config.vocab_size:
            raise HdError(f"llama-server reads a vocabulary of {n} tokens from {self.lm.source}, hd's model has "
                          f"{self.lm.model.config.vocab_size}: their token ids would not match")

    def request(self, prompt_ids, max_new_tokens: int, sampling, seed: int | None) -> dict:
        """The /completion body for one answer."""
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens, "cache_prompt": False,
                "return_tokens": True, "stream": False, "seed": seed if seed is not None else 0,
                "repeat_penalty": 1.0, "min_p": 0.0}
        if sampling.greedy:
            body.update(temperature=0.0, top_k=1, top_p=1.0)
        else:
            body.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
        return body

    def answer(self, prompt_ids, max_new_tokens: int, sampling, seed: int | None) -> tuple[list[int], float, dict]:
        """(new tokens, wall seconds by its own timings, the timings)."""
        if len(prompt_ids) + max_new_tokens > self.n_ctx:
            raise HdError(f"method '{self.method}': {len(prompt_ids)} prompt + {max_new_tokens} new tokens "
                          f"exceed its context of {self.n_ctx}")
        data = json.dumps(self.request(prompt_ids, max_new_tokens, sampling, seed)).encode()
        req = urllib.request.Request(self.url + "/completion", data=data,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=PATIENCE) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            said = exc.read().decode(errors="replace")[:LOG_TAIL]
            raise HdError(f"method '{self.method}': llama-server refused a question (HTTP {exc.code}): {said}") from None
        except (OSError, ValueError):   # reset, refused, timed out, cut short
            raise self._died("answering a question") from None
        tokens = [int(t) for t in out.get("tokens") or []][:max_new_tokens]
        stop = next((i for i, t in enumerate(tokens) if t in self.lm.eos_ids), None)
        if stop is not None:
            tokens = tokens[:stop + 1]
        timings = out.get("timings") or {}
        own = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000
        # a server that reports no timings is charged the request's whole time
        return tokens, own if own > 0 else time.perf_counter() - t0, timings

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its log is removed unless a failure named it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not self.keep_log:
            Path(self.log.name).unlink(missing_ok=True)

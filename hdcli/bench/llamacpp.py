"""llama.cpp as the CPU yardstick: the same GGUF file hd loads, run through llama-cpp-python.

What runs: plain greedy decoding (llama.cpp's greedy sampler; with --temperature its own
temperature / top-p / top-k sampler), fed the same prompt token ids as hd (hd's tokenizer, read
from the same GGUF), stopped by the same rules (hd's end-of-sequence ids, the same max new
tokens), with as many threads as torch uses. Each answer starts from an empty KV cache (`reset`),
as hd's do, so a multi-turn question's history is prefilled again at each turn by both.
Wall time counts from the first prompt token to the last new token (prefill included), as hd's.

llama.cpp computes differently (it quantizes activations to 8 bits for its Q4/Q8 dot products,
and its batched evals are not M-invariant), so its answers are counted against hd's, not required
to equal them.

Optional: llama-cpp-python builds from its PyPI sdist (about 4 minutes on 2 cores); without it the
method is refused in one line that says how to install it.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..engine import loader, records
from ..errors import HdError

INSTALL = "pip install 'llama-cpp-python>=0.3' (or pip install -e '.[llama-cpp]'; builds in ~4 min)"
MAX_CONTEXT = 8192  # llama.cpp allocates its whole KV cache up front: no more than a bench needs


def amx_off() -> bool:
    """Whether llama.cpp's AMX weight buffers are turned off here: on a CPU with AMX (Intel Xeon of
    the 4th generation and later) llama.cpp repacks the weights for its AMX kernels, and its first
    decode then segfaults on some of them (llama.cpp#20824, open; one Xeon of family 6 model 167 on
    every model tried: the bundled SmolLM2 and the tiny test models). Off, it runs its AVX-512
    kernels, as on the CPUs before. llama-server's --no-repack, llama-cpp-python's
    use_extra_bufts=False: both runners record it (settings)."""
    return "amx_int8" in records.cpu_flags()


@contextlib.contextmanager
def _amx_buffers_off():
    """llama_cpp.Llama builds its model parameters from llama.cpp's defaults inside __init__ and
    takes no use_extra_bufts: the defaults are changed for the construction."""
    if not amx_off():
        yield
        return
    import llama_cpp.llama as high
    low, real = high.llama_cpp, high.llama_cpp.llama_model_default_params

    def defaults():
        params = real()
        params.use_extra_bufts = False
        return params
    low.llama_model_default_params = defaults
    try:
        yield
    finally:
        low.llama_model_default_params = real


def open_model(path, **kw):
    """llama_cpp.Llama(model_path=path, **kw), without the AMX buffers where amx_off()."""
    from llama_cpp import Llama
    with _amx_buffers_off():
        return Llama(model_path=str(path), **kw)


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def runs_model(name: str) -> bool:
    """Whether the llama-cpp method applies: llama-cpp-python is installed and `name` is a GGUF file."""
    if not available():
        return False
    try:
        return loader.resolve(name)[0] == "gguf"
    except HdError:
        return False


def version() -> str | None:
    try:
        import llama_cpp
        return getattr(llama_cpp, "__version__", "unknown")
    except ImportError:
        return None


class LlamaCppModel:
    """One llama.cpp context over lm's GGUF file; answer() decodes one prompt from an empty cache."""

    def __init__(self, lm, threads: int | None = None):
        if not str(lm.source).lower().endswith(".gguf"):
            raise HdError(f"method 'llama-cpp' runs a GGUF file; model '{lm.name}' was loaded from "
                          f"{lm.source}: pass a .gguf file or a bundled name with --model")
        if not available():
            raise HdError(f"method 'llama-cpp' needs llama-cpp-python, which is not installed: {INSTALL}")
        self.lm = lm
        self.threads = threads or torch.get_num_threads()
        self.n_ctx = min(lm.max_context, MAX_CONTEXT)
        try:
            self.llm = open_model(lm.source, n_ctx=self.n_ctx, n_threads=self.threads,
                                  n_threads_batch=self.threads, n_gpu_layers=0, verbose=False)
        except Exception as exc:  # llama.cpp says little more than "failed to load"
            raise HdError(f"llama-cpp-python could not load {lm.source}: {exc}") from None
        if self.llm.n_vocab() != lm.model.config.vocab_size:
            raise HdError(f"llama.cpp reads a vocabulary of {self.llm.n_vocab()} tokens from {lm.source}, "
                          f"hd's model has {lm.model.config.vocab_size}: their token ids would not match")

    def settings(self) -> dict:
        """What a bench run records of it."""
        return {"version": version(), "threads": self.threads, "n_ctx": self.n_ctx, "amx_buffers": not amx_off()}

    def answer(self, prompt_ids, max_new_tokens: int, sampling, seed: int | None,
               grammar=None) -> tuple[list[int], float]:
        """(new tokens, wall seconds). Greedy: llama.cpp's argmax sampler; no repeat penalty.
        grammar: a llama_cpp.LlamaGrammar the output follows (llama.cpp's own grammar sampler)."""
        if len(prompt_ids) + max_new_tokens > self.n_ctx:
            raise HdError(f"method 'llama-cpp': {len(prompt_ids)} prompt + {max_new_tokens} new tokens "
                          f"exceed its context of {self.n_ctx}")
        eos = self.lm.eos_ids
        if sampling.greedy:
            opts = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
        else:
            self.llm.set_seed(seed if seed is not None else 0)
            opts = dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=0.0)
        out: list[int] = []
        t0 = time.perf_counter()
        self.llm.reset()  # an empty cache: no prefix reuse across answers, as hd's runs
        for tok in self.llm.generate(list(prompt_ids), repeat_penalty=1.0, reset=True, grammar=grammar, **opts):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0

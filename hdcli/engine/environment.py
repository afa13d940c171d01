"""The environment variables hd reads: read here and nowhere else (the rest of hd asks these
functions), so that what can change a run from outside its options is listed in one place.

  HD_CACHE_DIR        where measured choices (cost curves, the attention's timing), M-invariant
                      calibrations, built tokenizers and GGUFs' repacked weights are kept; default
                      ~/.cache/hdcli. None of
                      them changes a run's numerics without being recorded in its Numerics.
  HD_LAYOUT_CACHE     "0" (or off, false, no): a GGUF's repacked weights are not kept under
                      HD_CACHE_DIR/layouts (model/layouts.py), every start repacks them; unset or
                      anything else: kept (the start that writes them says so, with their size).
  HD_FUSED_ATTENTION  "1": the compiled invariant attention wherever it compiles; "0": never;
                      unset or anything else: timed once per machine (invariant.decide). The choice is
                      recorded in the run's config (`attention`) and replayed by --config.
  HD_FUSED_TILE       the compiled attention's tile height, forced (tests and timing only: it
                      changes how rows share loops, never a row's arithmetic); passed to the
                      extension by fused.py.
  HD_CPU              "avx2": hd takes this CPU for one with AVX2 and no AVX-512 (most users'
                      desktops and laptops): its kernels built for x86-64-v3, bf16 taken as emulated,
                      records keyed apart. For testing and measuring that path on a newer CPU; torch's
                      own kernels follow only where ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2
                      are set before torch loads (tests/conftest.py sets them). "avx2-vnni": the
                      same with AVX-VNNI (Intel Alder Lake and newer), -mavxvnni besides.
  HD_API_KEY          a key `hd serve` requires, before its --api-key values (set but empty is
                      refused: cli.py).
  OLLAMA_MODELS, LMSTUDIO_MODELS
                      Ollama's and LM Studio's own: where their stores lie, where not the default
                      folders (engine/local_models.py; set but empty counts as unset).
  HD_LLAMA_SERVER     the llama-server binary the `llama-server*` methods of `hd bench spec-bench`
                      run (bench/llamaserver.py); unset or empty: the one `make llama-server` puts
                      beside hd's Python (.venv/bin/llama-server).
  HF_HUB_OFFLINE, HF_ENDPOINT
                      Hugging Face's own: whether a hub id may be looked up online, and where.

hd also sets two variables: kernels/build.py puts pip's ninja on PATH for torch's extension build,
and `cap_onednn_isa` caps oneDNN below AMX where it is unset (tests/test_docs_truth.py lists what
may touch os.environ).
  ONEDNN_MAX_CPU_ISA  oneDNN's own; unset, hd sets AVX512_CORE_FP16 before torch loads (below).
"""
from __future__ import annotations

import os
from pathlib import Path
from ..errors import HdError


def cap_onednn_isa() -> None:
    """oneDNN's AMX kernels (Intel Xeon 4th generation and newer) split a bf16 matmul by its row
    count, so a row's result depends on the rows beside it: the M-invariant calibration finds no
    padding that holds and the exact mode is refused. Its AVX-512 kernels below AMX hold. So the
    cap, set before torch loads (hdcli/__init__.py) and only where the variable is unset; a CPU
    without AMX is not affected (a cap above its own ISA)."""
    import sys
    if "torch" not in sys.modules and "ONEDNN_MAX_CPU_ISA" not in os.environ and not cpu_cap():   # HD_CPU: AVX2's own caps
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_FP16"


def cache_dir() -> Path:
    return Path(os.environ.get("HD_CACHE_DIR") or Path.home() / ".cache" / "hdcli")


CACHE_FOLDERS = ("costs", "invariant", "attention", "choices", "tokenizers", "gguf", "layouts")   # what hd keeps there
_checked: set[str] = set()


def check_cache_dir() -> Path:
    """cache_dir(), made where missing and checked once per process before anything is measured:
    a path that is a file (or has a file on the way, or where one of CACHE_FOLDERS should be) is
    a one-line HdError saying how to set HD_CACHE_DIR; one that cannot be written is said in one
    line on stderr (hd then works, measuring its choices again on every run)."""
    import sys
    root = cache_dir()
    if str(root) in _checked:
        return root
    name = f"HD_CACHE_DIR {root}" if os.environ.get("HD_CACHE_DIR") else f"the cache folder {root}"
    fix = "set HD_CACHE_DIR to a writable folder (default ~/.cache/hdcli)"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        what = "is a file, not a folder" if root.exists() else "is not a folder (a file lies on its path)"
        raise HdError(f"{name} {what}: {fix}") from None
    except OSError as exc:
        print(f"warning: {name} cannot be made ({exc.strerror or exc}): hd measures its choices again on every "
              f"run (slower, and timed choices may differ between runs); {fix}", file=sys.stderr, flush=True)
        _checked.add(str(root))
        return root
    for sub in CACHE_FOLDERS:
        if (root / sub).exists() and not (root / sub).is_dir():
            raise HdError(f"{root / sub} is a file, not a folder: remove it (hd keeps its measurements there) or {fix}")
    if not os.access(root, os.W_OK | os.X_OK):
        print(f"warning: {name} is not writable: hd measures its choices again on every run (slower, and "
              f"timed choices may differ between runs); {fix}", file=sys.stderr, flush=True)
    _checked.add(str(root))
    return root


def layout_cache() -> bool:
    """Whether a GGUF's repacked weights are kept on disk (HD_LAYOUT_CACHE, on by default)."""
    return os.environ.get("HD_LAYOUT_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def fused_attention() -> str:
    """"0", "1" or "auto"."""
    asked = os.environ.get("HD_FUSED_ATTENTION", "auto").strip().lower() or "auto"
    return asked if asked in ("0", "1") else "auto"


def fused_tile() -> int:
    """The forced tile height of the compiled attention, 0 where none is forced."""
    try:
        return int(os.environ.get("HD_FUSED_TILE", "0") or 0)
    except ValueError:
        return 0


CPU_CAPS = ("avx2", "avx2-vnni")   # HD_CPU's values: as an AVX2-only CPU (Zen 1-3, older Intel), and
                                   # as one with AVX-VNNI beside it (Intel Alder Lake and newer)


def cpu_cap() -> str | None:
    """The CPU HD_CPU asks hd to run as (CPU_CAPS: a subset of this one's instructions), else None
    (this CPU as it is)."""
    asked = os.environ.get("HD_CPU", "").strip().lower()
    return asked if asked in CPU_CAPS else None


def llama_server() -> str | None:
    """The llama-server binary HD_LLAMA_SERVER names, None where it names none."""
    return os.environ.get("HD_LLAMA_SERVER", "").strip() or None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def api_key() -> str | None:
    """HD_API_KEY as set ("" where set but empty), None where unset."""
    return os.environ.get("HD_API_KEY")


def ollama_models() -> str | None:
    """OLLAMA_MODELS, None where unset or empty (Ollama's default folder then)."""
    return os.environ.get("OLLAMA_MODELS") or None


def lmstudio_models() -> str | None:
    """LMSTUDIO_MODELS, None where unset or empty (LM Studio's default folders then)."""
    return os.environ.get("LMSTUDIO_MODELS") or None

"""The environment variables hd reads: read here and nowhere else (the rest of hd asks these
functions), so that what can change a run from outside its options is listed in one place.

  HD_CACHE_DIR        where measured choices (cost curves, the attention's timing), M-invariant
                      calibrations and built tokenizers are kept; default ~/.cache/hdcli. None of
                      them changes a run's numerics without being recorded in its Numerics.
  HD_FUSED_ATTENTION  "1": the compiled invariant attention wherever it compiles; "0": never;
                      unset or anything else: timed once per machine (fused.decide). The choice is
                      recorded in the run's config (`attention`) and replayed by --config.
  HD_FUSED_TILE       the compiled attention's tile height, forced (tests and timing only: it
                      changes how rows share loops, never a row's arithmetic); passed to the
                      extension by fused.py.
  HF_HUB_OFFLINE, HF_ENDPOINT
                      Hugging Face's own: whether a hub id may be looked up online, and where.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HD_CACHE_DIR") or Path.home() / ".cache" / "hdcli")


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


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")

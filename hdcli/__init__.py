"""hd: lossless speculative decoding with drafts from a hierarchy of sources."""
__version__ = "0.1.0"

from .engine import environment as _environment

_environment.cap_onednn_isa()   # before anything loads torch: see the function

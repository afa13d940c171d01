"""hd: lossless speculative decoding with drafts from a hierarchy of sources."""
__version__ = "0.1.0"

from .engine.environment import cap_onednn_isa as _cap_onednn_isa

_cap_onednn_isa()   # before anything loads torch: see the function

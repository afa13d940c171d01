"""hd: lossless speculative decoding with drafts from a hierarchy of sources."""
__version__ = "0.1.0"

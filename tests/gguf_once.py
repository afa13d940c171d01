"""transformers' model of a GGUF without the work it repeats on the same inputs.

transformers builds its model of a GGUF (`from_pretrained(gguf_file=)`, hd's load_reference) by
reading the header with gguf-py's GGUFReader once for the tokenizer, once for the config and once
for the weights (GGUFReader walks the vocabulary's strings one by one: ~3 s a read on the bundled
SmolLM2's 49k tokens, ~10 s on Gemma 3's 262k, on the 2-core EPYC), and maps the weights' names
by building gguf-py's TensorNameMap for the whole model again for each of its modules (~400 on
SmolLM2's 30 layers). Within `transformers_reads_once()` each of them is built once per argument
and handed out again: GGUFReader of one file (its fields and tensors, which transformers only
reads) and get_tensor_name_map of one architecture and layer count (a name lookup table, only
read), so transformers' tokenizer, config and dequantized weights are the ones it builds without;
and the reader slices the file as plain numpy views, not memmaps (_plain_views: a third of the time).
Used by the tests that compare hd's forward with transformers' on real GGUFs (test_owned.py,
test_models.py).
"""
from __future__ import annotations

import contextlib
import os

import pytest


@contextlib.contextmanager
def _plain_views():
    """GGUFReader reads the file through an np.memmap, and every one of the million items it slices
    out of it (a string's length, its bytes) is a memmap too, whose __getitem__ and
    __array_finalize__ run in Python: two thirds of a read (Gemma 3: 19 s, 6 s plain, on the
    EPYC). Here the memmap is handed over as the plain ndarray over the same mapped pages
    (np.asarray: no copy), so its slices are plain views of the same bytes."""
    import numpy as np
    from gguf import gguf_reader
    real = np.memmap

    class plain_numpy:   # gguf_reader's `np`, but for memmap
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def memmap(*args, **kwargs):
            return np.asarray(real(*args, **kwargs))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_reader, "np", plain_numpy())
        yield


@contextlib.contextmanager
def transformers_reads_once(tokenizer: bool = True):
    """Yields {"readers": {(path, mode): GGUFReader}, "name_maps": {(arch, n_blocks): map}}.
    tokenizer=False: transformers' AutoTokenizer gives None instead of building its tokenizer of
    the GGUF (~6 s of Gemma 3's 262k tokens on the EPYC), for a test that reads only its model."""
    import gguf
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    made: dict = {"readers": {}, "name_maps": {}}

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in made["readers"]:
            with _plain_views():
                made["readers"][key] = real_reader(path, mode)
        return made["readers"][key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in made["name_maps"]:
            made["name_maps"][arch, n_blocks] = real_map(arch, n_blocks)
        return made["name_maps"][arch, n_blocks]
    with pytest.MonkeyPatch.context() as mp:   # transformers imports both from gguf at each call
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", name_map)
        if not tokenizer:
            import transformers
            mp.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
        yield made

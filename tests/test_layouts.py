"""The layout cache (hdcli/engine/model/layouts.py): a GGUF's packings written once, mapped later.

  * a later load maps every packing from the file (the GEMMs' weights are views of one map, a
    layer's q, k, v joined without a copy) and computes logits torch.equal to the load that packed
    them and to a load without the cache, for every type of the tiny file;
  * a cache cut short, damaged where its samples look, or of another key is said in one line,
    removed and rebuilt: never used. Control: with the check skipped, the damaged file is used and
    the logits change (the damage the test makes is one that matters);
  * HD_LAYOUT_CACHE=0 writes nothing; a disk without room says so and writes nothing; a write
    that fails leaves no file, said in one line; Ctrl-C while the CLI waits for the write at exit
    leaves none either.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine import loader as models
from hdcli.engine.kernels import quants
from hdcli.engine.model import layouts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25]])


def _kernels() -> list[str]:
    out = []
    if quants.int8_available():
        out.append("gguf-int8")
    if quants.bf16_available():
        out.append("gguf")
    return out or ["none"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer llama GGUF whose weights cycle through every supported type (synth_gguf's "all")."""
    import synth_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny-all.gguf"
    synth_gguf.write(path, "tiny", "all", seed=0)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own (the layouts folder in it)."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HD_LAYOUT_CACHE", raising=False)
    return tmp_path / "cache" / "layouts"


def _load(path, kern: str):
    if kern == "none":
        pytest.skip("hd's GGUF GEMM does not run here (neither AVX512-BF16 nor AVX2)")
    lm = models.load(str(path), dtype="bf16", device="cpu", kernels=kern, invariant="off", quiet=True)
    layouts.wait()
    with torch.inference_mode():
        logits = lm.model.forward(IDS)
    return lm, logits


def _gemms(lm) -> list:
    return [m for m in lm.model.modules() if isinstance(m, quants.QLinear)]


@pytest.mark.parametrize("kern", _kernels())
def test_a_later_load_maps_the_packings_and_computes_the_same(tiny_gguf, cache, kern, monkeypatch):
    first, want = _load(tiny_gguf, kern)
    assert first.info["layout_cache"]["hit"] is False and first.info["layout_cache"]["writing_bytes"] > 0
    assert len(list(cache.glob("*.hdl"))) == 1 and not list(cache.glob(".*tmp*"))
    later, got = _load(tiny_gguf, kern)
    assert later.info["layout_cache"]["hit"] is True and later.info["layout_cache"]["writing_bytes"] == 0
    assert torch.equal(got, want)
    gemms = _gemms(later)
    assert len(gemms) >= 2 and {g.packed.untyped_storage().data_ptr() for g in gemms} == {
        gemms[0].packed.untyped_storage().data_ptr()}, "every packing a view of the one mapped file"
    assert [g.packed.shape for g in gemms] == [g.packed.shape for g in _gemms(first)]
    monkeypatch.setenv("HD_LAYOUT_CACHE", "0")
    _, plain = _load(tiny_gguf, kern)
    assert torch.equal(plain, want)


def test_joined_layers_are_views_of_the_map_not_copies(tmp_path, cache):
    """A file of one type (Q4_0): q, k, v and gate, up join; on a later load the joined packing is
    the parts' ranges of the map side by side (a view), with the same logits."""
    import synth_gguf
    path = tmp_path / "tiny-q4_0.gguf"
    synth_gguf.write(path, "tiny", "Q4_0", seed=1)
    kern = _kernels()[0]
    _, want = _load(path, kern)
    later, got = _load(path, kern)
    assert torch.equal(got, want)
    joined = [g for g in _gemms(later) if len(g.names) > 1]
    assert {len(g.names) for g in joined} == {2, 3}, [g.names for g in _gemms(later)]
    base = later.model.blocks[0].qkv.kernel.packed.untyped_storage().data_ptr()
    for g in joined:
        assert g.packed.untyped_storage().data_ptr() == base and g.packed.is_contiguous()
        assert g.packed.shape[0] == sum(blocks for _, blocks in g.names)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":   # the first bytes of the first packing, inverted: inside a sample
        data[0:64] = bytes(~b & 0xFF for b in data[0:64])
        path.write_bytes(bytes(data))
    elif how == "footer":
        path.write_bytes(bytes(data[:-3]) + b"xyz")


@pytest.mark.parametrize("how", ["truncated", "flipped", "footer"])
def test_a_damaged_cache_is_said_rebuilt_and_never_used(tiny_gguf, cache, capsys, how):
    kern = _kernels()[0]
    _, want = _load(tiny_gguf, kern)
    [file] = cache.glob("*.hdl")
    _damage(file, how)
    capsys.readouterr()
    lm, got = _load(tiny_gguf, kern)
    err = capsys.readouterr().err
    assert lm.info["layout_cache"]["hit"] is False
    assert f"the layout cache {file}" in err and "removed, the weights are repacked" in err, err
    assert torch.equal(got, want)
    again, _ = _load(tiny_gguf, kern)
    assert again.info["layout_cache"]["hit"] is True, "rebuilt whole"


def test_control_a_damaged_cache_used_unchecked_changes_the_logits(tiny_gguf, cache, monkeypatch):
    """The damage above matters: with the checks skipped, the file is mapped and the logits are
    not the packed weights' (so the test above would see a damaged cache being used)."""
    kern = _kernels()[0]
    _, want = _load(tiny_gguf, kern)
    [file] = cache.glob("*.hdl")
    _damage(file, "flipped")
    monkeypatch.setattr(layouts.LayoutCache, "_read", _read_unchecked)
    lm, got = _load(tiny_gguf, kern)
    assert lm.info["layout_cache"]["hit"] is True and not torch.equal(got, want)


def _read_unchecked(self):
    """LayoutCache._read with every sample taken as right."""
    import mmap
    with open(self.path, "rb") as f:
        index, data = layouts._index(f, self.path.stat().st_size)
        self._map = mmap.mmap(f.fileno(), data, access=mmap.ACCESS_COPY)
    self.base = torch.frombuffer(self._map, dtype=torch.uint8)
    self.entries = index["entries"]
    return None


def test_another_key_is_written_beside_and_replaces_the_old(tiny_gguf, cache, tmp_path):
    """A new modification time of the GGUF (another key): a new file; the old one of the same
    path is removed once the new one is written."""
    kern = _kernels()[0]
    _, want = _load(tiny_gguf, kern)
    [old] = cache.glob("*.hdl")
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        lm, got = _load(tiny_gguf, kern)
    finally:
        os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert lm.info["layout_cache"]["hit"] is False and torch.equal(got, want)
    [new] = cache.glob("*.hdl")
    assert new != old


def test_off_writes_nothing(tiny_gguf, cache, monkeypatch):
    monkeypatch.setenv("HD_LAYOUT_CACHE", "off")
    lm, _ = _load(tiny_gguf, _kernels()[0])
    assert "layout_cache" not in lm.info and not cache.exists()


def test_a_disk_without_room_is_said_and_nothing_written(tiny_gguf, cache, monkeypatch, capsys):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**6, 10**6))
    capsys.readouterr()
    lm, _ = _load(tiny_gguf, _kernels()[0])
    err = capsys.readouterr().err
    assert "the layout cache is off for this start" in err and "GB free" in err, err
    assert lm.info["layout_cache"]["writing_bytes"] == 0 and not list(cache.glob("*.hdl"))


def test_a_failed_write_leaves_no_file(tiny_gguf, cache, monkeypatch, capsys):
    def fail(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)
    capsys.readouterr()
    _load(tiny_gguf, _kernels()[0])
    err = capsys.readouterr().err
    assert "could not be written (No space left on device)" in err, err
    assert not list(cache.glob("*.hdl")) and not list(cache.glob(".*tmp*"))


def test_ctrl_c_while_waiting_at_exit_abandons_the_write(tiny_gguf, cache, monkeypatch, capsys):
    """The CLI's wait at exit (layouts.wait(progress=True)) shows a bar; Ctrl-C there stops the
    writer at its next tensor and leaves no file, final or temporary; the next load writes it."""
    import time
    kern = _kernels()[0]
    if kern == "none":
        pytest.skip("hd's GGUF GEMM does not run here (neither AVX512-BF16 nor AVX2)")
    real = layouts._sample

    def held(view):   # the writer held at its first tensor until told to stop
        for _, writing in list(layouts._WRITERS):
            writing.abandon.wait(30)
        return real(view)
    monkeypatch.setattr(layouts, "_sample", held)
    models.load(str(tiny_gguf), dtype="bf16", device="cpu", kernels=kern, invariant="off", quiet=True)
    assert layouts._WRITERS
    capsys.readouterr()

    def ctrl_c(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr(time, "sleep", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        layouts.wait(progress=True)
    assert "writing the layout cache" in capsys.readouterr().err
    assert not layouts._WRITERS and not list(cache.glob("*.hdl")) and not list(cache.glob(".*tmp*"))
    monkeypatch.undo()
    monkeypatch.setenv("HD_CACHE_DIR", str(cache.parent))
    lm, _ = _load(tiny_gguf, kern)
    assert lm.info["layout_cache"]["writing_bytes"] > 0 and len(list(cache.glob("*.hdl"))) == 1

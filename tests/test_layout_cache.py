"""The layout cache (hdcli/engine/model/layouts.py): a GGUF's packings written once, mapped later.

  * a later load maps every packing from the file (the GEMMs' weights are views of one map, a
    layer's q, k, v joined without a copy) and computes logits torch.equal to the load that packed
    them and to a load without the cache, for every type of the tiny file;
  * a cache cut short, with a bad footer, damaged anywhere in a packing (64 bytes inverted, 4 KiB
    zeroed inside every large packing) or with two same-shape entries of its index swapped, or of
    another key, is said in one line, removed and rebuilt: never used, the logits those of a fresh
    repack. Control: with the check skipped, the damaged file is used and the logits change (the
    damage the test makes is one that matters); the digest itself: every byte, bound to the entry;
  * HD_LAYOUT_CACHE=0 writes nothing; a disk without room says so and writes nothing; a write
    that fails leaves no file, said in one line; a folder that takes no file (read-only) is one
    line once per process, no traceback; Ctrl-C while the CLI waits for the write at exit leaves
    none either.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine import loader
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


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory):
    """The same shape in one type (Q4_0): same-shape entries of one format, q/k/v and gate/up joined."""
    import synth_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf"
    synth_gguf.write(path, "tiny", "Q4_0", seed=1)
    return path


def _file(how: str, tiny_gguf, tiny_q4_0):
    """The file a damage is made in: every type, but one where two entries share shape and format."""
    return tiny_q4_0 if how == "swapped" else tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own (the layouts folder in it)."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HD_LAYOUT_CACHE", raising=False)
    return tmp_path / "cache" / "layouts"


def _load(path, kern: str):
    if kern == "none":
        pytest.skip("hd's GGUF GEMM does not run here (neither AVX512-BF16 nor AVX2)")
    lm = loader.load(str(path), dtype="bf16", device="cpu", kernels=kern, invariant="off", quiet=True)
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


def _index_of(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        return layouts._index(f, path.stat().st_size)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":   # the first bytes of the first packing, inverted
        data[0:64] = bytes(~b & 0xFF for b in data[0:64])
        path.write_bytes(bytes(data))
    elif how == "footer":
        path.write_bytes(bytes(data[:-3]) + b"xyz")
    elif how == "zeroed":   # 4 KiB inside every packing of 16 KiB or more, between format 1's samples
        index, _ = _index_of(path)
        zeroed = 0
        for offset, shape, _, _ in index["entries"].values():
            n = int(torch.Size(shape).numel())
            if n >= 16384:
                at = offset + min(n, 1 << 20) // 2 - 2048   # the samples: 256 bytes at every MiB, and the last 256
                zeroed += any(data[at:at + 4096])
                data[at:at + 4096] = bytes(4096)
        assert zeroed >= 4, "bytes that were not zero already"
        path.write_bytes(bytes(data))
    elif how == "swapped":   # two same-shape, same-format entries exchange their places (and checksums)
        index, size = _index_of(path)
        entries = index["entries"]
        a, b = [n for n in entries if n.endswith("ffn_down.weight")][:2]
        assert entries[a][1:3] == entries[b][1:3], (entries[a], entries[b])
        entries[a], entries[b] = entries[b], entries[a]
        blob = json.dumps(index).encode()
        path.write_bytes(bytes(data[:size]) + blob + struct.pack("<Q8s", len(blob), layouts.MAGIC))


@pytest.mark.parametrize("how", ["truncated", "flipped", "footer", "zeroed", "swapped"])
def test_a_damaged_cache_is_said_rebuilt_and_never_used(tiny_gguf, tiny_q4_0, cache, capsys, how):
    kern = _kernels()[0]
    tiny_gguf = _file(how, tiny_gguf, tiny_q4_0)
    _, want = _load(tiny_gguf, kern)
    [file] = cache.glob("*.hdl")
    _damage(file, how)
    capsys.readouterr()
    lm, got = _load(tiny_gguf, kern)
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "layout cache" in line]
    assert lm.info["layout_cache"]["hit"] is False
    assert len(said) == 1 and f"the layout cache {file}" in said[0] and "removed, the weights are repacked" in said[0], err
    if how in ("zeroed", "swapped"):
        assert "does not match its digest at blk." in said[0], said
    assert torch.equal(got, want)
    assert lm.info["layout_cache"]["writing_bytes"] > 0, "written again"
    again, logits = _load(tiny_gguf, kern)
    assert again.info["layout_cache"]["hit"] is True and torch.equal(logits, want), "rebuilt whole"


def test_a_damaged_cache_that_cannot_be_removed_is_not_said_removed(tiny_gguf, cache, capsys, monkeypatch):
    """A damaged cache in a folder hd cannot write stays where it is: the line says so and what to
    do (it said "removed" and came back at every start), and the weights are repacked all the same."""
    from pathlib import Path
    kern = _kernels()[0]
    _, want = _load(tiny_gguf, kern)
    [file] = cache.glob("*.hdl")
    _damage(file, "zeroed")
    real = Path.unlink

    def unlink(self, missing_ok=False):
        if self == file:
            raise PermissionError(13, "Permission denied")
        return real(self, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", unlink)
    capsys.readouterr()
    lm, got = _load(tiny_gguf, kern)
    said = [line for line in capsys.readouterr().err.splitlines() if f"the layout cache {file}" in line]
    assert len(said) == 1 and "not removed (Permission denied), the weights are repacked; remove it" in said[0], said
    assert file.exists() and torch.equal(got, want)


@pytest.mark.parametrize("how", ["flipped", "zeroed", "swapped"])
def test_control_a_damaged_cache_used_unchecked_changes_the_logits(tiny_gguf, tiny_q4_0, cache, monkeypatch, how):
    """The damage above matters: with the checks skipped, the file is mapped and the logits are
    not the packed weights' (so the test above would see a damaged cache being used)."""
    kern = _kernels()[0]
    tiny_gguf = _file(how, tiny_gguf, tiny_q4_0)
    _, want = _load(tiny_gguf, kern)
    [file] = cache.glob("*.hdl")
    _damage(file, how)
    monkeypatch.setattr(layouts.LayoutCache, "_read", _read_unchecked)
    lm, got = _load(tiny_gguf, kern)
    assert lm.info["layout_cache"]["hit"] is True and not torch.equal(got, want)


def _read_unchecked(self):
    """LayoutCache._read with every check skipped."""
    import mmap
    with open(self.path, "rb") as f:
        index, data = layouts._index(f, self.path.stat().st_size)
        self._map = mmap.mmap(f.fileno(), data, access=mmap.ACCESS_COPY)
    self.base = torch.frombuffer(self._map, dtype=torch.uint8)
    self.entries = index["entries"]
    return None


def test_the_digest_covers_every_byte_and_is_bound_to_its_entry():
    """The check itself: the same bytes and entry give the same digest; one byte changed anywhere
    (first, middle, last), or the same bytes under another name, offset, shape or format, do not
    (negative control: the unchanged copy matches)."""
    data = bytearray(torch.randint(0, 256, (3 * 4096 + 7,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    entry = ("blk.0.ffn_down.weight", 4096, [16, 3, 256], "q4k")
    want = layouts._digest(*entry, memoryview(data))
    assert layouts._digest(*entry, memoryview(bytes(data))) == want
    for at in (0, len(data) // 2, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 1
        assert layouts._digest(*entry, memoryview(changed)) != want, at
    zeroed = bytearray(data)
    zeroed[4096:8192] = bytes(4096)
    assert layouts._digest(*entry, memoryview(zeroed)) != want
    for other in (("blk.1.ffn_down.weight", *entry[1:]), (entry[0], 4160, *entry[2:]),
                  (entry[0], entry[1], [3, 16, 256], entry[3]), (*entry[:3], "q4_0")):
        assert layouts._digest(*other, memoryview(data)) != want, other


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


def test_a_written_layout_removes_those_of_gone_files_only(tiny_gguf, tiny_q4_0, cache, tmp_path):
    """Writing a layout file removes the files of GGUFs that no longer exist (a deleted model's,
    5 GB at 8B), and leaves another model's that still exists."""
    import shutil
    kern = _kernels()[0]
    gone = tmp_path / "gone.gguf"
    shutil.copy(tiny_q4_0, gone)
    _load(gone, kern)
    _load(tiny_q4_0, kern)
    assert {layouts.read_source(p) for p in cache.glob("*.hdl")} == {str(gone.resolve()), str(tiny_q4_0.resolve())}
    gone.unlink()
    _load(tiny_gguf, kern)
    assert {layouts.read_source(p) for p in cache.glob("*.hdl")} == {str(tiny_q4_0.resolve()), str(tiny_gguf.resolve())}


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


def _read_only(folder: Path, monkeypatch) -> None:
    """`folder` as a read-only mount makes it (this machine runs the suite as root, where chmod
    stops no write): creating, replacing or removing a file there is EROFS."""
    import builtins
    import errno

    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(os.fsdecode(path)).parent == folder

    def refused(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    real_open, real_unlink, real_replace = builtins.open, os.unlink, os.replace
    monkeypatch.setattr(builtins, "open", lambda file, mode="r", *a, **k: refused(file)
                        if inside(file) and set(mode) & set("wxa+") else real_open(file, mode, *a, **k))
    monkeypatch.setattr(os, "unlink", lambda path, *a, **k: refused(path) if inside(path) else real_unlink(path, *a, **k))
    monkeypatch.setattr(os, "replace", lambda src, dst, *a, **k: refused(dst) if inside(src) or inside(dst)
                        else real_replace(src, dst, *a, **k))


def _thread_errors(monkeypatch) -> list:
    """What the writer thread lets through (threading's hook would print its traceback)."""
    import threading
    caught = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_value))
    return caught


def test_a_read_only_layouts_folder_is_one_line_and_no_traceback(tiny_gguf, cache, monkeypatch, capsys):
    """Two loads (a target and its draft) into a read-only layouts folder: the answer is the
    packed weights', one line says the cache could not be written, why and what to do; the
    writer lets nothing through (was: its traceback, twice); nothing is left in the folder."""
    kern = _kernels()[0]
    monkeypatch.setenv("HD_LAYOUT_CACHE", "0")
    _, want = _load(tiny_gguf, kern)
    monkeypatch.delenv("HD_LAYOUT_CACHE")
    cache.mkdir(parents=True)
    _read_only(cache, monkeypatch)
    caught = _thread_errors(monkeypatch)
    capsys.readouterr()
    _, got = _load(tiny_gguf, kern)
    _, again = _load(tiny_gguf, kern)
    err = capsys.readouterr().err
    assert not caught and "Traceback" not in err, caught or err
    said = [line for line in err.splitlines() if "layout cache" in line]
    assert len(said) == 1, err
    assert f"{cache} cannot be written (Read-only file system)" in said[0] and "HD_LAYOUT_CACHE=0" in said[0], said
    assert torch.equal(got, want) and torch.equal(again, want) and not list(cache.iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder chmod made read-only")
def test_a_chmod_read_only_layouts_folder_is_one_line(tiny_gguf, cache, monkeypatch, capsys):
    kern = _kernels()[0]
    cache.mkdir(parents=True)
    cache.chmod(0o555)
    try:
        caught = _thread_errors(monkeypatch)
        capsys.readouterr()
        _load(tiny_gguf, kern)
        err = capsys.readouterr().err
    finally:
        cache.chmod(0o755)
    said = [line for line in err.splitlines() if "layout cache" in line]
    assert not caught and len(said) == 1 and "cannot be written (Permission denied)" in said[0], err
    assert not list(cache.iterdir())


def test_ctrl_c_while_waiting_at_exit_abandons_the_write(tiny_gguf, cache, monkeypatch, capsys):
    """The CLI's wait at exit (layouts.wait(progress=True)) shows a bar; Ctrl-C there stops the
    writer at its next tensor and leaves no file, final or temporary; the next load writes it."""
    import time
    kern = _kernels()[0]
    if kern == "none":
        pytest.skip("hd's GGUF GEMM does not run here (neither AVX512-BF16 nor AVX2)")
    real = layouts._digest

    def held(*entry):   # the writer held at its first tensor until told to stop
        for _, writing in list(layouts._WRITERS):
            writing.abandon.wait(30)
        return real(*entry)
    monkeypatch.setattr(layouts, "_digest", held)
    loader.load(str(tiny_gguf), dtype="bf16", device="cpu", kernels=kern, invariant="off", quiet=True)
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

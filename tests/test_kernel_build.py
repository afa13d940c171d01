"""Building hd's compiled kernels (hdcli/engine/kernels/build.py): a compiled extension that does
not load is built again once, two installs of one source build one kernel from one path, a lock
left by a killed build is taken at once, and the fused attention builds beside the GEMM at a
first start. torch's cpp_extension is stood in for: no compiler runs here."""
from __future__ import annotations

import os

from hdcli.engine.kernels import build


def test_an_extension_that_does_not_load_is_rebuilt_once(tmp_path, monkeypatch, capsys):
    """A garbage compiled .so was kept: the GGUF GEMM silently fell back to dequantized weights, the
    attention said "does not compile here" on every run. Now it is dropped and built again, said."""
    from torch.utils import cpp_extension
    from hdcli.engine.kernels import fused
    folder = tmp_path / "hd_x"
    folder.mkdir()
    (folder / "hd_x.so").write_bytes(b"garbage")
    calls = []

    def load(name, **kw):
        calls.append(name)
        so = folder / f"{name}.so"
        if so.exists() and so.read_bytes() == b"garbage":
            raise ImportError(f"{so}: file too short")
        folder.mkdir(exist_ok=True)
        so.write_bytes(b"ELF")
        return "module"
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(folder))
    monkeypatch.setattr(cpp_extension, "load", load)
    assert build.compile_extension(fused.SOURCE, "hd_x", "the test kernel", quiet=True) == ("module", None)
    assert calls == ["hd_x", "hd_x"]
    err = capsys.readouterr().err
    assert f"warning: {folder / 'hd_x.so'} does not load (ImportError: " in err and "rebuilding the test kernel" in err


def test_two_installs_of_the_same_source_build_one_kernel_from_one_path(tmp_path, monkeypatch):
    """ninja rebuilds where its command changed, and the command names the source's path: two
    installs of the same hd (two virtual environments) built the same extension from their own
    paths and rebuilt each other's kernel at every alternating start. The build reads a copy in
    the extension's own folder: one path whatever the install, written once."""
    from torch.utils import cpp_extension
    from hdcli.engine.kernels import fused
    folder = tmp_path / "hd_z"
    installs = []
    for i in range(2):
        src = tmp_path / f"venv{i}" / "csrc" / fused.SOURCE.name
        src.parent.mkdir(parents=True)
        src.write_bytes(fused.SOURCE.read_bytes())
        installs.append(src)
    built_from = []   # (the source path each build read, its mtime)

    def load(name, sources, **kw):
        built_from.append((sources[0], os.stat(sources[0]).st_mtime_ns))
        return "module"
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(folder))
    monkeypatch.setattr(cpp_extension, "load", load)
    for src in installs + installs:
        assert build.compile_extension(src, "hd_z", "the test kernel", quiet=True) == ("module", None)
    assert {p for p, _ in built_from} == {str(folder / fused.SOURCE.name)}
    assert len({t for _, t in built_from}) == 1   # written once, so ninja sees no change
    assert (folder / fused.SOURCE.name).read_bytes() == fused.SOURCE.read_bytes()


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, monkeypatch, capsys):
    """A process killed while compiling left torch's `lock` file: every later run waited on it
    forever without a word (later, for 3 minutes). Under hd's own lock (free: no live holder) a
    torch lock is a dead build's: removed at once, said in one line; hd's lock file is left empty."""
    from torch.utils import cpp_extension
    from hdcli.engine.kernels import fused
    folder = tmp_path / "hd_y"
    folder.mkdir()
    lock = folder / build.TORCH_LOCK_NAME
    lock.write_bytes(b"")                       # a second ago: its age says nothing
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(folder))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: "module" if not lock.exists() else 1 / 0)
    assert build.compile_extension(fused.SOURCE, "hd_y", "the test kernel", quiet=True) == ("module", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{lock} was left by a build that was killed: taking it" in err[0], err
    assert (folder / build.LOCK_NAME).read_text() == ""
    assert build.compile_extension(fused.SOURCE, "hd_y", "the test kernel", quiet=True) == ("module", None)
    assert capsys.readouterr().err == ""          # a build that ended cleanly leaves nothing to say


def test_a_first_start_builds_the_fused_attention_beside_the_gemm(monkeypatch):
    """At a first start (the GEMM not built) the fused attention's build starts in a thread while
    the GEMM compiles, and the attention's load waits for it and gets its module: the two take
    the longer one's time, not their sum. Built already, or HD_FUSED_ATTENTION=0: no thread."""
    import threading
    from hdcli.engine.kernels import fused, quants
    built: dict = {}
    gemm_running = threading.Event()

    def compile_extension(source, name, what, quiet=False):
        if source == quants.SOURCE:
            gemm_running.set()
            assert built["attention"].wait(60), "the attention's build did not run beside the GEMM's"
            return FakeGemm(), None
        assert gemm_running.wait(60)
        built["thread"] = threading.current_thread().name
        built["attention"].set()
        return FakeAttention(), None

    class FakeGemm:
        supported = supported8 = staticmethod(lambda: True)

    class FakeAttention:
        set_tile = staticmethod(lambda tile: None)
    for module in (fused, quants.build):
        monkeypatch.setattr(module, "compile_extension", compile_extension, raising=False)
    monkeypatch.setattr(quants.build, "is_built", lambda name: False)
    monkeypatch.setattr(fused, "is_built", lambda name: False)
    monkeypatch.delenv("HD_FUSED_ATTENTION", raising=False)
    built["attention"] = threading.Event()
    attention, gemm = fused.AttentionKernel(), quants.GemmKernel()
    monkeypatch.setattr(fused, "KERNEL", attention)
    assert isinstance(gemm.load(), FakeGemm)
    assert isinstance(attention.load(quiet=True), FakeAttention)
    assert built["thread"] == "hd-build-fused-attention"
    # built already, or never to be used: nothing starts
    for built_already, asked in ((True, None), (False, "0")):
        monkeypatch.setattr(fused, "is_built", lambda name, b=built_already: b)
        if asked:
            monkeypatch.setenv("HD_FUSED_ATTENTION", asked)
        other = fused.AttentionKernel()
        other.build_beside()
        assert other._beside is None

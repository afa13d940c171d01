"""llama.cpp's own GGUF converter (convert_hf_to_gguf.py) and quantizer, as a user gets them: the
converter from the llama-cpp-python sdist the `[llama-cpp]` extra builds (vendor/llama.cpp, with the
gguf-py it ships), the quantizer through llama-cpp-python's library call (llama-quantize's).

Used by tests/test_architectures.py to write the files users make from a transformers model, and by
hand:
    python benchmarks/llama_cpp_convert.py HF_FOLDER -o out.gguf [--outtype f32|f16|bf16|q8_0] [--quantize Q4_K_M]

The sdist: $HD_LLAMA_CPP_SDIST, else llama_cpp_python-<version>.tar.gz under .venv/sdist (.ci/run
downloads it there), else None (the tests skip, saying where to put it). Its converter files are
unpacked once into the cache folder (HD_CACHE_DIR/llama-cpp-converter/<version>).

API: sdist(), converter() -> Path | None, convert(hf_dir, out, outtype), convert_many(jobs) (several in one
process), quantize(src, out, ftype).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.3.36"   # the [llama-cpp] extra's pin (pyproject.toml)
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")   # what the converter needs of vendor/llama.cpp


def sdist() -> Path | None:
    env = os.environ.get("HD_LLAMA_CPP_SDIST")
    if env:
        return Path(env) if Path(env).is_file() else None
    path = ROOT / ".venv" / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    return path if path.is_file() else None


def converter() -> Path | None:
    """The folder holding convert_hf_to_gguf.py (unpacked from the sdist once), or None."""
    src = sdist()
    if src is None:
        return None
    sys.path.insert(0, str(ROOT))
    from hdcli.engine.records import cache_dir
    dest = cache_dir() / "llama-cpp-converter" / src.name.removesuffix(".tar.gz")
    done = dest / ".complete"
    if not done.exists():
        prefix = f"{src.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(src) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and any(m.name[len(prefix):].startswith(p) for p in PARTS) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(dest, members=members, filter="data")
        done.write_text("")
    return dest


# Run the converter as its own script, except that where `pre_tokenizer` is given its recognition
# of the tokenizer's pre-tokenizer (a hash of known tokenizers' output) answers that name: a tiny
# test model borrows the bundled SmolLM2 tokenizer, and transformers reads it as Qwen2's where
# config.json says qwen2 (so its hash is no known one). Nothing else of the converter changes.
# Several conversions run in one interpreter, one after the other, as the script runs on each
# (run_path, its argv): what a fresh process would add is the imports (torch, transformers, the
# converter's modules: ~5 s of a ~6 s conversion of a tiny model on the 2-core EPYC). The gguf-py
# the converter ships is first on the path, as the script itself puts it.
_RUN = """import json, runpy, sys
sys.path.insert(0, {folder!r})
sys.path.insert(1, {gguf_py!r})
import conversion.base as base
base_pre = base.TextModel.get_vocab_base_pre
failed = []
for i, (argv, pre) in enumerate({jobs!r}):
    print({mark!r} + str(i), file=sys.stderr, flush=True)
    sys.argv = argv
    base.TextModel.get_vocab_base_pre = (lambda self, tokenizer, pre=pre: pre) if pre else base_pre
    try:
        runpy.run_path({script!r}, run_name="__main__")
    except SystemExit as exc:   # the script's own exit: 0 or None is success
        if exc.code not in (None, 0):
            failed.append(i)
    except BaseException:
        import traceback
        traceback.print_exc()
        failed.append(i)
    sys.stderr.flush()
print(json.dumps(failed))
"""
_MARK = "@@hd-conversion "


def convert_many(jobs) -> list[Path | RuntimeError]:
    """llama.cpp's converter on several (hf_dir, out, outtype, pre_tokenizer) in one process, in
    order: for each, its out Path, or the RuntimeError convert() would raise (the others are
    converted all the same)."""
    import json
    folder = converter()
    if folder is None:
        raise RuntimeError("llama.cpp's converter is not here: put the llama-cpp-python sdist at "
                           f".venv/sdist/ or set HD_LLAMA_CPP_SDIST")
    jobs = [(Path(hf_dir), Path(out), outtype, pre) for hf_dir, out, outtype, pre in jobs]
    script = str(folder / "convert_hf_to_gguf.py")
    argvs = [([script, str(hf_dir), "--outfile", str(out), "--outtype", outtype], pre or "")
             for hf_dir, out, outtype, pre in jobs]
    code = _RUN.format(folder=str(folder), gguf_py=str(folder / "gguf-py"), jobs=argvs, script=script, mark=_MARK)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    errs = {}   # each conversion's stderr: what follows its mark
    for part in proc.stderr.split(_MARK)[1:]:
        i, _, text = part.partition("\n")
        errs[int(i)] = text
    try:
        failed = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):   # the process died: in the conversion it was in, and the later ones
        died = max(errs, default=0)
        failed = set(range(died, len(jobs)))
        errs.update({i: "not run: the converter's process died on an earlier model" for i in range(died + 1, len(jobs))})
    out = []
    for i, (hf_dir, path, _, _) in enumerate(jobs):
        if i in failed or not path.exists():
            why = " | ".join(errs.get(i, "").strip().splitlines()[-4:])
            out.append(RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}: {why}"))
        else:
            out.append(path)
    return out


def convert(hf_dir: Path, out: Path, outtype: str = "f32", pre_tokenizer: str | None = None) -> Path:
    """llama.cpp's converter on a transformers folder; RuntimeError with its last lines if it fails."""
    got = convert_many([(hf_dir, out, outtype, pre_tokenizer)])[0]
    if isinstance(got, RuntimeError):
        raise got
    return got


def quantize(src: Path, out: Path, ftype: str) -> Path:
    """llama.cpp's quantizer (llama-quantize's library call): ftype as llama_cpp's LLAMA_FTYPE_*
    without the prefix, e.g. MOSTLY_Q4_K_M or ALL_F32; requantizing allowed."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--quantize", help="then quantize with llama.cpp, e.g. Q4_K_M")
    a = ap.parse_args()
    try:
        path = convert(a.hf_dir, a.out, a.outtype)
        if a.quantize:
            path = quantize(path, a.out.with_suffix(f".{a.quantize}.gguf"), f"MOSTLY_{a.quantize}")
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    print(path)


if __name__ == "__main__":
    main()

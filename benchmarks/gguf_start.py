"""Memory and start-up of hd on GGUF files of published shapes (random weights in valid blocks,
written by synth_gguf.py): per file, peak resident memory, the first start (nothing cached: the
tokenizer, the M-invariant calibration and self-check, the fused attention's timing) and the
second, and prefill's and plain decoding's tokens/s of hd and of llama.cpp on the same file, in the
same run, with llama.cpp's own load time (its Llama(...) on the file, also a later start).

    python benchmarks/gguf_start.py --shapes smollm2-1.7b --mixes Q4_0,Q4_K_M --out benchmarks/results/gguf/start.json

Each start is a fresh `hd generate --json` process (plain decoding, --layers none), timed from
its launch to its exit; its JSON gives load_seconds and peak_rss_bytes (VmHWM). llama.cpp runs
in another process on the same file (llama-cpp-python, where installed). Speed and memory do
not depend on weight values; acceptance does: never report acceptance from these files.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import synth_gguf  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def log(msg: str) -> None:
    print(f"[gguf_start {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def hd_run(path: Path, cache: Path, tokens: int, timeout: int, prompt: str = PROMPT) -> dict:
    env = dict(os.environ, HD_CACHE_DIR=str(cache))
    hd = str(Path(sys.executable).with_name("hd"))
    cmd = [hd, "generate", "--model", str(path), "-p", prompt, "-n", str(tokens), "--layers", "none",
           "--json", "--max-new-tokens", str(tokens)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                "wall_seconds": wall}
    data = json.loads(out.stdout)
    st = data["stats"]
    decode = st["wall_seconds"] - st["prefill_seconds"]
    return {"wall_seconds": wall, "load_seconds": data["load_seconds"], "load_phases": data.get("load_phases"),
            "layout_cache": data.get("layout_cache"),
            "ready_seconds": data["load_seconds"] + st["prefill_seconds"],   # loaded and the prompt read: its first token
            "peak_rss_bytes": data["peak_rss_bytes"], "prompt_tokens": st["prompt_tokens"],
            "prefill_tokens_per_second": st["prompt_tokens"] / st["prefill_seconds"] if st["prefill_seconds"] else None,
            "new_tokens": st["new_tokens"], "tokens_per_second": st["tokens_per_second"],
            "decode_tokens_per_second": (st["new_tokens"] - 1) / decode if decode > 0 else None,
            "numerics": data.get("numerics"), "invariant": bool((data.get("invariant") or {}).get("self_check"))}


LLAMA_CODE = """
import json, resource, sys, time
from llama_cpp import Llama
t = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads={threads}, verbose=False)
load = time.perf_counter() - t
ids = llm.tokenize(sys.argv[2].encode())
t0 = time.perf_counter(); n = 0; first = None
for tok in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
    n += 1
    if first is None: first = time.perf_counter()
    if n >= int(sys.argv[3]): break
t1 = time.perf_counter()
print(json.dumps({{"load_seconds": load, "prompt_tokens": len(ids), "new_tokens": n, "tokens_per_second": n / (t1 - t0),
                  "prefill_tokens_per_second": len(ids) / (first - t0),   # its first token included
                  "decode_tokens_per_second": (n - 1) / (t1 - first) if n > 1 else None,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def llama_run(path: Path, tokens: int, timeout: int, prompt: str = PROMPT) -> dict:
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        return {"error": "llama-cpp-python not installed (pip install -e '.[llama-cpp]')"}
    import torch
    code = LLAMA_CODE.format(threads=torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", code, str(path), prompt, str(tokens)], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-360m,smollm2-1.7b,llama-3.2-3b,llama-3.1-8b")
    ap.add_argument("--mixes", default="Q4_0,Q4_K_M")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "hd-synth-gguf"),
                    help="where the files are written (kept for later runs)")
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--prompt-file", help="the prompt (default: a one-line story request); a long one measures prefill")
    ap.add_argument("--out", help="write the JSON here (else stdout)")
    args = ap.parse_args(argv)
    from common import machine
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else PROMPT
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        for mix in args.mixes.split(","):
            path = folder / f"{shape}-{mix}.gguf"
            if not path.is_file():
                log(f"writing {path.name}")
                synth_gguf.write(path, shape, mix, seed=0)
            row = {"shape": shape, "mix": mix, "file_bytes": path.stat().st_size}
            with tempfile.TemporaryDirectory(prefix="hd-cache-") as cache:
                log(f"{path.name}: first start (empty cache)")
                row["first"] = hd_run(path, Path(cache), args.tokens, args.timeout, prompt)
                log(f"{path.name}: second start")
                row["second"] = hd_run(path, Path(cache), args.tokens, args.timeout, prompt)
            if not args.no_llama_cpp:
                log(f"{path.name}: llama.cpp")
                row["llama_cpp"] = llama_run(path, args.tokens, args.timeout, prompt)
            hd_tps = row["second"].get("decode_tokens_per_second")
            ll_tps = row.get("llama_cpp", {}).get("decode_tokens_per_second")
            row["hd_over_llama_cpp"] = hd_tps / ll_tps if hd_tps and ll_tps else None
            rss = row["first"].get("peak_rss_bytes")
            row["peak_rss_over_file"] = rss / row["file_bytes"] if rss else None
            log(json.dumps({k: row[k] for k in ("shape", "mix", "peak_rss_over_file", "hd_over_llama_cpp")}))
            results.append(row)
    from common import command_line
    from hdcli.engine.kernels import quants
    out = {"command": command_line("gguf_start.py", args), "machine": machine(), "gemm": quants.gemm_isa(),
           "tokens": args.tokens, "prompt": prompt, "results": results}
    from common import write_result
    write_result(Path(args.out) if args.out else None, out)
    if not args.out:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""hd's own forward (hdcli/engine/model/) on a GPU: does the M-invariant mode hold there, and is
speculative greedy output plain decoding's, token for token?

    python benchmarks/gpu_owned_check.py --gguf tiny.gguf --out owned.json   # tiny: synth_gguf.py --shape tiny --mix all

Per dtype (fp32, bf16): load the file on the device (dense weights: hd's GGUF GEMMs are CPU
kernels), with --invariant on; count verified rows (chains and trees after 40- and 75-token
prefixes) torch.equal to their one-token rows, the same with the mode off (the negative control),
and answers of speculative decoding (oracle drafts, a quarter corrupted, trees) equal to plain.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rows_equal(model, vocab: int, seed: int = 0) -> list[bool]:
    from hdcli.engine.decode import calibrate
    from hdcli.engine.decode.tree import Tree
    rng = random.Random(seed)
    out = []
    for prefix_len in (40, 75):
        prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
        chain = Tree()
        chain.add_candidate([rng.randrange(3, vocab) for _ in range(7)], "x")
        tree = Tree()
        while len(tree.tokens) < 13:
            tree.add(rng.randrange(len(tree.tokens)), rng.randrange(3, vocab), "x")
        for t in (chain, tree):
            out += [eq for eq, _ in calibrate.compare_rows(model, t, prefix)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch
    from common import machine
    from gpu_check import Oracle
    from hdcli.engine import loader
    from hdcli.engine.decode.loop import Decoder
    report = {"machine": machine(), "gguf": args.gguf, "runs": {}}
    for dtype in ("fp32", "bf16"):
        t0 = time.perf_counter()
        lm = loader.load(args.gguf, dtype=dtype, device=args.device, kernels="torch", invariant="auto", quiet=True)
        vocab = lm.model.config.vocab_size
        run = {"invariant": lm.invariant, "info": lm.info.get("invariant"), "numerics": lm.info.get("numerics")}
        rows = rows_equal(lm.model, vocab)
        run["rows_equal"] = [sum(rows), len(rows)]
        rng = random.Random(1)
        same = 0
        for i in range(4):
            prompt = [rng.randrange(3, vocab) for _ in range(20 + 9 * i)]
            ref = Decoder(lm.model, ()).generate(prompt, max_new_tokens=48).tokens
            oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=vocab, seed=i)
            got = Decoder(lm.model, (), drafter=oracle).generate(prompt, max_new_tokens=48).tokens
            same += got == ref
        run["answers_identical"] = [same, 4]
        off = loader.load(args.gguf, dtype=dtype, device=args.device, kernels="torch", invariant="off", quiet=True)
        rows = rows_equal(off.model, vocab)
        run["mode_off_rows_equal"] = [sum(rows), len(rows)]
        run["seconds"] = time.perf_counter() - t0
        report["runs"][dtype] = run
        print(dtype, {k: run[k] for k in ("invariant", "rows_equal", "answers_identical", "mode_off_rows_equal")},
              flush=True)
        del lm, off
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    from common import write_result
    report = json.loads(json.dumps(report, default=str))   # numerics records hold a few non-JSON values
    write_result(Path(args.out) if args.out else None, report)
    if not args.out:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

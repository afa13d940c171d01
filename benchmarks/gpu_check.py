"""The GPU check: is hd exact on CUDA, what does a forward cost there by width, how much of a step
is not the target's forward, and what could any drafting layer gain at most?

    python benchmarks/gpu_check.py --out gpu_check.json           # on a CUDA machine, < 8 minutes
    python benchmarks/gpu_check.py --device cpu --quick --out x.json   # the same code on a CPU, ~1 minute

No weights are downloaded: every model is built from its config with random weights, seeded.
    tiny-llama, tiny-gemma3   exactness (Gemma 3 with a sliding window of 8, so every run passes it)
    smollm2-135m-shape        the bundled model's shape (30 layers, d 576, vocab 49152)
    llama-1b-shape            a Llama-3.2-1B shape (16 layers, d 2048, vocab 128256)
Random weights change no cost and no control flow; where acceptance matters the drafts are the
model's own greedy output ("oracle" drafts), so acceptance is set by the test, not by the weights.

Sections (each a key of the JSON):
  exactness  per model and dtype: hd with drafted chains and with token trees (the reference
             continuation with some tokens corrupted, so that both acceptance and rejection run)
             against plain greedy decoding, token for token; bf16 is counted the way
             docs/dtype.md counts it on a CPU: answers identical, and where the others first differ.
  cost       the least time of a forward over w = 1..64 new tokens with the tree mask (a bushy
             tree of w nodes) on a 256-token cache, relative to w = 1; the chain (causal) curve
             that `hd` measures for itself beside it (engine/decode/costs.py).
  overhead   plain decoding's tokens/s against transformers' generate on the same model; per step
             the time outside the target's forward (step time minus the measured forward of its
             width), plain and with oracle drafts.
  oracle     the speedup over plain decoding when every step drafts the next k tokens of the
             reference exactly (k = 4, 8, 16, 32): each step then keeps k + 1 tokens, so this is
             the bound any drafting layer can reach on this GPU with this model.
Timed runs are interleaved (plain, generate, oracle k..., repeated) and the median is kept.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from hdcli.engine.decode.loop import Decoder, first_difference
from hdcli.engine.decode.draft import Draft, Drafter
from hdcli.engine.decode.tree import Tree, tree_forward
from hdcli.engine.model.target import as_target

from common import machine

ORACLE_KS = (4, 8, 16, 32)


# ---------------------------------------------------------------- models (random weights)

def build(name: str, device: str, seed: int = 0):
    """A random model from its config, built on the device (a 1B model initialised on a CPU takes
    a minute). Tiny models get a sharper head (x4) so that their greedy output is not all ties."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    common = dict(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "tiny-gemma3":
        cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], **common)
        cls = Gemma3ForCausalLM
    else:
        shape = {"tiny-llama": (512, 64, 128, 2, 4, 2),
                 "smollm2-135m-shape": (49152, 576, 1536, 30, 9, 3),
                 "llama-1b-shape": (128256, 2048, 8192, 16, 32, 8)}[name]
        vocab, d, ff, layers, heads, kv = shape
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, rope_theta=100000.0,
                          tie_word_embeddings=name != "tiny-llama", **common)
        cls = LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg).float().eval()
    if name.startswith("tiny"):
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # random weights: run every budget to its end
    return model


def in_dtype(model, dtype: str):
    return model if dtype == "fp32" else model.to(torch.bfloat16)


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(count)]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- oracle drafters

class Oracle(Drafter):
    """Drafts the reference continuation of the prompt: `k` tokens a step as one chain, with each
    token replaced by a random one with probability `corrupt`; branches > 0 adds that many other
    candidates sharing a prefix with it (token trees). Implements engine.decode.draft.Drafter."""

    def __init__(self, reference: list[int], prompt_len: int, k: int, corrupt: float = 0.0,
                 branches: int = 0, vocab: int = 2, seed: int = 0):
        self.ref, self.prompt_len, self.k = reference, prompt_len, k
        self.corrupt, self.branches, self.vocab = corrupt, branches, vocab
        self.rng = random.Random(seed)

    def reset(self, tokens) -> None:
        pass

    def extend(self, tokens) -> None:
        pass

    def _noisy(self, tokens: list[int]) -> list[int]:
        return [self.rng.randrange(self.vocab) if self.rng.random() < self.corrupt else t for t in tokens]

    def propose(self, history, max_len, stats=None) -> list[Draft]:
        at = len(history) - self.prompt_len
        want = self.ref[at:at + min(self.k, max_len)]
        if not want:
            return []
        drafts = [Draft(tuple(self._noisy(want)), "oracle")]
        for _ in range(self.branches):
            cut = self.rng.randrange(len(want))
            drafts.append(Draft(tuple(want[:cut] + self._noisy(want[cut:])) or tuple(want), "oracle"))
        return drafts

    def rate(self, layer, depth=1, first_child=True) -> float:
        return 1.0 - self.corrupt

    def observe(self, tested, accepted) -> None:
        pass


# ---------------------------------------------------------------- 1. exactness

def exactness(model, n_prompts: int, new_tokens: int, vocab: int) -> dict:
    """hd with drafted chains and trees against plain greedy decoding, per prompt."""
    out = {}
    plain_dec = Decoder(model, eos_ids=())
    for mode, branches in (("chains", 0), ("trees", 3)):
        rows = []
        for i, prompt in enumerate(prompts(vocab, n_prompts, 24, seed=1)):
            ref = plain_dec.generate(prompt, max_new_tokens=new_tokens).tokens
            oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=branches, vocab=vocab, seed=i)
            g = Decoder(model, eos_ids=(), drafter=oracle, max_nodes=63).generate(prompt, max_new_tokens=new_tokens)
            rows.append({"first_difference": first_difference(g.tokens, ref),
                         "mean_accepted": statistics.mean(g.stats.accept_lengths),
                         "max_tree": max(g.stats.tree_sizes)})
        out[mode] = {"prompts": len(rows), "identical": sum(r["first_difference"] is None for r in rows),
                     "first_differences": [r["first_difference"] for r in rows if r["first_difference"] is not None],
                     "mean_accepted": statistics.mean(r["mean_accepted"] for r in rows),
                     "max_tree_nodes": max(r["max_tree"] for r in rows)}
    return out


# ---------------------------------------------------------------- 2. cost by width, tree mask

def bushy_tree(w: int, rng: random.Random, vocab: int) -> Tree:
    """w nodes (the root included): a main chain with side branches, as the cost cap sends them."""
    t = Tree()
    while len(t.tokens) < w:
        parent = rng.randrange(len(t.tokens)) if len(t.tokens) > 1 and rng.random() < 0.4 else len(t.tokens) - 1
        t.add(parent, rng.randrange(vocab), "x")
    return t


@torch.inference_mode()
def cost_curve(model, widths, rounds: int, vocab: int, device: str, chain: bool = False) -> dict:
    """Least seconds of a forward over w new tokens on a 256-token cache, over interleaved rounds."""
    rng = random.Random(0)
    model = as_target(model)
    cache = model.new_cache()
    ctx = torch.tensor([prompts(vocab, 1, 257)[0]], device=device)
    model.forward(ctx[:, :-1], cache)
    base = cache.get_seq_length()
    trees = {w: (Tree() if chain else bushy_tree(w, rng, vocab)) for w in widths}
    if chain:
        for w, t in trees.items():
            t.add_candidate([rng.randrange(vocab) for _ in range(w - 1)], "x")
    best = {w: float("inf") for w in widths}
    for r in range(rounds + 1):  # round 0 warms every shape up and is not kept
        for w in widths[r % len(widths):] + widths[:r % len(widths)]:
            sync(device)
            t0 = time.perf_counter()
            tree_forward(model, trees[w], 5, cache)
            sync(device)
            if r:
                best[w] = min(best[w], time.perf_counter() - t0)
            cache.crop(-(cache.get_seq_length() - base))
    return best


def cost_section(model, widths, rounds, vocab, device) -> dict:
    tree = cost_curve(model, widths, rounds, vocab, device)
    chain = cost_curve(model, [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= max(widths)], rounds, vocab, device, chain=True)
    return {"one_token_ms": tree[1] * 1e3,
            "tree_mask": {str(w): tree[w] / tree[1] for w in widths},
            "chain": {str(w): chain[w] / chain[1] for w in chain},
            "seconds": {str(w): tree[w] for w in widths}}


# ---------------------------------------------------------------- 3 + 4. overhead and oracle

def hf_generate(model, prompt, n: int):
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def timed(fn):
    t0 = time.perf_counter()
    got = fn()
    return got, time.perf_counter() - t0


def outside_forward(g, seconds: dict) -> float:
    """Per step: its time minus the measured forward of its width (interpolated between widths)."""
    ws = sorted(int(w) for w in seconds)

    def fwd(w):
        lo = max(x for x in ws if x <= w)
        hi = min((x for x in ws if x >= w), default=lo)
        if hi == lo:
            return seconds[str(lo)]
        f = (w - lo) / (hi - lo)
        return seconds[str(lo)] * (1 - f) + seconds[str(hi)] * f

    steps = len(g.stats.tree_sizes)
    busy = sum(fwd(min(s + 1, ws[-1])) for s in g.stats.tree_sizes)
    return (g.stats.wall_seconds - g.stats.prefill_seconds - busy) / steps


def speed_section(model, new_tokens: int, repeats: int, ks, vocab: int, forward_seconds: dict) -> dict:
    prompt = prompts(vocab, 1, 64, seed=7)[0]
    plain_dec = Decoder(model, eos_ids=())
    ref = plain_dec.generate(prompt, max_new_tokens=new_tokens).tokens
    hf = hf_generate(model, prompt, new_tokens)  # also its warm-up
    methods = {"plain": lambda: plain_dec.generate(prompt, max_new_tokens=new_tokens),
               "transformers_generate": lambda: hf_generate(model, prompt, new_tokens)}
    for k in ks:
        dec = Decoder(model, eos_ids=(), drafter=Oracle(ref, len(prompt), k), max_nodes=max(ks))
        methods[f"oracle_{k}"] = lambda dec=dec: dec.generate(prompt, max_new_tokens=new_tokens)
    times = {m: [] for m in methods}
    last = {}
    for _ in range(repeats):
        for m, fn in methods.items():
            last[m], dt = timed(fn)
            times[m].append(dt)
    tps = {m: new_tokens / statistics.median(ts) for m, ts in times.items()}
    out = {"new_tokens": new_tokens, "tokens_per_second": tps,
           "plain_over_transformers": tps["plain"] / tps["transformers_generate"],
           "transformers_first_difference": first_difference(hf, ref),
           "plain_step_ms": 1e3 * statistics.median(times["plain"]) / new_tokens,
           "plain_outside_forward_ms": 1e3 * outside_forward(last["plain"], forward_seconds), "oracle": {}}
    for k in ks:
        g = last[f"oracle_{k}"]
        out["oracle"][str(k)] = {"speedup": tps[f"oracle_{k}"] / tps["plain"],
                                 "mean_accepted": statistics.mean(g.stats.accept_lengths),
                                 "identical": g.tokens == ref,
                                 "outside_forward_ms": 1e3 * outside_forward(g, forward_seconds)}
    return out


# ---------------------------------------------------------------- main

def plan(args) -> dict:
    if args.quick:
        return {"exact_models": ["tiny-llama", "tiny-gemma3"], "speed_models": ["tiny-llama"],
                "widths": [1, 2, 3, 4, 8, 16], "rounds": 2, "prompts": 2, "exact_tokens": 24,
                "speed_tokens": 16, "repeats": 1, "ks": [4, 8]}
    return {"exact_models": ["tiny-llama", "tiny-gemma3", "smollm2-135m-shape"],
            "speed_models": ["smollm2-135m-shape", "llama-1b-shape"],
            "widths": list(range(1, 65)), "rounds": 5, "prompts": 6, "exact_tokens": 96,
            "speed_tokens": 128, "repeats": 3, "ks": list(ORACLE_KS)}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args) -> dict:
    p = plan(args)
    dtypes = args.dtypes.split(",")
    result = {"machine": machine(), "device": args.device, "plan": p, "exactness": {}, "cost": {}, "speed": {}}
    for name in p["exact_models"]:
        for dt in dtypes:
            log(f"exactness {name} {dt}")
            model = in_dtype(build(name, args.device), dt)
            result["exactness"][f"{name}/{dt}"] = exactness(model, p["prompts"], p["exact_tokens"], model.config.vocab_size)
            del model
    for name in p["speed_models"]:
        for dt in dtypes:
            log(f"cost curve {name} {dt}")
            model = in_dtype(build(name, args.device), dt)
            vocab = model.config.vocab_size
            cost = result["cost"][f"{name}/{dt}"] = cost_section(model, p["widths"], p["rounds"], vocab, args.device)
            log(f"speed {name} {dt}")
            result["speed"][f"{name}/{dt}"] = speed_section(model, p["speed_tokens"], p["repeats"], p["ks"], vocab, cost["seconds"])
            del model
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    return result


def summary_lines(r: dict) -> list[str]:
    lines = [f"device {r['device']}: {r['machine']['gpu'] or r['machine']['cpu']}"]
    for key, ex in r["exactness"].items():
        lines.append(f"exact {key:28s} " + "  ".join(f"{m} {v['identical']}/{v['prompts']} identical" for m, v in ex.items()))
    for key, c in r["cost"].items():
        picks = "  ".join(f"w{w} {c['tree_mask'][str(w)]:.2f}" for w in (2, 8, 16, 32, 64) if str(w) in c["tree_mask"])
        lines.append(f"cost  {key:28s} one token {c['one_token_ms']:.2f} ms  {picks}")
    for key, s in r["speed"].items():
        tps = s["tokens_per_second"]
        lines.append(f"speed {key:28s} plain {tps['plain']:.1f} tok/s, transformers {tps['transformers_generate']:.1f} "
                     f"({s['plain_over_transformers']:.2f}x); outside forward {s['plain_outside_forward_ms']:.2f} ms/step; "
                     "oracle " + "  ".join(f"k{k} {o['speedup']:.2f}x" for k, o in s["oracle"].items()))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run of the same code)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--quick", action="store_true", help="tiny models only, few widths and tokens (tests)")
    ap.add_argument("--out", help="write the JSON here (else to stdout)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible to torch; run it on a GPU machine, or --device cpu "
              "for a dry run", file=sys.stderr)
        return 2
    bad = [d for d in args.dtypes.split(",") if d not in ("fp32", "bf16")]
    if bad:
        print(f"gpu_check: --dtypes takes fp32 and/or bf16, not {','.join(bad)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The model DB: n-grams the target model itself tends to write.

Built in two separate steps so that each can be re-run alone:
  1. sample(): generate answers to a prompt set with the target model, batched (left padding),
     appending every finished batch to a samples jsonl file. Batches are fixed by prompt index and
     seeded by batch index, so an interrupted run resumed with `resume=True` produces exactly the
     samples an uninterrupted run would have (a half-written batch is dropped and redone);
  2. index(): count the samples' n-gram continuations into the same LMDB store format as the
     statistics DB (hdcli/db/stores.py, built by hdcli/db/statsdb.py), with kind "model".
`hd generate --model-db DB --learn` later adds what the model generated (statsdb.add_counts).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import statsdb
from ..errors import HdError

# 320 prompts we wrote (code, math, summaries, explanations, writing, advice, extraction, translation),
# shipped as package data so that `hd build-model-db -o model.lmdb` works from an installed wheel
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "model_db_prompts.jsonl"


def load_prompts(path: str | Path | None = None, num_prompts: int | None = None) -> tuple[list[str], str]:
    """Prompts from a jsonl file (field `prompt`, first of `turns`, or `text`); returns
    (prompts, source description)."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise HdError(f"prompt file {path} does not exist" + ("" if path != DEFAULT_PROMPTS else
                      " (the default prompt set ships with hd in hdcli/data/: reinstall hd, or pass --prompts FILE)"))
    prompts = []
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # -sig: a BOM is not data
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise HdError(f"{path}:{lineno}: malformed JSON line") from None
            text = None
            if isinstance(rec, dict):
                if isinstance(rec.get("prompt"), str):
                    text = rec["prompt"]
                elif isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
                    text = rec["turns"][0]
                elif isinstance(rec.get("text"), str):
                    text = rec["text"]
            if text is None:
                fields = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
                raise HdError(f"{path}:{lineno}: no 'prompt', 'turns' or 'text' field (fields: {fields})")
            if text.strip():
                prompts.append(text)
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise HdError(f"{path} holds no prompts")
    return prompts, str(path)


def _read_samples(path: Path) -> list[dict]:
    """Valid sample lines; a torn last line (killed mid-write) is ignored."""
    out = []
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "batch" in rec and "tokens" in rec:
                    out.append(rec)
    return out


def sample(lm, prompts: list[str], samples_path: str | Path, *, max_new_tokens: int = 256,
           temperature: float = 0.8, top_p: float = 0.95, batch_size: int = 8, seed: int = 0,
           resume: bool = False, progress: Callable[[int, int], None] | None = None,
           stop_after: int | None = None) -> dict:
    """Generate answers to `prompts` in batches and append them to `samples_path`.
    progress(prompts_done, new_tokens) after each batch. stop_after: stop after that many new
    batches (for tests of resume). Returns throughput figures."""
    from ..engine.prompts import encode_prompt
    samples_path = Path(samples_path)
    if batch_size < 1 or max_new_tokens < 1:
        raise HdError("--batch-size and --max-new-tokens must be >= 1")
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    done: set[int] = set()
    if samples_path.exists() and samples_path.stat().st_size and not resume:
        raise HdError(f"{samples_path} already holds samples: pass --resume to continue it, or "
                      "another --samples path")
    if resume:
        recs = _read_samples(samples_path)
        per_batch: dict[int, int] = {}
        for r in recs:
            per_batch[r["batch"]] = per_batch.get(r["batch"], 0) + 1
        done = {b for b, n in per_batch.items() if b < len(batches) and n == len(batches[b])}
        keep = [r for r in recs if r["batch"] in done]
        tmp = samples_path.with_name(samples_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:  # drop a half-written batch, atomically
            for r in keep:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, samples_path)
    tok, model = lm.tokenizer, lm.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(lm.eos_ids))
    eos = lm.eos_ids
    prompts_done = sum(len(batches[b]) for b in done)
    new_tokens, t0, ran = 0, time.perf_counter(), 0
    with open(samples_path, "a", encoding="utf-8") as f:
        for b, idx in enumerate(batches):
            if b in done:
                continue
            if stop_after is not None and ran >= stop_after:
                break
            ids = [encode_prompt(tok, prompts[i]) for i in idx]
            width = max(map(len, ids))
            inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=lm.device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=lm.device)
            torch.manual_seed(seed * 1_000_003 + b)  # per-batch seed: a resumed run redoes it identically
            kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
                else dict(do_sample=False)
            with torch.inference_mode():
                if hasattr(model, "forward_many"):   # hd's own forward: each prompt decoded by hd
                    out = _decode_each(lm, ids, width, pad, max_new_tokens, temperature, top_p,
                                       seed * 1_000_003 + b)
                else:
                    out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_new_tokens,
                                         pad_token_id=pad, **kw)
            for row, i in enumerate(idx):
                gen = out[row, width:].tolist()
                cut = next((j for j, t in enumerate(gen) if t in eos), len(gen))
                gen = gen[:cut]
                new_tokens += len(gen)
                f.write(json.dumps({"batch": b, "index": i, "prompt": prompts[i], "tokens": gen}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            ran += 1
            prompts_done += len(idx)
            if progress:
                progress(prompts_done, new_tokens)
    wall = time.perf_counter() - t0
    return {"batches_run": ran, "new_tokens": new_tokens, "seconds": wall,
            "tokens_per_second": new_tokens / wall if wall else 0.0, "prompts_done": prompts_done,
            "prompts_total": len(prompts)}


def sample_tokens(samples_path: str | Path) -> Iterator[list[int]]:
    for rec in sorted(_read_samples(Path(samples_path)), key=lambda r: r["index"]):
        yield rec["tokens"]


def index(samples_path: str | Path, out: str | Path, tokenizer, model_name: str, *,
          header: dict | None = None, overwrite: bool = False, **params) -> dict:
    """Count the samples' n-gram continuations into a model DB at `out`."""
    samples_path = Path(samples_path)
    if not samples_path.is_file():
        raise HdError(f"samples file {samples_path} does not exist")
    return statsdb.build(sample_tokens(samples_path), out, tokenizer, model_name, tokenized=True,
                         kind="model", overwrite=overwrite,
                         extra_header={"samples": str(samples_path), **(header or {})}, **params)


def _decode_each(lm, ids, width: int, pad: int, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int) -> torch.Tensor:
    """transformers' generate's output shape ([rows, width + new], prompts left-padded, answers
    padded after EOS) from hd's own decode loop, one prompt at a time (plain decoding: the model
    DB holds what the target writes)."""
    from ..engine.decode import Decoder
    from ..engine.verify import Sampling
    sampling = Sampling(temperature=temperature, top_p=top_p) if temperature > 0 else Sampling()
    dec = Decoder(lm.model, lm.eos_ids)
    rows = []
    for i, x in enumerate(ids):
        got = dec.generate(x, max_new_tokens, sampling, seed=seed + i).tokens
        rows.append([pad] * (width - len(x)) + list(x) + got + [pad] * (max_new_tokens - len(got)))
    return torch.tensor(rows)

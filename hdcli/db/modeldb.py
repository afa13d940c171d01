"""The model DB: what the target model itself wrote, its answers kept whole and counted as n-grams.

Built in two separate steps so that each can be re-run alone:
  1. sample(): generate answers to a prompt set with the target model (greedy by default: the
     answer plain greedy decoding gives, which is what a greedy run will verify), appending every
     finished batch to a samples jsonl file. On hd's own forward each answer is decoded with hd's
     speculative decoding (exact: the same tokens as plain decoding, faster). Batches are fixed by
     prompt index and seeded by batch index, and every sample records its prompt and the sampling
     settings, so an interrupted run resumed with `resume=True` produces exactly the samples an
     uninterrupted run would have (a half-written batch is dropped and redone), and a resume with
     other prompts or settings is refused instead of mixing two runs;
  2. index(): the answers kept whole (what the model layer's suffix index drafts from,
     hdcli/drafting/model.py) and their n-gram continuations, in the same LMDB store format as the
     statistics DB (hdcli/db/stores.py, built by hdcli/db/statsdb.py), with kind "model".
`hd generate --model-db DB --learn` later adds what the model generated (learn, below).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from . import statsdb
from .. import inputs
from ..engine.decode.verify import Sampling
from ..engine.model import is_owned
from ..errors import HdError

# 320 prompts we wrote (code, math, summaries, explanations, writing, advice, extraction, translation),
# shipped as package data so that `hd build-model-db -o model.lmdb` works from an installed wheel
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "model_db_prompts.jsonl"
SAMPLE_TOP_P = 0.95   # hd build-model-db's --top-p: where it samples, the answers' nucleus


def load_prompts(path=None, num_prompts: int | None = None) -> tuple[list[str], str]:
    """Prompts from jsonl files (field `prompt`, first of `turns`, or `text`): one path, a list of
    paths (read in order), or None for the shipped set; returns (prompts, source description)."""
    if isinstance(path, (list, tuple)):
        if not path:
            return load_prompts(None, num_prompts)
        prompts, sources = [], []
        for one in path:
            got, src = load_prompts(one, None if num_prompts is None else num_prompts - len(prompts))
            prompts += got
            sources.append(src)
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
        return prompts, ", ".join(sources)
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise HdError(f"prompt file {path} does not exist" + ("" if path != DEFAULT_PROMPTS else
                      " (the default prompt set ships with hd in hdcli/data/: reinstall hd, or pass --prompts FILE)"))
    prompts = []
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # -sig: a BOM is not data
        # a line read no further than a prompt's bound: a file of zeros has no line end
        for lineno, line in enumerate(iter(lambda: f.readline(inputs.TEXT_BYTES + 1), ""), 1):
            if len(line) > inputs.TEXT_BYTES:
                raise HdError(f"{path}:{lineno}: a line over {inputs.size_text(inputs.TEXT_BYTES)}; "
                              "that is past any model's context (one prompt a line)")
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
           temperature: float = Sampling().temperature, top_p: float = SAMPLE_TOP_P, batch_size: int = 8, seed: int = 0,
           resume: bool = False, progress: Callable[[int, int], None] | None = None,
           stop_after: int | None = None, drafter_factory: Callable | None = None) -> dict:
    """Generate answers to `prompts` in batches and append them to `samples_path`, greedy by
    default (temperature: the declaration's, hd build-model-db's: a greedy run verifies the
    target's greedy answers; top_p where it samples: SAMPLE_TOP_P, hd build-model-db's --top-p).
    progress(prompts_done, new_tokens) after each batch. stop_after: stop after that many new
    batches (for tests of resume). drafter_factory: a new drafter per answer on hd's own forward
    (commands/db.build_model_db passes the default hierarchy: speculative, the same tokens), None for plain
    decoding. Returns throughput figures."""
    from ..engine.text.prompts import encode_prompt
    samples_path = Path(samples_path)
    if batch_size < 1 or max_new_tokens < 1:
        raise HdError("--batch-size and --max-new-tokens must be >= 1")
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    done: set[int] = set()
    if samples_path.exists() and samples_path.stat().st_size and not resume:
        raise HdError(f"{samples_path} already holds samples: pass --resume to continue it, or "
                      "another --samples path")
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "batch_size": batch_size, "seed": seed}
    if resume:
        recs = _read_samples(samples_path)
        check_resume(samples_path, recs, prompts, settings)
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
                if is_owned(model):   # hd's own forward: each prompt decoded by hd
                    out = _decode_each(lm, ids, width, pad, max_new_tokens, temperature, top_p,
                                       seed * 1_000_003 + b, drafter_factory)
                else:
                    out = model.module.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                pad_token_id=pad, **kw)
            for row, i in enumerate(idx):
                gen = out[row, width:].tolist()
                cut = next((j for j, t in enumerate(gen) if t in eos), len(gen))
                gen = gen[:cut]
                new_tokens += len(gen)
                f.write(json.dumps({"batch": b, "index": i, "prompt": prompts[i], "tokens": gen,
                                    "settings": settings}) + "\n")
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


def check_resume(path: Path, recs: list[dict], prompts: list[str], settings: dict) -> None:
    """Refuse to continue a samples file made with other prompts or sampling settings: resuming
    would mix two runs into one DB whose header describes only the second."""
    for r in recs:
        old = r.get("settings")
        if not isinstance(old, dict):
            raise HdError(f"{path} was written by an older hd (its samples record no settings): "
                          "start afresh with --overwrite or another --samples path")
        differ = [k for k in settings if old.get(k) != settings[k]]
        if differ:
            was = ", ".join(f"{k} {old.get(k)!r} (now {settings[k]!r})" for k in differ)
            raise HdError(f"cannot --resume {path}: its samples were made with {was}; resume with "
                          "the same options, or start afresh with --overwrite")
        i = r.get("index")
        if not isinstance(i, int) or i >= len(prompts) or prompts[i] != r.get("prompt"):
            raise HdError(f"cannot --resume {path}: its sample {i} was made for another prompt than "
                          "this run's (another --prompts file or --num-prompts?); resume with the same "
                          "prompts, or start afresh with --overwrite")


def sample_tokens(samples_path: str | Path) -> Iterator[list[int]]:
    for rec in sorted(_read_samples(Path(samples_path)), key=lambda r: r["index"]):
        yield rec["tokens"]


def index(samples_path: str | Path, out: str | Path, tokenizer, model_name: str, *,
          header: dict | None = None, overwrite: bool = False, **params) -> dict:
    """Count the samples' n-gram continuations into a model DB at `out`."""
    samples_path = Path(samples_path)
    if not samples_path.is_file():
        raise HdError(f"samples file {samples_path} does not exist")
    answers = list(sample_tokens(samples_path))
    return statsdb.build(answers, out, tokenizer, model_name, tokenized=True, sequences=answers,
                         kind="model", overwrite=overwrite,
                         extra_header={"samples": str(samples_path), **(header or {})}, **params)


def _decode_each(lm, ids, width: int, pad: int, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, drafter_factory: Callable | None = None) -> torch.Tensor:
    """transformers' generate's output shape ([rows, width + new], prompts left-padded, answers
    padded after EOS) from hd's own decode loop, one prompt at a time (the model DB holds what the
    target writes). With drafter_factory each answer is decoded speculatively: faster, and none of
    its tokens (greedy) or of their distribution (sampled) changes."""
    from ..engine.decode import costs
    from ..engine.decode.loop import Decoder
    sampling = Sampling(temperature=temperature, top_p=top_p) if temperature > 0 else Sampling()
    cost = costs.curve_for(lm) if drafter_factory else None
    rows = []
    for i, x in enumerate(ids):
        dec = Decoder(lm.model, lm.eos_ids, drafter_factory() if drafter_factory else None, cost=cost)
        got = dec.generate(x, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed + i).tokens
        rows.append([pad] * (width - len(x)) + list(x) + got + [pad] * (max_new_tokens - len(got)))
    return torch.tensor(rows)


def learn(model_db, prompt_ids: Sequence[int], tokens: Sequence[int], scope: bytes | None = None) -> int:
    """Add a generation to the model DB: the answer whole (what the model layer's suffix index
    drafts from, where the DB keeps answers) and its n-grams (keys may start in the prompt's last
    tokens, continuations are generated tokens only). Returns keys touched. The running process's
    index already holds the answer (drafting.model.ModelLayer adds it as it is accepted).
    scope: a tenant's tag (hd serve --learn-scope key|user): the answer is kept for that tenant
    alone, and no n-gram is counted (the n-gram table is shared by every request)."""
    kind = model_db.header.get("kind")
    if kind != "model":
        raise HdError(f"{model_db.path} is a {kind or 'unknown'} DB, not a model DB: --learn writes only "
                      "into a DB built by `hd build-model-db` (pass a statistics DB with --stats-db)")
    if scope is not None:
        return model_db.add_sequences([list(tokens)], scope=scope) if tokens else 0
    max_n = int(model_db.header["n_range"][1])
    context = list(prompt_ids[-max_n:]) if prompt_ids else []
    doc = context + list(tokens)
    # counting starts where a continuation is generated: drop keys that end before the output;
    # the answer whole and its n-grams in one transaction
    return statsdb.add_counts(model_db, [doc], first_end=len(context) - 1,
                              answers=[list(tokens)] if model_db.sequence_count and tokens else [])

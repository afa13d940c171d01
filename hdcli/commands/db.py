"""The DB commands as the CLI and the Python API call them: `hd build-stats` (build_stats,
parse_shard), `hd build-model-db` (build_model_db), `hd db info` (db_info) and `hd db query`
(db_query). Above the composition they use (a model DB's sampling drafts with the default
hierarchy; a query drafts as the stats layer does), hence apart from the store modules below it.
"""
from __future__ import annotations

import math

from pathlib import Path
from typing import Sequence

from ..compose import DBs, build_drafter, load_model_for
from ..config import DecodingConfig
from ..drafting import RecycledTable, StatsLayer
from ..engine import loader
from ..errors import HdError
from ..db import corpus as corpus_mod
from ..db import modeldb, statsdb
from ..db.atomic import check_output_path
from ..db.stores import Store


def parse_shard(shard: str | None) -> tuple[int, int]:
    """--shard I/N as (I, N); None: the whole corpus, (0, 1)."""
    if shard is None:
        return 0, 1
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise HdError(f"--shard must look like I/N (e.g. 0/4), not '{shard}'") from None
    if not (n >= 1 and 0 <= i < n):
        raise HdError(f"--shard {shard}: need 0 <= I < N")
    return i, n


def build_stats(corpus: Sequence[str], out, model: str = loader.DEFAULT_MODEL, *, field: str = "text",
                with_prompt: bool = False, limit: int | None = None, shard: tuple[int, int] = (0, 1),
                strict: bool = False, num_proc: int = 1, chunk_tokens: int = 4_000_000,
                overwrite: bool = False, progress=None, **params) -> tuple[dict, dict]:
    """Count a corpus into a statistics DB at `out` in this process (what `hd build-stats` and
    each task of a cluster build run). params: min_n, max_n, draft_len, top_k, min_count.
    Returns (header, read report: skipped and replaced counts, the first malformed record)."""
    texts, report = corpus_mod.read_corpus(list(corpus), field=field, with_prompt=with_prompt,
                                           limit=limit, shard=shard, strict=strict)
    tok = loader.load_tokenizer(model)
    try:
        header = statsdb.build(texts, out, tok, model, shard=shard, chunk_tokens=chunk_tokens,
                               num_proc=num_proc, overwrite=overwrite, progress=progress,
                               extra_header={"sources": report.files, "field": field,
                                             "with_prompt": with_prompt}, **params)
    except HdError as exc:
        if "no documents" in str(exc):  # name what was read and what was skipped
            raise corpus_mod.no_documents(report.files, corpus, field, report.counts()) from None
        raise
    return header, report.counts()


def build_model_db(out: Path, cfg: DecodingConfig, *, prompts: Path | None = None,
                   num_prompts: int | None = None, batch_size: int = 16, samples: Path | None = None,
                   resume: bool = False, from_samples: Path | None = None, overwrite: bool = False,
                   progress=None, **params) -> dict:
    """hd build-model-db: sample the target (cfg: model, dtype, kernels, sampling, seed,
    max_new_tokens) on a prompt set and index what it wrote into a model DB at out (or only
    index a samples file). params: min_n, max_n, top_k, min_count. progress(done, tokens, total)."""
    cfg.validate()
    check_output_path(out, overwrite)
    if from_samples is not None:
        tok = loader.load_tokenizer(cfg.model)
        return {"path": str(out), "header": modeldb.index(from_samples, out, tok, cfg.model,
                                                          overwrite=overwrite, **params)}
    prompt_list, source = modeldb.load_prompts(prompts, num_prompts)
    samples = samples or out.with_name(out.name + ".samples.jsonl")
    if overwrite and not resume and samples.exists():
        samples.unlink()  # --overwrite starts the whole build afresh
    lm = load_model_for(cfg)
    table = RecycledTable()   # the default hierarchy, its recycled predictions shared by the answers
    run = modeldb.sample(lm, prompt_list, samples, max_new_tokens=cfg.max_new_tokens,
                         temperature=cfg.temperature, top_p=cfg.top_p, batch_size=batch_size,
                         seed=cfg.seed or 0, resume=resume,
                         drafter_factory=lambda: build_drafter(DecodingConfig(), lm, DBs(), recycle_table=table),
                         progress=progress and (lambda done, tokens: progress(done, tokens, len(prompt_list))))
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                "batch_size": batch_size, "seed": cfg.seed or 0, "dtype": lm.dtype}
    header = modeldb.index(samples, out, lm.tokenizer, cfg.model, overwrite=overwrite,
                           header={"sampling": sampling, "prompt_source": source,
                                   "prompts": len(prompt_list)}, **params)
    return {"path": str(out), "sampling": run, "header": header}


def db_info(path: Path, verify: bool = False) -> dict:
    """hd db info: a DB's header, size figures and content digest (it identifies the counts whatever
    the page layout or build time: a cluster build and a local build of one corpus have the same
    one); with verify, every record read and checked against it."""
    db = Store(path)
    info = {"header": db.header, "size": db.size_info(), "content_digest": db.header.get("content_digest")}
    if verify:
        info["verify"] = db.verify()
    return info


def db_query(path: Path, text: str, model: str | None = None, *, max_len: int = 16, min_prob: float = 0.0) -> dict:
    """hd db query: each key of the text's end the DB holds (longest first) with its
    continuations, and the draft it would give (tokenized by `model`, default the DB's)."""
    if not (math.isfinite(min_prob) and 0 <= min_prob <= 1):
        raise HdError(f"--min-prob must be a finite number between 0 and 1, not {min_prob}")
    db = Store(path)
    tok = loader.load_tokenizer(model or db.header.get("model", loader.DEFAULT_MODEL))
    db.check_tokenizer(tok, model or db.header.get("model", ""))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise HdError("--text is empty")
    keys = []
    for n in range(min(db.max_n, len(ids)), db.min_n - 1, -1):
        got = db.get(ids[-n:])
        keys.append({"n": n, "key": tok.decode(ids[-n:]), "key_ids": ids[-n:], "found": got is not None,
                     "total": got[0] if got else 0,
                     "continuations": [{"text": tok.decode(c), "ids": c, "count": k}
                                       for c, k in (got[1] if got else [])]})
    draft = StatsLayer(db, min_prob=min_prob).candidates(ids, max_len, 1)
    return {"keys": keys, "draft": tok.decode(draft[0]) if draft else "", "draft_ids": draft[0] if draft else []}

"""`hd plan` as the CLI and the Python API call it: the draft models named, the calibration prompts
read, costs and acceptance measured, the fastest hierarchy chosen and saved (planner.py holds the
model and the search; this module puts a run of them together, above the composition it uses).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .. import inputs
from ..bench import specbench
from ..compose import (Status, build_drafter, cheap_verification, check_tokenizers, db_hierarchy,
                       load_model_for, open_dbs, resolved, warm_up)
from ..config import DecodingConfig, level_problems, split_list
from ..engine import loader
from ..engine.text.prompts import encode_prompt
from ..errors import HdError
from ..hsd import draft_models as draftmodels
from ..hsd import planner


def draft_model_names(draft_models: str | Sequence[str]) -> list[str]:
    """'a, b' or ['a', 'b'] -> ['a', 'b'], refusing an empty list (before any model loads)."""
    names = split_list(draft_models) if isinstance(draft_models, str) else [n.strip() for n in draft_models]
    bad = level_problems(names, ())
    if bad:
        raise HdError(bad[0])
    return [n for n in names if n]


def calibration_prompts(lm: loader.LoadedModel, prompts: Path | None, count: int) -> list[list[int]]:
    """Token ids of the calibration prompts (calibration_texts)."""
    return [encode_prompt(lm.tokenizer, t) for t in calibration_texts(prompts, count)]


def calibration_texts(prompts: Path | None, count: int) -> list[str]:
    """The calibration prompts: a jsonl (field prompt, text or turns) or text file (one prompt
    per blank-line-separated block), else the first question of Spec-Bench's categories
    (round-robin) when its file is found; read before any model loads."""
    texts = []
    if prompts is not None:
        raw = inputs.read_text(prompts, "--prompts", inputs.TEXT_BYTES, "calibration needs a few prompts: pass fewer")
        if Path(prompts).suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                        texts.append(rec.get("prompt") or rec.get("text") or rec["turns"][0])
                    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                        raise HdError(f"{prompts}:{n}: need a JSON object with 'prompt', 'text' or 'turns'") from None
        else:
            texts = [b.strip() for b in raw.split("\n\n") if b.strip()]
    else:
        qs = specbench.select(specbench.load(specbench.find(None)), 1)
        texts = [q["turns"][0] for q in qs]
    if not texts:
        raise HdError(f"no prompts in {prompts}")
    return texts[:count]


def plan(cfg: DecodingConfig, draft_models: str | Sequence[str], *, prompts: Path | None = None,
         count: int = 6, tokens: int = 64, t_max: int = 12, no_db: bool = False, measure_top: int = 3,
         max_new_tokens: int = 128, out_path: Path | None = None,
         on_status: Status = lambda m: None) -> dict:
    """hd plan: measure costs and acceptance of the draft models (and of the configuration's DB
    hierarchy as one chain), predict every hierarchy's speed, choose the fastest (DP), run the
    best `measure_top` and the references, and save the choice to out_path."""
    if t_max < 1 or count < 1 or tokens < 2:
        raise HdError("--t-max and --count must be >= 1, --tokens >= 2")
    names = draft_model_names(draft_models)
    texts = calibration_texts(prompts, count)   # a bad prompts file is said before minutes of loading
    dbs = open_dbs(cfg)
    on_status(f"loading {cfg.model} ...")
    lm = load_model_for(cfg)
    check_tokenizers(dbs, lm)
    # the DB level: context, then the DBs given, as one chain
    db_cfg = cfg.replace(layers=["context"] + ["model"] * (dbs.model is not None) + ["stats"] * bool(dbs.stats),
                         candidates=1)
    cheap = cheap_verification(lm)
    db_factory = None if no_db else (lambda: db_hierarchy(db_cfg, dbs, cheap))
    ids = [encode_prompt(lm.tokenizer, t) for t in texts]
    loaded = {}
    for n in names:
        on_status(f"loading draft {n} ...")
        loaded[n] = draftmodels.load(n, lm)
    on_status("measuring forward costs and acceptance ...")
    params, info = planner.measure(lm, [loaded[n] for n in names], db_factory, ids, tokens=tokens,
                                   t_max=t_max, progress=on_status)
    best, best_v = planner.dp(params, t_max)
    rows = planner.ranked_rows(params, t_max, best_v)
    if measure_top > 0:
        warm_up(lm)
        for r in planner.rows_to_measure(rows, measure_top):
            on_status(f"measuring {r['hierarchy']} ...")
            chain = r["chain"]
            run_cfg = db_cfg.replace(draft_models=[lv["model"] for lv in chain["levels"]],
                                     level_tokens=[lv["T"] for lv in chain["levels"]],
                                     no_db=chain["bottom"] == "none" and bool(chain["levels"]),
                                     layers=db_cfg.layers if chain["bottom"] == "db" else [])
            drafter = build_drafter(run_cfg, lm, dbs, loaded=loaded)
            r["measured_tokens_per_second"] = planner.measured_speed(lm, drafter, ids, max_new_tokens)
    result = {"kind": "hd-plan", "target": lm.name, "dtype": lm.dtype, "device": lm.device,
              "kernels": lm.kernels, "draft_models": names, "db_layers": [] if no_db else db_cfg.layers,
              # absolute: `hd generate --plan` opens these DBs from wherever it runs
              "stats_dbs": [str(Path(p).resolve()) for p in cfg.stats_dbs],
              "model_db": str(Path(cfg.model_db).resolve()) if cfg.model_db else None,
              "db_digests": {str(db.path.resolve()): db.header.get("content_digest") for db in dbs.all()},
              "chain": best.to_dict(), "hierarchy": best.describe(), "predicted_tokens_per_second": best_v,
              "plain_tokens_per_second_predicted": params.cost["target"](1) ** -1, "t_max": t_max,
              "calibration": {"prompts": len(ids), **info,
                              "draft_params": {n: loaded[n].params for n in names}},
              "candidates": rows, "config": resolved(db_cfg, lm, dbs).to_dict()}
    if out_path is not None:
        tmp = Path(out_path).with_name(Path(out_path).name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out_path)
    return result

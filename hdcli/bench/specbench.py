"""Spec-Bench questions: finding the file, reading it, picking questions per category.

Spec-Bench (Xia et al., 2024) has 480 questions in six categories: mt_bench (80 two-turn
questions from MT-Bench's eight sub-categories: writing, roleplay, reasoning, math, coding,
extraction, stem, humanities), translation, summarization, qa, math_reasoning and rag (80 each).
Its question.jsonl names the MT-Bench sub-category in `category`; we report them as mt_bench, the
way Spec-Bench's tables do.
"""
from __future__ import annotations

import json
from itertools import zip_longest
from pathlib import Path

from .. import inputs
from ..errors import HdError

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SHORT_NAMES = {"mt_bench": "MT", "translation": "Trans.", "summarization": "Sum.", "qa": "QA",
               "math_reasoning": "Math", "rag": "RAG"}  # the column names of Spec-Bench's tables
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
RELATIVE = Path("data/spec_bench/question.jsonl")
WHERE = ("Spec-Bench's question.jsonl is at https://github.com/hemingkx/Spec-Bench "
         "(data/spec_bench/question.jsonl); pass it with --data PATH")


def category(raw: str) -> str:
    return "mt_bench" if raw in MT_BENCH else raw


def find(data: str | Path | None = None) -> Path:
    """--data, else data/spec_bench/question.jsonl under the working folder or ../shared/."""
    if data is not None:
        p = Path(data)
        if p.is_dir():
            p = p / "question.jsonl"
        if not p.is_file():
            raise HdError(f"Spec-Bench file {p} not found. {WHERE}")
        return p
    for root in (Path.cwd(), Path.cwd() / ".." / "shared", Path.cwd() / "shared"):
        if (root / RELATIVE).is_file():
            return (root / RELATIVE).resolve()
    raise HdError(f"no {RELATIVE} under the working folder or ../shared/. {WHERE}")


def load(path: str | Path) -> list[dict]:
    """Questions in file order, each {question_id, category (mapped), subcategory, turns}."""
    out = []
    lines = inputs.read_text(path, "Spec-Bench file", inputs.BENCH_BYTES, "pass a smaller question set").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError:
            raise HdError(f"{path}:{n}: not a JSON line") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise HdError(f"{path}:{n}: field 'turns' must be a non-empty list of strings")
        if not isinstance(q.get("category"), str):
            raise HdError(f"{path}:{n}: field 'category' is missing")
        out.append({"question_id": q.get("question_id", n), "category": category(q["category"]),
                    "subcategory": q["category"], "turns": turns})
    if not out:
        raise HdError(f"Spec-Bench file {path} holds no questions")
    return out


def select(questions: list[dict], limit: int | None = None,
           categories: list[str] | None = None) -> list[dict]:
    """The first `limit` questions of each category (all when None), in category order (Spec-Bench's
    six first, then a question file's own categories in the order they appear: a set of your own
    questions in Spec-Bench's format runs too). For mt_bench the questions are taken round-robin
    over its sub-categories."""
    own = list(dict.fromkeys(q["category"] for q in questions if q["category"] not in CATEGORIES))
    cats = list(categories) if categories else [c for c in CATEGORIES
                                                if any(q["category"] == c for q in questions)] + own
    known = {q["category"] for q in questions}
    missing = [c for c in cats if c not in known]
    if missing:
        raise HdError(f"category '{missing[0]}' has no questions in the Spec-Bench file "
                      f"(present: {', '.join(sorted(known))})")
    out = []
    for c in cats:
        qs = [q for q in questions if q["category"] == c]
        if c == "mt_bench":
            by_sub: dict[str, list[dict]] = {}
            for q in qs:
                by_sub.setdefault(q["subcategory"], []).append(q)
            qs = [q for group in zip_longest(*by_sub.values()) for q in group if q is not None]
        out += qs[:limit] if limit is not None else qs
    return out

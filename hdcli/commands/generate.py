"""`hd generate` as the CLI calls it: its prompt and grammar files read (`read_prompt`,
`output_from_files`), one generation of a Run (hdcli/generation.py), and with --compare plain
decoding and transformers' generate beside it (`generate_report`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import inputs
from ..bench.baselines import hf_generate, stock_model
from ..compose import Status, resolved, warm_up
from ..config import DecodingConfig
from ..db.modeldb import learn
from ..drafting.model import uses_answers
from ..engine import loader
from ..engine.decode.loop import first_difference
from ..engine.decode.prediction import prediction_ids
from ..engine.text import constrain
from ..engine.text.prompts import encode_prompt
from ..errors import HdError
from ..generation import Result, decode, prepare
from ..hsd.stack import ModelStack


@dataclass(frozen=True)
class OutputSpec:
    """What one output is held to or expected to repeat, given per request like its prompt:
    a grammar (kind: one of constrain.KINDS; source: its text, a JSON schema, None for
    json_object) and a predicted output (text). origin names where each came from in messages
    (a flag and file, or a request field)."""
    kind: str | None = None
    source: object = None
    prediction: str | None = None
    origin: str = "the grammar"
    prediction_origin: str = "the prediction"

    def compile(self, lm: loader.LoadedModel | None) -> constrain.Grammar | None:
        """The grammar for lm; with lm None only checked (before a model is loaded)."""
        if self.kind is None:
            return None
        try:
            if lm is None:
                constrain.check(self.kind, self.source)
                return None
            return constrain.compile(lm, self.kind, self.source)
        except constrain.GrammarError as exc:
            raise HdError(f"{self.origin}: {exc}") from None

    def prediction_ids(self, lm: loader.LoadedModel, room: int) -> list[int] | None:
        try:
            return prediction_ids(lm, self.prediction, room)
        except HdError as exc:
            raise HdError(f"{self.prediction_origin}: {exc}") from None


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """hd generate's prompt: --prompt's text or --prompt-file's (one of them)."""
    if prompt is not None and prompt_file is not None:
        raise HdError("pass either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        return inputs.read_text(prompt_file, "--prompt-file", inputs.TEXT_BYTES, TEXT_HINT)
    if prompt is None:
        raise HdError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompt


GRAMMAR_SUFFIXES = {".lark": "lark", ".gbnf": "gbnf", ".regex": "regex", ".re": "regex"}
GRAMMAR_FORMATS = ("lark", "gbnf", "regex")   # --grammar-format's values (constrain.KINDS of a file)


# what to do about a file over its bound (inputs.read_text)
TEXT_HINT = "that is past any model's context: pass a shorter file"
GRAMMAR_HINT = "a grammar or schema is refused past that: give a smaller one"


def read_grammar(path: Path, flag: str) -> str:
    """A grammar or JSON Schema file, read no further than constrain compiles."""
    return inputs.read_text(path, flag, constrain.MAX_SOURCE_BYTES, GRAMMAR_HINT)


def output_from_files(json_schema: Path | None, json_object: bool, grammar: Path | None,
                 grammar_format: str | None, prediction: Path | None) -> OutputSpec:
    """hd generate's grammar and prediction flags as one OutputSpec (files read here)."""
    given = [f for f, v in (("--json-schema", json_schema), ("--json-object", json_object),
                            ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise HdError(f"pass one of {', '.join(given)}: an answer follows one grammar")
    if grammar_format is not None and grammar_format not in GRAMMAR_FORMATS:
        raise HdError(f"--grammar-format {grammar_format!r} is not a grammar format hd reads: give one of "
                      f"{', '.join(GRAMMAR_FORMATS)}")
    if grammar_format is not None and grammar is None:
        raise HdError("--grammar-format goes with --grammar FILE")
    kind, source, origin = None, None, "the grammar"
    if json_schema is not None:
        kind, source, origin = "json_schema", read_grammar(json_schema, "--json-schema"), f"--json-schema {json_schema}"
    elif json_object:
        kind, origin = "json_object", "--json-object"
    elif grammar is not None:
        kind = grammar_format or GRAMMAR_SUFFIXES.get(grammar.suffix.lower())
        if kind not in GRAMMAR_FORMATS:
            raise HdError(f"--grammar {grammar}: say its format with --grammar-format lark|gbnf|regex "
                          f"(its suffix {grammar.suffix or '(none)'!r} does not)")
        source, origin = read_grammar(grammar, "--grammar"), f"--grammar {grammar}"
    text = None if prediction is None else inputs.read_text(prediction, "--prediction", inputs.TEXT_BYTES, TEXT_HINT)
    return OutputSpec(kind, source, text, origin, f"--prediction {prediction}")


@dataclass
class GenerateReport:
    """What `hd generate` shows: data (its --json document) and the RunStats per run."""
    data: dict
    runs: dict = field(default_factory=dict)


def generate_report(cfg: DecodingConfig, prompt: str, *, compare: bool = False,
                    lm: loader.LoadedModel | None = None, on_text=None,
                    on_status: Status = lambda m: None, output: OutputSpec = OutputSpec()) -> GenerateReport:
    """hd generate: one generation with the configuration's drafter (and, with compare, plain
    decoding and transformers' generate on the same prompt), as a report. output: a grammar the
    answer follows and a predicted output (plain decoding in compare follows the same grammar,
    with no prediction: the baseline a user has)."""
    if not prompt or not prompt.strip():
        raise HdError("the prompt is empty: pass --prompt TEXT or --prompt-file FILE")
    output.compile(None)   # a bad schema or grammar is said before the model loads
    warned: list[str] = []   # every change made to the run, said and kept for --json

    def say(message: str) -> None:
        if message.startswith("warning:"):
            warned.append(message)
        on_status(message)
    run = prepare(cfg, lm, say)
    cfg, lm, drafter = run.config, run.lm, run.drafter()
    grammar = output.compile(lm)
    prompt_ids = encode_prompt(lm.tokenizer, prompt, chat=cfg.chat, system=cfg.system, max_tokens=lm.max_context)
    predicted = output.prediction_ids(lm, run.room(prompt_ids))
    if compare:
        warm_up(lm)
    res = decode(run, prompt_ids, drafter, on_text=on_text, on_status=say, grammar=grammar, prediction=predicted)
    used = resolved(cfg, lm, run.dbs)
    data = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
            "kernels": lm.kernels, "invariant": lm.info.get("invariant"), "load_seconds": lm.load_seconds,
            "load_phases": lm.info.get("load_phases"), "layout_cache": lm.info.get("layout_cache"),
            "forward": lm.info.get("forward", "transformers"), "numerics": lm.info.get("numerics"),
            "peak_rss_bytes": loader.peak_rss_bytes(),
            "layers": used.layers,
            "draft_len": cfg.draft_len, "policy": cfg.policy, "candidates": cfg.candidates,
            "stats_dbs": cfg.stats_dbs, "model_db": cfg.model_db, "plan": cfg.plan,
            "sampling": vars(cfg.sampling) | {"seed": cfg.seed}, "config": used.to_dict(), **res.to_dict(lm.tokenizer), "warnings": warned}
    if grammar is not None:
        rows = res.stats.grammar_rows
        data["grammar"] = {"kind": grammar.kind, "seconds": res.stats.grammar_seconds, "rows": rows,
                           "ms_per_row": 1e3 * res.stats.grammar_seconds / rows if rows else None}
    if predicted is not None:
        data["prediction"] = {"tokens": len(predicted)} | (res.prediction_usage or {})
    if run.dbs.model is not None:  # what the model layer drafts from (drafting/model.py)
        data["model_db_index"] = "answers" if uses_answers(run.dbs.model) else "ngrams"
    if isinstance(drafter, ModelStack):   # hd's draft models: each level's counts
        data["levels"] = drafter.level_stats()
    if cfg.learn:   # the answer is shown whatever becomes of learning it (learn_error: why not)
        try:
            data["learned_keys"] = learn(run.dbs.model, res.prompt_ids, res.tokens)
        except HdError as exc:
            data["learned_keys"], data["learn_error"] = 0, f"the answer was not learned: {exc}"
    report = GenerateReport(data, {"hd": res.stats})
    if compare:
        plain = decode(run, prompt_ids, None, grammar=grammar)
        report.runs["plain"] = plain.stats
        data["compare"] = compare_with_baselines(lm, cfg, res, plain)
    return report


def compare_with_baselines(lm: loader.LoadedModel, cfg: DecodingConfig, res: Result, plain: Result) -> dict:
    """hd's result against plain decoding (same model, same process) and against transformers'
    generate on the stock model: speedups and whether the outputs are identical."""
    stock = stock_model(lm)
    n = len(plain.tokens)  # transformers' generate makes as many tokens (stop strings aside)
    hf_generate(stock, res.prompt_ids, 4, cfg.sampling, cfg.seed)  # its first call is not timed
    hf_tokens, hf_wall = hf_generate(stock, res.prompt_ids, n, cfg.sampling, cfg.seed)
    hf_tps = len(hf_tokens) / hf_wall if hf_wall else 0.0
    diff, hf_diff = first_difference(res.tokens, plain.tokens), first_difference(res.tokens, hf_tokens)
    tps = res.stats.tokens_per_second
    return {"plain": plain.to_dict(),
            "speedup": tps / plain.stats.tokens_per_second if plain.stats.tokens_per_second else 0.0,
            "identical": diff is None, "first_difference": diff,
            "hf_ar": {"tokens": hf_tokens, "tokens_per_second": hf_tps, "kernels": stock.kernels, "dtype": stock.dtype},
            "speedup_over_hf_ar": tps / hf_tps if hf_tps else 0.0,
            "identical_to_hf_ar": hf_diff is None, "first_difference_from_hf_ar": hf_diff}

"""A run put together in one place and its generations: `prepare` makes a DecodingConfig a `Run`
(plan applied, options checked once, DBs open, target loaded), whose `request` makes each
prompt's Request against the context's room and whose `generate` decodes it into a `Result`;
`generate` is the Python API's one call. Then `hd generate`'s report: its prompt and grammar
files read (`read_prompt`, `output_from_files`), the run, and with --compare plain decoding and
transformers' generate beside it (`generate_report`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from . import inputs
from .bench.baselines import first_difference, hf_generate, stock_model
from .compose import DBs, Status, check_tokenizers, drafter_for, load_model_for, open_dbs, resolved, warm_up
from .config import DecodingConfig
from .db.modeldb import learn
from .drafting import RecycledTable
from .drafting import answer_index as model_layer
from .engine.text import constrain
from .engine.decode import costs
from .engine import loader as models
from .engine.decode.prediction import prediction_ids
from .engine.decode.loop import Decoder, Generation
from .engine.decode.request import Request
from .engine.text.prompts import TextStream, cut_at_stop, encode_prompt
from .errors import HdError
from .hsd.planner import check_made_for
from .hsd.stack import ModelStack


@dataclass
class Result:
    """One generation: its text and tokens, the layer that drafted each token (None: the target's
    own), why it stopped (stop_reason) and its RunStats."""
    text: str
    tokens: list[int]
    layers: list[str | None]
    stop_reason: str
    stats: object  # RunStats
    prompt_ids: list[int]
    # per token where asked: (log-probability, [(token, log-probability) of the best ones])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prediction_usage: dict | None = None   # with a prediction: accepted/rejected_prediction_tokens
    # what hd changed of the request, one line each as on stderr ("warning: ..."): a cap said
    # only on stderr is lost to a program reading --json
    warnings: list[str] = field(default_factory=list)

    def to_dict(self, tokenizer=None) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "stop_reason": self.stop_reason,
               "stats": self.stats.to_dict(), "warnings": list(self.warnings)}
        if self.logprobs is not None:
            def text(t):
                return tokenizer.decode([t]) if tokenizer is not None else None
            out["logprobs"] = [{"token": t, "text": text(t), "logprob": lp,
                                "top": [{"token": b, "text": text(b), "logprob": blp} for b, blp in best]}
                               for t, (lp, best) in zip(self.tokens, self.logprobs)]
        return out


class NoRoom(HdError):
    """The prompt leaves the model's context no room for a new token, or leaves fewer than were
    asked for (asked). Its message is the command line's; hd serve words it for its fields."""

    def __init__(self, prompt_tokens: int, context: int, asked: int | None = None):
        self.prompt_tokens, self.context, self.asked = prompt_tokens, context, asked
        room = context - prompt_tokens
        super().__init__(f"the prompt is {prompt_tokens} tokens but the model's context is {context}: "
                         "shorten the prompt" if asked is None else
                         f"{asked} new tokens after a {prompt_tokens}-token prompt exceed the model's "
                         f"context of {context} (at most {room})")


class Run:
    """A configuration made ready to decode, put together in one place (`prepare`: the plan
    applied, every field checked once, the DBs open and checked against the target's tokenizer,
    the target loaded). Then for each generation: `request` (its Request, checked against the
    context's room), `drafter` (one per scope: a request's, a tenant's) and `generate`. The
    forward-cost curve that caps draft trees (`cost`) is measured once, where first needed.
    hd generate, the Python API and hd serve all decode through one."""

    def __init__(self, config: DecodingConfig, lm: models.LoadedModel, dbs: DBs | None = None,
                 plan: dict | None = None):
        """config: checked (validate) already; dbs: open (default: opened when a drafter asks)."""
        self.config, self.lm, self.plan, self._dbs = config, lm, plan, dbs

    @property
    def dbs(self) -> DBs:
        if self._dbs is None:
            self._dbs = open_dbs(self.config, self.lm)
        return self._dbs

    @functools.cached_property
    def cost(self) -> costs.CostCurve:
        """The forward-cost curve of this model and machine (costs.curve_for: measured once, cached)."""
        return costs.curve_for(self.lm)

    def drafter(self, recycle_table: RecycledTable | None = None, answer_index=None):
        """The configuration's drafter (None: plain decoding) for one scope: recycle_table and
        answer_index are what that scope's requests taught (default: the process's own)."""
        if not self.config.drafting:
            return None
        return drafter_for(self.config, self.lm, self.dbs, recycle_table=recycle_table, answer_index=answer_index)

    def room(self, prompt_ids: Sequence[int], asked: int | None = None) -> int:
        """New tokens the model's context leaves after the prompt; NoRoom where it leaves none, or
        fewer than asked."""
        room = self.lm.max_context - len(prompt_ids)
        if room < 1 or (asked is not None and asked > room):
            raise NoRoom(len(prompt_ids), self.lm.max_context, None if room < 1 else asked)
        return room

    def request(self, prompt_ids: Sequence[int], overrides: dict | None = None, *,
                on_cut: Callable[[int, int], None] | None = None) -> Request:
        """The Request of one prompt (DecodingConfig.request: the configuration's fields, under a
        request's own `overrides`; prediction there may be text), checked against the context: a
        prompt that fills it, or a max_new_tokens in overrides beyond its room, is NoRoom; the
        configuration's max_new_tokens beyond it is cut to the room, and on_cut(max_new_tokens,
        room) told."""
        fields = dict(overrides or {})
        asked = fields.pop("max_new_tokens", None)
        room = self.room(prompt_ids, asked)
        if asked is None and self.config.max_new_tokens > room and on_cut is not None:
            on_cut(self.config.max_new_tokens, room)
        vocab = self.lm.model.config.vocab_size
        outside = [t for t, _ in fields.get("sampling", self.config.sampling).logit_bias if t >= vocab]
        if outside:
            raise HdError(f"--logit-bias: token {outside[0]} is not in the model's vocabulary (ids 0..{vocab - 1})")
        fields["prediction"] = prediction_ids(self.lm, fields.get("prediction"), room)
        return self.config.request(prompt_ids, max_new_tokens=min(self.config.max_new_tokens if asked is None else asked, room),
                                   **fields)

    def generate(self, request: Request, drafter=None, on_text: Callable[[str, str | None], None] | None = None,
                 cost: costs.CostCurve | None = None) -> Result:
        """Decode one request with drafter (None: plain decoding; a prediction drafts alone).
        cost: default the run's, where anything drafts."""
        lm = self.lm
        if (drafter or request.prediction) and cost is None:
            cost = self.cost
        stream = TextStream(lm.tokenizer, on_text) if on_text else None
        g: Generation = Decoder(lm.model, lm.eos_ids, drafter, cost=cost, tokenizer=lm.tokenizer).generate(
            request, stream)
        text = cut_at_stop(lm.tokenizer.decode(g.tokens, skip_special_tokens=True), request.stop)
        return Result(text=text, tokens=g.tokens, layers=g.layers, stop_reason=g.stop_reason,
                      stats=g.stats, prompt_ids=list(request.prompt_ids), logprobs=g.logprobs,
                      prediction_usage=g.prediction_usage)


def prepare(cfg: DecodingConfig, lm: models.LoadedModel | None = None,
            on_status: Status = lambda m: None) -> Run:
    """A configuration made a Run: everything before the first token, checked in the order that
    fails fastest (the plan, the options and the DBs before the model loads)."""
    cfg, plan = cfg.with_plan()
    cfg.validate()
    dbs = open_dbs(cfg)
    if lm is None:
        on_status(f"loading {cfg.model} ...")
        lm = load_model_for(cfg)
        mode = ", M-invariant: verified rows bit-equal plain decoding's" if lm.invariant else ""
        on_status(f"loaded {lm.source} ({lm.dtype}, {lm.device}, {lm.kernels} kernels{mode}) in "
                  f"{lm.load_seconds:.1f}s")
        why = lm.info.get("invariant", {}).get("off")
        if why:
            on_status(f"M-invariant forward off: {why}")
    check_tokenizers(dbs, lm)
    if plan is not None:
        check_made_for(cfg.plan, plan, lm)
        for db in dbs.all():
            planned = plan.get("db_digests", {}).get(str(db.path.resolve()))
            if planned and planned != db.header.get("content_digest"):
                on_status(f"warning: {db.path} changed since plan {cfg.plan} was measured (learned "
                          "or rebuilt): its predictions may be off; run `hd plan` again")
    return Run(cfg, lm, dbs, plan)


def generate(lm: models.LoadedModel, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
             config: DecodingConfig | None = None, drafter="default",
             on_text: Callable[[str, str | None], None] | None = None,
             cost: costs.CostCurve | None = None, on_status: Callable[[str], None] | None = None,
             grammar: constrain.Grammar | None = None, prediction: str | Sequence[int] | None = None,
             **options) -> Result:
    """Generate a completion. config: the generation settings (max_new_tokens, sampling, seed,
    chat, system, stop, logprobs) and, with drafter "default", the drafter; options: any of its
    fields by name (e.g. max_new_tokens=30, temperature=0.7, seed=7), over config's or the
    defaults: the one way sampling is given (config.sampling_fields turns a Sampling into them).
    The request decoded is Run.request's. drafter: a Hierarchy or ModelStack, None for plain
    decoding, "default" for the configuration's (or the default one: context DB and recycled
    predictions). cost: the forward-cost curve that caps draft trees (default: measured once for
    this model and machine, see costs.curve_for). logprobs: None, or k to return each token's
    log-probability and its k best alternatives (Result.logprobs; plain decoding's numbers
    exactly, verify.logprobs_of). on_status: told each change made to the request, one line each
    (Result.warnings has them too): max_new_tokens more than the context leaves after the prompt
    is cut to it. A configuration's plan is applied by prepare (a Run), not here.
    grammar: constrain.compile(lm, kind, source): the output follows it (engine/text/constrain.py).
    prediction: text (or token ids) the answer is expected to repeat, drafted by its own layer at
    the top of the hierarchy (engine/decode/prediction.py); it drafts with drafter None too.
    Greedy output equals plain greedy decoding (under the same grammar) token for token whatever
    the drafts."""
    run = Run((config or DecodingConfig()).replace(**options).validate(), lm)
    cfg = run.config
    if prompt_ids is None:
        prompt_ids = encode_prompt(lm.tokenizer, prompt or "", chat=cfg.chat, system=cfg.system,
                                   max_tokens=lm.max_context)
    return decode(run, prompt_ids, drafter, on_text=on_text, cost=cost, on_status=on_status,
                  grammar=grammar, prediction=prediction)


def decode(run: Run, prompt_ids: Sequence[int], drafter="default", *, on_text=None, cost=None,
           on_status: Callable[[str], None] | None = None, grammar=None, prediction=None) -> Result:
    """One prompt of a run, with a cut of max_new_tokens to the context's room said (on_status)
    and kept (Result.warnings); drafter "default": the run's."""
    warnings = []

    def cut(asked: int, room: int) -> None:
        warnings.append(f"warning: --max-new-tokens {asked} exceeds the room left in the model's "
                        f"context ({room} tokens after the prompt): generating at most {room}")
        if on_status is not None:
            on_status(warnings[-1])
    request = run.request(prompt_ids, {"grammar": grammar, "prediction": prediction}, on_cut=cut)
    res = run.generate(request, run.drafter() if isinstance(drafter, str) and drafter == "default" else drafter,
                       on_text, cost)
    res.warnings = warnings
    return res


def compile_grammar(lm: models.LoadedModel, kind: str, source=None) -> constrain.Grammar:
    """A grammar for lm's tokenizer (constrain.KINDS); GrammarError (an HdError) when unusable."""
    return constrain.compile(lm, kind, source)


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

    def compile(self, lm: models.LoadedModel | None) -> constrain.Grammar | None:
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

    def prediction_ids(self, lm: models.LoadedModel, room: int) -> list[int] | None:
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
                    lm: models.LoadedModel | None = None, on_text=None,
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
            "peak_rss_bytes": models.peak_rss_bytes(),
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
    if run.dbs.model is not None:  # what the model layer drafts from (drafting/answer_index.py)
        data["model_db_index"] = "answers" if model_layer.uses_answers(run.dbs.model) else "ngrams"
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


def compare_with_baselines(lm: models.LoadedModel, cfg: DecodingConfig, res: Result, plain: Result) -> dict:
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

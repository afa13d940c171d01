"""The Python API the CLI is a thin layer over.

    from hdcli import api
    cfg = api.DecodingConfig(max_new_tokens=128)      # or DecodingConfig.from_file("run.json")
    lm = api.load_model_for(cfg)
    res = api.generate(lm, "Summarise: ...", config=cfg)
    print(res.text, res.stats.mean_accepted)

A run is built from one DecodingConfig (hdcli/config.py); compose.build_drafter turns it and a
loaded model into the drafter. Each `hd` command is one call here: generate_report, plan,
bench_spec_bench, build_stats, build_model_db, cost_report.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from . import compose, inputs
from .bench.baselines import first_difference, hf_generate, stock_model
from .compose import (DBs, build_drafter, cheap_verification, check_tokenizers, default_min_expected,
                      default_min_n, default_min_prob, make_stack, open_dbs, resolved, warm_up)
from .config import (DEFAULT_CANDIDATES, DEFAULT_LEVEL_TOKENS, DEFAULT_POLICY, SEED_RANGE,
                     DecodingConfig, level_problems, parse_draft_len, sampling_fields, split_list)
from .drafting import Hierarchy, RecycledTable, registry
from .engine.text import constrain
from .engine import records
from .engine.kernels import invariant as attention_choice
from .engine.decode import costs
from .engine import loader as models
from .engine.decode.prediction import prediction_ids
from .engine.decode.loop import Decoder, Generation
from .engine.text.prompts import TextStream, cut_at_stop, encode_messages, encode_prompt, stop_checker
from .engine.decode.verify import Sampling
from .errors import HdError
from .hsd.planner import plan_dbs, read_plan, read_plan_file
from .hsd.stack import ModelStack

__all__ = [
    # configuration and composition
    "DecodingConfig", "DEFAULT_CANDIDATES", "DEFAULT_LEVEL_TOKENS", "DEFAULT_POLICY", "LAYER_NAMES",
    "parse_draft_len", "build_drafter", "make_drafter", "make_stack", "draft_model_names", "default_layers",
    "cheap_verification", "default_min_n", "default_min_prob", "default_min_expected", "resolved",
    "open_dbs", "open_stats_dbs", "check_tokenizers", "check_seed", "DBs",
    # models, prompts, generation
    "load_model", "load_model_for", "compile_grammar", "read_prompt", "output_from_files", "prediction_ids", "encode_prompt", "encode_messages", "TextStream", "generate", "Result",
    "learn", "warm_up", "prepare", "Prepared", "generate_report", "GenerateReport",
    "compare_with_baselines", "stock_model", "hf_generate", "first_difference",
    # the other commands
    "cost_report", "db_info", "db_query", "parse_shard", "calibration_prompts", "plan", "read_plan", "read_plan_file", "plan_dbs",
    "bench_spec_bench", "bench_agents", "build_stats", "build_model_db", "HdError", "Sampling", "SEED_RANGE"]

load_model = models.load
LAYER_NAMES = registry.names()


def load_model_for(cfg: DecodingConfig, quiet: bool = False) -> models.LoadedModel:
    """The target of a configuration, with its dtype, device and kernels."""
    return models.load(cfg.model, dtype=cfg.dtype, device=cfg.device, kernels=cfg.kernels,
                       quiet=quiet, invariant=cfg.invariant, attention=cfg.attention)


def check_seed(seed: int | None) -> None:
    """A seed torch can take, or a one-line error naming --seed."""
    DecodingConfig(seed=seed).validate()


def open_stats_dbs(paths: Sequence[str], lm: models.LoadedModel | None = None,
                   writable: bool = False) -> list:
    """Open statistics or model DBs, refusing those built for another tokenizer. writable: for
    --learn (model DB)."""
    from .db.stores import Store
    dbs = [Store(p, writable=writable) for p in paths]
    if lm is not None:
        check_tokenizers(DBs(dbs), lm)
    return dbs


def default_layers(stats_dbs: Sequence = (), model_db=None) -> list[str]:
    """The hierarchy run when no layers are given, most local first (drafting.registry): the
    context DB, the target's recycled predictions, then the model DB and statistics DBs where given."""
    return registry.default_layers(registry.LayerInputs(stats_dbs=list(stats_dbs), model_db=model_db))


def make_drafter(layers: Sequence[str] = ("context",), draft_len: int | dict[str, int] = 16,
                 min_n: int | None = None, max_n: int = 4, cheap_verify: bool = False,
                 stats_dbs: Sequence = (), stats_min_prob: float | None = None,
                 stats_min_expected: float | None = None, model_db=None,
                 policy: str = DEFAULT_POLICY, candidates: int = DEFAULT_CANDIDATES,
                 recycle_table: RecycledTable | None = None, answer_index=None) -> Hierarchy | None:
    """The drafting hierarchy from open DBs, most local layer first (an empty `layers` means
    plain decoding): a shorthand for compose.db_hierarchy with a DecodingConfig. cheap_verify
    (see cheap_verification) picks the defaults of min_n, min_prob and min_expected.
    answer_index: the model DB's answers to draft from (default: the process's own index)."""
    cfg = DecodingConfig(layers=list(layers), draft_len=draft_len, min_n=min_n, max_n=max_n,
                         stats_dbs=[str(getattr(db, "path", "db")) for db in stats_dbs],
                         model_db=None if model_db is None else str(getattr(model_db, "path", "db")),
                         stats_min_prob=stats_min_prob, stats_min_expected=stats_min_expected,
                         policy=policy, candidates=candidates).validate()
    return compose.db_hierarchy(cfg, DBs(list(stats_dbs), model_db), cheap_verify, recycle_table=recycle_table,
                                answer_index=answer_index)


def draft_model_names(draft_models: str | Sequence[str]) -> list[str]:
    """'a, b' or ['a', 'b'] -> ['a', 'b'], refusing an empty list (before any model loads)."""
    names = split_list(draft_models) if isinstance(draft_models, str) else [n.strip() for n in draft_models]
    bad = level_problems(names, ())
    if bad:
        raise HdError(bad[0])
    return [n for n in names if n]


def learn(model_db, prompt_ids: Sequence[int], tokens: Sequence[int], scope: bytes | None = None) -> int:
    """Add a generation to the model DB: the answer whole (what the model layer's suffix index
    drafts from, where the DB keeps answers) and its n-grams (keys may start in the prompt's last
    tokens, continuations are generated tokens only). Returns keys touched. The running process's
    index already holds the answer (drafting.answer_index.AnswerLayer adds it as it is accepted).
    scope: a tenant's tag (hd serve --learn-scope key|user): the answer is kept for that tenant
    alone, and no n-gram is counted (the n-gram table is shared by every request)."""
    from .db.statsdb import add_counts
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
    return add_counts(model_db, [doc], first_end=len(context) - 1,
                      answers=[list(tokens)] if model_db.sequence_count and tokens else [])


@dataclass
class Result:
    text: str
    tokens: list[int]
    layers: list[str | None]
    stop_reason: str
    stats: object  # RunStats
    prompt_ids: list[int]
    # per token where asked: (log-probability, [(token, log-probability) of the best ones])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prediction_usage: dict | None = None   # with a prediction: accepted/rejected_prediction_tokens

    def to_dict(self, tokenizer=None) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "stop_reason": self.stop_reason,
               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            def text(t):
                return tokenizer.decode([t]) if tokenizer is not None else None
            out["logprobs"] = [{"token": t, "text": text(t), "logprob": lp,
                                "top": [{"token": b, "text": text(b), "logprob": blp} for b, blp in best]}
                               for t, (lp, best) in zip(self.tokens, self.logprobs)]
        return out


def generate(lm: models.LoadedModel, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
             config: DecodingConfig | None = None, drafter="default",
             on_text: Callable[[str, str | None], None] | None = None,
             cost: costs.CostCurve | None = None, on_status: Callable[[str], None] | None = None,
             grammar: constrain.Grammar | None = None, prediction: str | Sequence[int] | None = None,
             sampling: Sampling | None = None, **options) -> Result:
    """Generate a completion. config: the generation settings (max_new_tokens, sampling, seed,
    chat, system, stop, logprobs) and, with drafter "default", the drafter; options: any of its
    fields by name (e.g. max_new_tokens=30, seed=7), over config's or the defaults; sampling: a
    Sampling in place of the sampling fields. drafter: a
    Hierarchy or ModelStack, None for plain decoding, "default" for the configuration's (or the
    default one: context DB and recycled predictions). cost: the forward-cost curve that caps
    draft trees (default: measured once for this model and machine, see costs.curve_for).
    logprobs: None, or k to return each token's log-probability and its k best alternatives
    (Result.logprobs; plain decoding's numbers exactly, verify.logprobs_of). on_status: told in
    one line when max_new_tokens is more than the context leaves after the prompt (then cut to it).
    grammar: constrain.compile(lm, kind, source): the output follows it (engine/text/constrain.py).
    prediction: text (or token ids) the answer is expected to repeat, drafted by its own layer at
    the top of the hierarchy (engine/decode/prediction.py); it drafts with drafter None too.
    Greedy output equals plain greedy decoding (under the same grammar) token for token whatever
    the drafts."""
    if sampling is not None:
        options = {**sampling_fields(sampling), **options}
    cfg = (config or DecodingConfig()).replace(**options).validate()
    max_new_tokens, sampling, seed, stop = cfg.max_new_tokens, cfg.sampling, cfg.seed, cfg.stop
    if prompt_ids is None:
        prompt_ids = encode_prompt(lm.tokenizer, prompt or "", chat=cfg.chat, system=cfg.system,
                                   max_tokens=lm.max_context)
    room = lm.max_context - len(prompt_ids)
    if room < 1:
        raise HdError(f"the prompt is {len(prompt_ids)} tokens but the model's context is "
                      f"{lm.max_context}: shorten the prompt")
    if max_new_tokens > room and on_status is not None:
        on_status(f"warning: --max-new-tokens {max_new_tokens} exceeds the room left in the model's context "
                  f"({room} tokens after the prompt): generating at most {room}")
    vocab = lm.model.config.vocab_size
    outside = [t for t, _ in sampling.logit_bias if t >= vocab]
    if outside:
        raise HdError(f"--logit-bias: token {outside[0]} is not in the model's vocabulary (ids 0..{vocab - 1})")
    predicted = prediction_ids(lm, prediction, room)
    if isinstance(drafter, str) and drafter == "default":
        drafter = build_drafter(cfg, lm)
    if (drafter or predicted) and cost is None:
        cost = costs.curve_for(lm)
    decoder = Decoder(lm.model, lm.eos_ids, drafter, cost=cost)
    stream = TextStream(lm.tokenizer, on_text) if on_text else None
    g: Generation = decoder.generate(prompt_ids, min(max_new_tokens, room), sampling, seed,
                                     stop_check=stop_checker(lm.tokenizer, stop), on_tokens=stream,
                                     logprobs=cfg.logprobs, grammar=grammar, prediction=predicted)
    text = cut_at_stop(lm.tokenizer.decode(g.tokens, skip_special_tokens=True), stop)
    return Result(text=text, tokens=g.tokens, layers=g.layers, stop_reason=g.stop_reason,
                  stats=g.stats, prompt_ids=list(prompt_ids), logprobs=g.logprobs,
                  prediction_usage=g.prediction_usage)


def compile_grammar(lm: models.LoadedModel, kind: str, source=None) -> constrain.Grammar:
    """A grammar for lm's tokenizer (constrain.KINDS); GrammarError (an HdError) when unusable."""
    return constrain.compile(lm, kind, source)


# ---------------------------------------------------------------------------------------------
# hd generate

Status = Callable[[str], None]  # progress and warnings for a person; ignored under --json


@dataclass
class Prepared:
    """A configuration made ready to run: plan applied, DBs open, model loaded, drafter built."""
    config: DecodingConfig
    lm: models.LoadedModel
    dbs: DBs
    drafter: object
    plan: dict | None = None


def prepare(cfg: DecodingConfig, lm: models.LoadedModel | None = None,
            on_status: Status = lambda m: None) -> Prepared:
    """Everything before the first token: checked in the order that fails fastest (options, plan
    and DBs before the model loads)."""
    cfg.validate()
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
        read_plan(cfg.plan, lm)  # made for this target and dtype
        for db in dbs.all():
            planned = plan.get("db_digests", {}).get(str(db.path.resolve()))
            if planned and planned != db.header.get("content_digest"):
                on_status(f"warning: {db.path} changed since plan {cfg.plan} was measured (learned "
                          "or rebuilt): its predictions may be off; run `hd plan` again")
    return Prepared(cfg, lm, dbs, build_drafter(cfg, lm, dbs), plan)


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
    """hd generate's grammar and prediction flags as one api.OutputSpec (files read here)."""
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
    run = prepare(cfg, lm, on_status)
    cfg, lm = run.config, run.lm
    grammar = output.compile(lm)
    prompt_ids = encode_prompt(lm.tokenizer, prompt, chat=cfg.chat, system=cfg.system, max_tokens=lm.max_context)
    predicted = output.prediction_ids(lm, lm.max_context - len(prompt_ids))
    if compare:
        warm_up(lm)
    res = generate(lm, prompt_ids=prompt_ids, config=cfg, drafter=run.drafter, on_text=on_text,
                   on_status=on_status, grammar=grammar, prediction=predicted)
    used = resolved(cfg, lm, run.dbs)
    data = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
            "kernels": lm.kernels, "invariant": lm.info.get("invariant"), "load_seconds": lm.load_seconds,
            "load_phases": lm.info.get("load_phases"), "layout_cache": lm.info.get("layout_cache"),
            "forward": lm.info.get("forward", "transformers"), "numerics": lm.info.get("numerics"),
            "peak_rss_bytes": models.peak_rss_bytes(),
            "layers": used.layers,
            "draft_len": cfg.draft_len, "policy": cfg.policy, "candidates": cfg.candidates,
            "stats_dbs": cfg.stats_dbs, "model_db": cfg.model_db, "plan": cfg.plan,
            "sampling": vars(cfg.sampling) | {"seed": cfg.seed}, "config": used.to_dict(), **res.to_dict(lm.tokenizer)}
    if grammar is not None:
        rows = res.stats.grammar_rows
        data["grammar"] = {"kind": grammar.kind, "seconds": res.stats.grammar_seconds, "rows": rows,
                           "ms_per_row": 1e3 * res.stats.grammar_seconds / rows if rows else None}
    if predicted is not None:
        data["prediction"] = {"tokens": len(predicted)} | (res.prediction_usage or {})
    if run.dbs.model is not None:  # what the model layer drafts from (drafting/answer_index.py)
        from .drafting import answer_index as model_layer
        data["model_db_index"] = "answers" if model_layer.uses_answers(run.dbs.model) else "ngrams"
    if isinstance(run.drafter, ModelStack):   # hd's draft models: each level's counts
        data["levels"] = run.drafter.level_stats()
    if cfg.learn:   # the answer is shown whatever becomes of learning it (learn_error: why not)
        try:
            data["learned_keys"] = learn(run.dbs.model, res.prompt_ids, res.tokens)
        except HdError as exc:
            data["learned_keys"], data["learn_error"] = 0, f"the answer was not learned: {exc}"
    report = GenerateReport(data, {"hd": res.stats})
    if compare:
        plain = generate(lm, prompt_ids=prompt_ids, config=cfg, drafter=None, grammar=grammar)
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


# ---------------------------------------------------------------------------------------------
# hd models

def local_models() -> dict:
    """What `hd models` shows: every GGUF in Ollama's and LM Studio's stores
    (engine/local_models.py), with where hd looked and the entries skipped (each with its problem)."""
    from .engine import local_models as lm_stores
    found, skipped = lm_stores.list_models()
    return {"searched": lm_stores.searched(), "models": [m.to_dict() for m in found], "skipped": skipped}


# hd costs

def cost_report(model: str = models.DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
                kernels: str = "auto", remeasure: bool = False, quiet: bool = False,
                invariant: str = "auto") -> dict:
    """What `hd costs` shows: the forward-cost curve of the model as it loads with these options
    on this machine (cached, or measured now; measured again with remeasure)."""
    import torch
    lm = load_model(model, dtype=dtype, device=device, kernels=kernels, quiet=quiet, invariant=invariant)
    dt = lm.dtype
    curves = {lm.kernels: costs.curve_for(lm, remeasure=remeasure, quiet=quiet)}
    out = {"model": lm.name, "source": lm.source, "dtype": dt, "device": lm.device, "cpu": records.cpu_name(),
           "threads": torch.get_num_threads(), "kernels": lm.kernels, "forward": lm.info.get("forward"),
           "invariant": lm.invariant,
           # which attention the M-invariant forward uses, and the times it was chosen by (decided
           # once per process, when the model loaded)
           "attention": attention_choice.decide(lm.model) if lm.invariant else None,
           "curves": {},
           "cache": str(records.cache_root()), "max_age_days": costs.MAX_AGE_DAYS}
    if lm.kernels in ("gguf", "gguf-int8") and lm.device == "cpu":
        from .engine.kernels import quants   # which activations the GGUF GEMMs take here, and the times why
        out["activation_choice"] = {k: v for k, v in quants.activation_choice().items() if k != "key"}
    for k, c in curves.items():
        if c is None:
            continue
        out["curves"][k] = {"one_token_ms": None if c.one_token_seconds is None else 1e3 * c.one_token_seconds,
                            "cost": c.to_dict(), "verifies_cheaply": c.verifies_cheaply(),
                            "branch": c.branch, "stream": c.stream,
                            "measured_at": c.info.get("measured_at"),
                            "plausible": c.info.get("plausible", True)}
    return out


def db_info(path: Path, verify: bool = False) -> dict:
    """hd db info: a DB's header, size figures and content digest (it identifies the counts whatever
    the page layout or build time: a cluster build and a local build of one corpus have the same
    one); with verify, every record read and checked against it."""
    from .db.stores import Store
    db = Store(path)
    info = {"header": db.header, "size": db.size_info(), "content_digest": db.header.get("content_digest")}
    if verify:
        info["verify"] = db.verify()
    return info


def db_query(path: Path, text: str, model: str | None = None, *, max_len: int = 16, min_prob: float = 0.0) -> dict:
    """hd db query: each key of the text's end the DB holds (longest first) with its
    continuations, and the draft it would give (tokenized by `model`, default the DB's)."""
    from .drafting import StatsDB
    from .db.stores import Store
    db = Store(path)
    tok = models.load_tokenizer(model or db.header.get("model", "smollm2-135m"))
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
    draft = StatsDB(db, min_prob=min_prob).propose(ids, max_len, 1)
    return {"keys": keys, "draft": tok.decode(draft[0]) if draft else "", "draft_ids": draft[0] if draft else []}


# ---------------------------------------------------------------------------------------------
# hd plan

def calibration_prompts(lm: models.LoadedModel, prompts: Path | None, count: int) -> list[list[int]]:
    """Token ids of the calibration prompts (calibration_texts)."""
    return [encode_prompt(lm.tokenizer, t) for t in calibration_texts(prompts, count)]


def calibration_texts(prompts: Path | None, count: int) -> list[str]:
    """The calibration prompts: a jsonl (field prompt, text or turns) or text file (one prompt
    per blank-line-separated block), else the first question of Spec-Bench's categories
    (round-robin) when its file is found; read before any model loads."""
    from .bench import specbench
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
    from .hsd import draft_models as draftmodels, planner
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
    db_factory = None if no_db else (lambda: compose.db_hierarchy(db_cfg, dbs, cheap))
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


# ---------------------------------------------------------------------------------------------
# hd bench spec-bench

def bench_spec_bench(cfg: DecodingConfig, methods: Sequence[str] | None = None, *, data: Path | None = None,
                     limit: int | None = None, categories: Sequence[str] | None = None,
                     out_dir: Path | None = None, progress=None, on_status: Status = lambda m: None) -> dict:
    """Spec-Bench with several methods on one model, interleaved (hdcli/bench/runner.py): the
    summary, with the configuration the methods were built from. progress(method, question,
    total answers) after each answer; out_dir: summary.json, answers/<method>.jsonl and speedup.png."""
    from . import bench
    from .bench import report, specbench
    cfg.validate()
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    names = bench.default_methods(cfg) if methods is None else list(methods)
    bench.check_methods(names)
    skipped = bench.unavailable(names)   # llama-server methods without their binary: said, not run
    for why in skipped.values():
        on_status(f"warning: {why}")
    names = [n for n in names if n not in skipped]
    path = specbench.find(data)
    questions = specbench.select(specbench.load(path), limit, categories)
    dbs = open_dbs(cfg)
    on_status(f"loading {cfg.model} ...")
    lm = load_model_for(cfg.replace(layers=None))
    check_tokenizers(dbs, lm)
    runners = bench.make_runners(lm, names, cfg, dbs)
    try:
        results = bench.run(lm, questions, runners, cfg.max_new_tokens, cfg.sampling, cfg.seed,
                            progress)
    finally:
        bench.close(runners)
    summary = bench.summarize(results, greedy=cfg.sampling.greedy, seeded=cfg.seed is not None)
    meta = {"model": lm.name, "source": lm.source, "dtype": lm.dtype, "device": lm.device,
            "kernels": lm.kernels, "invariant": lm.invariant, "data": str(path), "questions": len(questions),
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
            "stats_dbs": cfg.stats_dbs, "model_db": cfg.model_db, "machine": bench.machine(),
            "forward": lm.info.get("forward"), "numerics": lm.info.get("numerics"), "methods_run": names,
            "config": resolved(cfg, lm, dbs).to_dict()}
    if "suffix" in names:
        from .drafting import suffix
        meta["suffix"] = suffix.SuffixDrafter(None).settings()
    if "llama-cpp" in names:
        meta["llama_cpp"] = runners["llama-cpp"].llama.settings()
    servers = {n: r.server.settings() for n, r in runners.items() if isinstance(r, bench.LlamaServerPeer)}
    if servers:
        meta["llama_server"] = servers
    if skipped:
        meta["skipped"] = skipped
    if out_dir is not None:
        bench.save(out_dir, summary, results, meta, lm.name)
        report.chart({**meta, "methods": summary}, out_dir / "speedup.png")
    return {**meta, "methods": summary}


# ---------------------------------------------------------------------------------------------
# hd build-stats, hd build-model-db

def bench_agents(cfg: DecodingConfig, methods: Sequence[str] | None = None, *,
                 workloads: Sequence[str] | None = None, bfcl=None, corpora=None, limit: int | None = None,
                 max_new_tokens: int | None = None, out: Path | None = None, progress=None,
                 on_status: Callable = lambda m: None) -> dict:
    """hd bench agents: tools, JSON-schema output and edits with a prediction, several methods
    interleaved on one model (hdcli/bench/agents.py): the report (meta and per method its figures
    by workload and category); out: where summary.json and each method's answers go."""
    from .bench import agents, runner
    workloads = list(workloads or agents.WORKLOADS)
    cfg.validate()
    if limit is not None and limit < 1:
        raise HdError(f"--limit must be >= 1, not {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise HdError(f"--max-new-tokens must be >= 1, not {max_new_tokens}")
    if methods is not None:
        agents.check_methods(methods)
    items = agents.load(list(workloads), bfcl, corpora, limit)
    dbs = open_dbs(cfg)
    on_status(f"loading {cfg.model} ...")
    lm = load_model_for(cfg.replace(layers=None))
    check_tokenizers(dbs, lm)
    names = agents.default_methods(lm) if methods is None else list(methods)
    runners = agents.make_runners(lm, names, cfg, dbs)
    results, checks = agents.run(lm, items, runners, cfg.sampling, cfg.seed, max_new_tokens, progress)
    report = {"model": lm.name, "source": str(lm.source), "dtype": lm.dtype, "device": lm.device,
              "kernels": lm.kernels, "workloads": list(workloads), "questions": len(items),
              "max_new_tokens": max_new_tokens or {w: agents.MAX_NEW_TOKENS[w] for w in workloads},
              "temperature": cfg.temperature, "seed": cfg.seed, "machine": runner.machine(),
              "methods_run": names, "config": resolved(cfg, lm, dbs).to_dict(),
              "methods": agents.summarize(results, checks, cfg.sampling.greedy)}
    if "llama-cpp" in names:
        report["llama_cpp"] = runners["llama-cpp"].llama.settings()
    if out is not None:
        agents.save(out, report, results, checks, items)
    return report


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


def build_stats(corpus: Sequence[str], out, model: str = models.DEFAULT_MODEL, *, field: str = "text",
                with_prompt: bool = False, limit: int | None = None, shard: tuple[int, int] = (0, 1),
                strict: bool = False, num_proc: int = 1, chunk_tokens: int = 4_000_000,
                overwrite: bool = False, progress=None, **params) -> tuple[dict, dict]:
    """Count a corpus into a statistics DB at `out` in this process (what `hd build-stats` and
    each task of a cluster build run). params: min_n, max_n, draft_len, top_k, min_count.
    Returns (header, read report: skipped and replaced counts, the first malformed record)."""
    from .db import corpus as corpus_mod, statsdb
    texts, report = corpus_mod.read_corpus(list(corpus), field=field, with_prompt=with_prompt,
                                           limit=limit, shard=shard, strict=strict)
    tok = models.load_tokenizer(model)
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
    from .db import modeldb
    from .db.stores import check_output_path
    cfg.validate()
    check_output_path(out, overwrite)
    if from_samples is not None:
        tok = models.load_tokenizer(cfg.model)
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

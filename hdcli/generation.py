"""A run put together in one place and its generations: `prepare` makes a DecodingConfig a `Run`
(plan applied, options checked once, DBs open, target loaded), whose `request` makes each
prompt's Request against the context's room and whose `generate` decodes it into a `Result`;
`generate` is the Python API's one call. `hd generate`'s report over a Run is
hdcli/commands/generate.py's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .compose import DBs, Status, check_tokenizers, drafter_for, load_model_for, open_dbs, resolved
from .config import DecodingConfig
from .drafting import RecycledTable
from .engine.text import constrain
from .engine.decode import costs
from .engine import loader
from .engine.decode.prediction import prediction_ids
from .engine.decode.loop import Decoder, Generation
from .engine.decode.request import Request, Speculation
from .engine.text.prompts import TextStream, cut_at_stop, encode_prompt
from .errors import HdError
from .hsd.planner import check_made_for


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

    def __init__(self, config: DecodingConfig, lm: loader.LoadedModel, dbs: DBs | None = None,
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

    @functools.cached_property
    def layers(self) -> list[str]:
        """The drafting layers this run's requests draft with, most local first (the configuration's,
        or the default ones for its DBs): what a request's own choice is taken from."""
        if not self.config.drafting:
            return []
        return list(resolved(self.config, self.lm, self.dbs).layers)

    def drafter(self, recycle_table: RecycledTable | None = None, answer_index=None,
                speculation: Speculation | None = None):
        """The configuration's drafter (None: plain decoding) for one scope: recycle_table and
        answer_index are what that scope's requests taught (default: the process's own);
        speculation: a request's own hold (None where it drafts nothing; its layers, a choice of
        the run's)."""
        if not self.config.drafting or (speculation is not None and not speculation.drafts):
            return None
        cfg, layers = self.config, speculation.layers if speculation is not None else None
        if layers is not None:
            unknown = [n for n in layers if n not in self.layers]
            if unknown:
                raise HdError(f"layers: '{unknown[0]}' is not one of this run's drafting layers "
                              f"({', '.join(self.layers)})")
            if not layers and not cfg.draft_models:
                return None
            cfg = cfg.replace(layers=list(layers))
        return drafter_for(cfg, self.lm, self.dbs, recycle_table=recycle_table, answer_index=answer_index)

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


def prepare(cfg: DecodingConfig, lm: loader.LoadedModel | None = None,
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
    if cfg.stats_dbs and cfg.layers is None and plan is None:
        on_status("note: the statistics DB is not drafted from by default (it did not pay on hd's "
                  "question sets: docs/benchmarks.md); add --layers context,stats to draft from it")
    if plan is not None:
        check_made_for(cfg.plan, plan, lm)
        for db in dbs.all():
            planned = plan.get("db_digests", {}).get(str(db.path.resolve()))
            if planned and planned != db.header.get("content_digest"):
                on_status(f"warning: {db.path} changed since plan {cfg.plan} was measured (learned "
                          "or rebuilt): its predictions may be off; run `hd plan` again")
    return Run(cfg, lm, dbs, plan)


def generate(lm: loader.LoadedModel, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
             config: DecodingConfig | None = None, drafter="default",
             on_text: Callable[[str, str | None], None] | None = None,
             cost: costs.CostCurve | None = None, on_status: Callable[[str], None] | None = None,
             grammar: constrain.Grammar | None = None, prediction: str | Sequence[int] | None = None,
             speculation: Speculation | None = None, **options) -> Result:
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
    speculation: this request's own hold on drafting (engine/decode/request.Speculation: off, a
    cap on drafted tokens a step, a choice of the configuration's layers).
    Greedy output equals plain greedy decoding (under the same grammar) token for token whatever
    the drafts."""
    run = Run((config or DecodingConfig()).replace(**options).validate(), lm)
    cfg = run.config
    if prompt_ids is None:
        prompt_ids = encode_prompt(lm.tokenizer, prompt or "", chat=cfg.chat, system=cfg.system,
                                   max_tokens=lm.max_context)
    return decode(run, prompt_ids, drafter, on_text=on_text, cost=cost, on_status=on_status,
                  grammar=grammar, prediction=prediction, speculation=speculation)


def decode(run: Run, prompt_ids: Sequence[int], drafter="default", *, on_text=None, cost=None,
           on_status: Callable[[str], None] | None = None, grammar=None, prediction=None,
           speculation: Speculation | None = None) -> Result:
    """One prompt of a run, with a cut of max_new_tokens to the context's room said (on_status)
    and kept (Result.warnings); drafter "default": the run's, with the request's own layers
    (speculation)."""
    warnings = []

    def cut(asked: int, room: int) -> None:
        warnings.append(f"warning: --max-new-tokens {asked} exceeds the room left in the model's "
                        f"context ({room} tokens after the prompt): generating at most {room}")
        if on_status is not None:
            on_status(warnings[-1])
    fields = {"grammar": grammar, "prediction": prediction}
    if speculation is not None:
        fields["speculation"] = speculation
    request = run.request(prompt_ids, fields, on_cut=cut)
    if isinstance(drafter, str) and drafter == "default":
        drafter = run.drafter(speculation=request.speculation)
    res = run.generate(request, drafter, on_text, cost)
    res.warnings = warnings
    return res


def compile_grammar(lm: loader.LoadedModel, kind: str, source=None) -> constrain.Grammar:
    """A grammar for lm's tokenizer (constrain.KINDS); GrammarError (an HdError) when unusable."""
    return constrain.compile(lm, kind, source)

"""DecodingConfig: everything one decoding run is built from, in one object.

A run is built from one configuration: the CLI parses its options into one, `hd plan --out`
and every `--json` output hold one (`hd generate --config FILE` repeats the run), and Python code
makes one directly. `validate()` is the one place options are checked; `compose.build_drafter`
is the one place a configuration becomes the thing that drafts.

Each field is declared once, with `option(default, flags..., help=, kind=, group=)`: the
command-line options of every command that takes it (hdcli/flags.py), the type check of a JSON
configuration (FIELD_TYPES, from_dict) and the flag validation names come from that one line. A
new decoding option is one declaration plus its use.

    from hdcli import api
    cfg = api.DecodingConfig(stats_dbs=["stats.lmdb"], candidates=8, max_new_tokens=128)
    lm = api.load_model_for(cfg)
    res = api.generate(lm, "Summarise: ...", config=cfg)

Fields left at None are chosen for the machine when the run is built (layers: the default
hierarchy for the DBs given; min_n, stats_min_prob, stats_min_expected: by whether verification
is nearly free with this model, dtype and kernels, hdcli/engine/decode/costs.py). The configuration a
run records has them filled in, with the dtype, device and kernels it ran with, so repeating it
repeats the run exactly.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

from . import inputs
from .drafting import registry
from .engine.loader import DEFAULT_MODEL
from .engine.decode.request import Request, Speculation
from .engine.decode.verify import SAMPLING_RANGES, Range, Sampling
from .errors import HdError

DEFAULT_POLICY = "fill-tracked"  # measured: docs/engine.md, "Drafting policies"
DEFAULT_CANDIDATES = 4
DEFAULT_DRAFT_LEN = 16
DEFAULT_LEVEL_TOKENS = 4
POLICIES = ("first-hit", "fill", "fill-tracked", "adaptive")
SEED_RANGE = (0, 2 ** 64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20               # alternatives a token's log-probability comes with (OpenAI's most)
SAMPLING_DEFAULTS = Sampling()  # each sampling field's default is Sampling's (greedy, no truncation)


# What a field takes (a JSON configuration, the CLI's parsed options, Python): from_dict refuses
# anything else in one line naming the field, so "eight" is never a token count, 8.7 never 9 and
# true never 1. A Kind also says the type the command line parses the option as.
@dataclass(frozen=True)
class Kind:
    """What a field takes: check(value), said as `what` in from_dict's refusal; cli: the type the
    command line parses its option as."""
    check: Callable[[Any], bool]
    what: str
    cli: Any = str


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str(v) -> bool:
    return isinstance(v, str)


def _path(v) -> bool:
    return isinstance(v, (str, os.PathLike))


def _bool(v) -> bool:
    return isinstance(v, bool)


def _list(item):
    return lambda v: isinstance(v, (list, tuple)) and all(map(item, v))


def _optional(check):
    return lambda v: v is None or check(v)


def _either(*checks):
    return lambda v: any(c(v) for c in checks)


STR, BOOL = Kind(_str, "a string"), Kind(_bool, "true or false", bool)
INT, NUMBER = Kind(_int, "an integer", int), Kind(_number, "a number", float)
OPT_INT = Kind(_optional(_int), "an integer or null", Optional[int])
OPT_NUMBER = Kind(_optional(_number), "a number or null", Optional[float])
OPT_PATH = Kind(_optional(_path), "a path or null", Optional[Path])
OPT_STR = Kind(_optional(_str), "a string or null", Optional[str])


def option(default, *flags: str, help: str | None = None, kind: Kind = STR, group: str = "",
           **cli) -> Any:
    """A configuration field declared once: its default, its command-line flags (the first is the
    long one; `--on/--off` for a switch) and help, what it takes (kind: checked by from_dict, parsed
    as kind.cli by the command line, or cli["cli"]), and its group (model, drafting, sampling,
    output). cli may also hold cli_default (the option's default where it is not the field's, as
    a comma-separated list option's None), typer's envvar, range (a number's verify.Range: what
    problems() and Sampling take) and served (where hd serve's request schema takes less: OpenAI's
    range; served_bounds). The command line's options (hdcli/flags.py) and FIELD_TYPES are made
    from these."""
    meta = {"flags": flags, "help": help, "kind": kind, "group": group, **cli}
    if isinstance(default, (list, dict)):   # a fresh empty one per object
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


_ALWAYS = [n for n, spec in registry.LAYERS.items() if spec.in_default(registry.LayerInputs())]
_WITH_DBS = [n for n, spec in registry.LAYERS.items() if n not in _ALWAYS and spec.in_default(
    registry.LayerInputs(stats_stores=[object()], model_db=object()))]
_DEFAULT_LAYERS_HELP = (", ".join(_ALWAYS)
                        + ("" if not _WITH_DBS else ", then " + " and ".join(_WITH_DBS)
                           + (" when its DB is" if len(_WITH_DBS) == 1 else " when their DBs are") + " given")
                        + (" (model: the model DB's answers where given, and this process's)" if "model" in _ALWAYS else "")
                        + " (" + ", ".join(n for n in registry.LAYERS if n not in _ALWAYS + _WITH_DBS) + ": when named)")
KERNELS_HELP = ("auto|gguf|gguf-int8|onednn|torch (int4: an alias of gguf). auto: a GGUF's own blocks where "
                "hd has a kernel for their type, by int8 activations (gguf-int8) where this CPU has AVX512-VNNI "
                "and measured them faster (once, cached) or has AVX2 and no AVX512-BF16, else by bf16 ones (gguf); else oneDNN-packed dense "
                "layers where oneDNN is usable, else torch's (docs/dtype.md).")
DTYPE_HELP = ("auto|bf16|fp16|fp32. auto: bf16 for a GGUF, on CUDA and on a CPU with native bf16; "
              "else fp32. hd's own forward runs in bf16 or fp32 (docs/dtype.md).")
INVARIANT_HELP = ("auto|on|off: the M-invariant forward, in which every verified row is bit-identical "
                  "to a one-token forward (auto: where it holds on this machine; docs/dtype.md).")
MODEL, DRAFTING, SAMPLING, OUTPUT = "model", "drafting", "sampling", "output"
# the drafting defaults compose.py picks by the target's measured forward cost (`hd costs`)
_BY_COST = "where `hd costs` finds verification cheap on this machine"


@dataclass
class DecodingConfig:
    # the target model and how it runs (bundled name, .gguf file, model folder or Hugging Face id)
    model: str = option(DEFAULT_MODEL, "--model", "-m", group=MODEL,
                        help="Bundled name, .gguf file, model folder or Hugging Face id.")
    dtype: str = option("auto", "--dtype", help=DTYPE_HELP, group=MODEL)
    device: str = option("auto", "--device", help="auto|cpu|cuda.", group=MODEL)
    kernels: str = option("auto", "--kernels", help=KERNELS_HELP, group=MODEL)
    invariant: str = option("auto", "--invariant", help=INVARIANT_HELP, group=MODEL)  # engine/kernels/invariant.py
    attention: str = option("auto", "--attention", group=MODEL, help="auto|fused|torch: the M-invariant "
                            "attention's kernel (auto: the faster here, timed once; runs record it, and "
                            "--config repeats it).")
    # the database hierarchy; layers: most local first, [] = plain decoding, None = the default
    layers: list[str] | None = option(None, "--layers", group=DRAFTING, kind=Kind(
        _optional(_either(_str, _list(_str))), "a list of layer names (or null for the default)", Optional[str]),
        help=f"Drafting layers, most local first, comma-separated ({', '.join(registry.names())}); "
        f"'none' for plain decoding. Default: {_DEFAULT_LAYERS_HELP}.")
    policy: str = option(DEFAULT_POLICY, "--policy", group=DRAFTING, help="How layers share a step: "
                         "first-hit (first layer that matches), fill (slots in layer order), fill-tracked "
                         "(fill, trees cut by each layer's acceptance in this request), adaptive (layers "
                         "ordered by it too).")
    candidates: int = option(DEFAULT_CANDIDATES, "--candidates", "-C", kind=INT, group=DRAFTING,
                             help="Most candidate continuations per step, verified as one token tree "
                             "(1: a single chain).")
    draft_len: int | dict[str, int] = option(DEFAULT_DRAFT_LEN, "--draft-len", group=DRAFTING, kind=Kind(
        _either(_int, _str, lambda v: isinstance(v, dict) and all(map(_str, v)) and all(map(_int, v.values()))),
        "an integer or {layer: integer}"), help="Most tokens per candidate: a number, or per layer as "
        "context=16,model=8,stats=8.")
    min_n: int | None = option(None, "--min-n", kind=OPT_INT, group=DRAFTING, help="Shortest n-gram the "
                               f"context DB matches (default: 1 {_BY_COST}, else 2).")
    max_n: int = option(4, "--max-n", kind=INT, group=DRAFTING, help="Longest n-gram the context DB matches.")
    stats_dbs: list[str] = option([], "--stats-db", group=DRAFTING, help="Statistics DB from `hd build-stats` "
                                  "(repeatable; asked in the order given).", kind=Kind(
                                      _optional(_either(_path, _list(_path))), "a list of paths", List[Path]))
    model_db: str | None = option(None, "--model-db", kind=OPT_PATH, group=DRAFTING,
                                  help="Model DB from `hd build-model-db`.")
    stats_min_prob: float | None = option(None, "--stats-min-prob", kind=OPT_NUMBER, group=DRAFTING,
                                          help="Least estimated probability of a stats/model draft "
                                          f"(default: 0.1 {_BY_COST}, else 0.2).")
    stats_min_expected: float | None = option(None, "--stats-min-expected", kind=OPT_NUMBER, group=DRAFTING,
                                              help="Least expected accepted tokens of a stats/model "
                                              f"draft (default: 0 {_BY_COST}, else 1).")
    governor: bool = option(False, "--governor/--no-governor", kind=BOOL, group=DRAFTING,
                            help="A request drafts only while drafting pays on its own clock, and "
                            "tries again later (docs/serve.md, the governor: off by default, it cost "
                            "more than it saved on our sets; output unchanged either way).")
    learn: bool = option(False, "--learn", kind=BOOL, group=DRAFTING,
                         help="Add what was generated to the model DB.")
    # draft models stacked above the database hierarchy (hdcli/hsd), or a plan that chose them
    draft_models: list[str] = option([], "--draft-models", group=DRAFTING, cli_default=None, kind=Kind(
        _optional(_either(_str, _list(_str))), "a list of draft model names", Optional[str]), help="Draft models, smallest first, "
        "comma-separated, stacked above the DB layers (self:blocks=K, self:int8, or any model with the "
        "target's tokenizer).")
    level_tokens: list[int] = option([], "--level-tokens", group=DRAFTING, cli_default=None, kind=Kind(
        _optional(_either(_str, _list(_int))), "a list of integers", Optional[str]),
        help="T per draft model: tokens a level holds before handing them up (e.g. 2,6).")
    no_db: bool = option(False, "--no-db", kind=BOOL, group=DRAFTING,
                         help="With --draft-models: no DB level; the smallest model drafts alone.")
    plan: str | None = option(None, "--plan", kind=OPT_PATH, group=DRAFTING,
                              help="Use the hierarchy chosen by `hd plan`.")
    # generation; logits processors (OpenAI's) over the generated tokens
    max_new_tokens: int = option(256, "--max-new-tokens", "-n", kind=INT, group=SAMPLING, range=Range(1))
    # OpenAI's API takes temperatures up to 2 (hd serve with it); hd generate any
    temperature: float = option(SAMPLING_DEFAULTS.temperature, "--temperature", kind=NUMBER, group=SAMPLING,
                                help="0 = greedy.", range=SAMPLING_RANGES["temperature"], served=Range(0.0, 2.0))
    top_p: float = option(SAMPLING_DEFAULTS.top_p, "--top-p", kind=NUMBER, group=SAMPLING,
                          range=SAMPLING_RANGES["top_p"])
    # hd serve also takes -1 (off, as vLLM's clients send it), and at most an int32 (theirs)
    top_k: int = option(SAMPLING_DEFAULTS.top_k, "--top-k", kind=INT, group=SAMPLING, help="0 = no top-k "
                        "truncation.", range=SAMPLING_RANGES["top_k"], served=Range(-1, 2 ** 31 - 1))
    frequency_penalty: float = option(SAMPLING_DEFAULTS.frequency_penalty, "--frequency-penalty", kind=NUMBER,
                                      group=SAMPLING, range=SAMPLING_RANGES["frequency_penalty"],
                                      help="OpenAI's, -2..2: lowers a token's logit by this times its "
                                      "count in the output so far.")
    presence_penalty: float = option(SAMPLING_DEFAULTS.presence_penalty, "--presence-penalty", kind=NUMBER,
                                     group=SAMPLING, range=SAMPLING_RANGES["presence_penalty"],
                                     help="OpenAI's, -2..2: lowers the logit of every token already in "
                                     "the output by this.")
    logit_bias: dict[int, float] = option({}, "--logit-bias", group=SAMPLING, cli=List[str], cli_default=[], kind=Kind(
        _optional(_either(lambda v: isinstance(v, dict) and all(map(_number, v.values())), _list(_str))),
        "{token id: number}"), help="TOKEN_ID=BIAS added to that token's logit (-100..100; repeatable).")
    # what the answer comes with (logprobs), and how the prompt is built
    logprobs: int | None = option(None, "--logprobs", kind=OPT_INT, group=OUTPUT, help="With --json: each "
                                  "token's log-probability and this many best alternatives (0-20).",
                                  range=Range(0, MAX_LOGPROBS))
    # hd serve takes OpenAI's seeds: a signed 64-bit integer's
    seed: int | None = option(None, "--seed", kind=OPT_INT, group=SAMPLING, help="Seed for sampling.",
                              range=Range(*SEED_RANGE), served=Range(0, 2 ** 63 - 1))
    chat: bool = option(True, "--chat/--raw", kind=BOOL, group=OUTPUT,
                        help="Apply the model's chat template or not.")
    system: str | None = option(None, "--system", kind=OPT_STR, group=OUTPUT,
                                help="System message for the chat template.")
    stop: list[str] = option([], "--stop", kind=Kind(_optional(_list(_str)), "a list of strings", List[str]),
                             group=OUTPUT, help="Stop string (repeatable).")
    # set by with_plan(): draft_models came from the plan (not serialised)
    from_plan_file: bool = field(default=False, repr=False, compare=False)
    # set by from_plan(): (path, document) of the plan already read, so that with_plan reads the
    # file no second time (`--config plan.json`; not serialised)
    plan_document: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        # the forms options come in (CLI text, JSON, Python) -> one form
        if isinstance(self.layers, str):
            self.layers = [] if self.layers.strip() == "none" else split_list(self.layers)
        if isinstance(self.draft_len, str):
            self.draft_len = parse_draft_len(self.draft_len)
        if isinstance(self.draft_models, str):
            # " , " names no model but was given: kept as [""] so validation refuses it
            self.draft_models = split_list(self.draft_models) or ([""] if self.draft_models else [])
        if isinstance(self.level_tokens, str):
            self.level_tokens = int_list(self.level_tokens, "--level-tokens")
        if isinstance(self.stats_dbs, (str, Path)):
            self.stats_dbs = [self.stats_dbs]
        self.stats_dbs = [str(p) for p in self.stats_dbs or []]
        for name in ("model_db", "plan"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        self.layers = None if self.layers is None else list(self.layers)
        # lists: None (an option not given) is the empty list
        self.draft_models, self.level_tokens, self.stop = (list(self.draft_models or []),
                                                           list(self.level_tokens or []), list(self.stop or []))
        self.logit_bias = parse_logit_bias(self.logit_bias)

    # -- checking ---------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every bad field, one message each naming its option (nothing is loaded)."""
        out = []
        if not RANGES["max_new_tokens"].holds(self.max_new_tokens):
            out.append(f"--max-new-tokens must be >= {RANGES['max_new_tokens'].low}, not {self.max_new_tokens}")
        try:
            self.sampling
        except ValueError as exc:
            out.append(f"invalid sampling option: {exc}")
        if any(s == "" for s in self.stop):
            out.append("--stop takes non-empty strings: an empty one would end every generation at its first token")
        if self.stats_min_prob is not None and not (math.isfinite(self.stats_min_prob) and 0 <= self.stats_min_prob <= 1):
            out.append(f"--stats-min-prob must be between 0 and 1, not {self.stats_min_prob}")
        if self.stats_min_expected is not None and not (math.isfinite(self.stats_min_expected)
                                                        and self.stats_min_expected >= 0):
            out.append(f"--stats-min-expected must be a finite number >= 0, not {self.stats_min_expected}")
        lp = RANGES["logprobs"]
        if self.logprobs is not None and not lp.holds(self.logprobs):
            out.append(f"--logprobs must be in {lp.low}..{lp.high}, not {self.logprobs}")
        if self.seed is not None and not RANGES["seed"].holds(self.seed):
            out.append(f"--seed must be between 0 and 2**64 - 1, not {self.seed}")
        known = registry.names()
        unknown = [n for n in self.layers or [] if n not in known]
        if unknown:
            out.append(f"unknown drafting layer '{unknown[0]}'; known layers: {', '.join(known)}")
        for name in self.layers or []:
            lacks = registry.LAYERS[name].missing(self) if name in known else None
            if lacks:
                out.append(f"layer '{name}' needs {lacks}")
        lens = self.draft_len.items() if isinstance(self.draft_len, dict) else [(None, self.draft_len)]
        bad = [(k, n) for k, n in lens if n < 1]
        if bad:
            k, n = bad[0]
            out.append("--draft-len must be >= 1" + (f" for every layer, not {k}={n}" if k else f", not {n}"))
        if isinstance(self.draft_len, dict):
            unknown = [k for k in self.draft_len if k.split(":")[0] not in known]
            if unknown:
                out.append(f"--draft-len names unknown layer '{unknown[0]}'; known layers: {', '.join(known)}")
        if self.invariant not in ("auto", "on", "off"):
            out.append(f"--invariant must be auto, on or off, not '{self.invariant}'")
        if self.attention not in ("auto", "fused", "torch"):
            out.append(f"--attention must be auto, fused or torch, not '{self.attention}'")
        if self.policy not in POLICIES:
            out.append(f"unknown --policy '{self.policy}'; known: {', '.join(POLICIES)}")
        if self.candidates < 1:
            out.append(f"--candidates must be >= 1, not {self.candidates}")
        if not 1 <= (self.min_n or 1) <= self.max_n:
            out.append(f"n-gram sizes need 1 <= --min-n <= --max-n, got {self.min_n or 1}..{self.max_n}")
        if self.learn and self.model_db is None:
            out.append("--learn adds to a model DB: pass --model-db PATH")
        if self.plan is None and (self.no_db or self.level_tokens) and not self.draft_models:
            out.append("--no-db and --level-tokens go with --draft-models")
        if self.draft_models and self.plan is not None and not self.from_plan_file:
            out.append("pass either --plan or --draft-models, not both")
        elif self.draft_models:
            out += level_problems(self.draft_models, self.level_tokens)
        return out

    def validate(self) -> "DecodingConfig":
        """Raise one HdError listing every bad field (one line, `;`-separated); return self."""
        bad = self.problems()
        if bad:
            raise HdError("; ".join(bad))
        return self

    # -- derived ----------------------------------------------------------------------------
    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                        logit_bias=tuple(self.logit_bias.items()))

    def request(self, prompt_ids: Sequence[int], **fields) -> Request:
        """What one generation of this configuration asks for (engine/decode/request.py): the
        prompt's ids with the configuration's max_new_tokens, sampling, seed, stop strings and
        logprobs, each under a field of the same name in `fields` where one is given (a served
        request's own); grammar, prediction (token ids) and scope are the prompt's. The one place
        a Request is made (generation.Run.request checks it against the context's room)."""
        own = {"max_new_tokens": self.max_new_tokens, "sampling": self.sampling, "seed": self.seed,
               "stop": tuple(self.stop), "logprobs": self.logprobs}
        fields = {**own, **fields}
        spec = fields.get("speculation") or Speculation()
        if spec.governed is None:   # the request leaves it to the run (--governor)
            fields["speculation"] = dataclasses.replace(spec, governed=self.governor)
        return Request(prompt_ids, **fields)

    @property
    def drafting(self) -> bool:
        """Whether the run drafts at all (hd serve: whether requests draft)."""
        return self.layers is None or bool(self.layers or self.draft_models or self.plan)

    def replace(self, **changes) -> "DecodingConfig":
        return dataclasses.replace(self, **changes)

    def with_plan(self) -> tuple["DecodingConfig", dict | None]:
        """The configuration with its plan applied: the plan's draft models, T per level and
        bottom, its dtype where the configuration says auto, and its DBs and layers where none are given (a plan measured with a statistics DB
        and run without it would draft less than it predicted). Returns (config, plan document)."""
        if self.plan is None:
            return self, None
        from .hsd import planner
        if self.plan_document is not None and self.plan_document[0] == self.plan:
            data = planner.check_plan(self.plan, self.plan_document[1])
        else:
            data = planner.read_plan_file(self.plan)
        if self.draft_models and not self.from_plan_file:
            raise HdError("pass either --plan or --draft-models, not both")
        stats, model_db = planner.plan_dbs(self.plan, data, self.stats_dbs, self.model_db)
        chain = data["chain"]
        layers = self.layers
        if layers is None and data.get("db_layers"):
            layers = list(data["db_layers"])
        cfg = self.replace(stats_dbs=[str(p) for p in stats], model_db=None if model_db is None else str(model_db),
                           layers=layers, draft_models=[lv["model"] for lv in chain["levels"]],
                           level_tokens=[int(lv["T"]) for lv in chain["levels"]],
                           no_db=chain["bottom"] == "none", from_plan_file=True)
        if cfg.dtype == "auto" and data.get("dtype"):  # the plan's costs were measured in its dtype
            cfg = cfg.replace(dtype=data["dtype"])
        if not chain["levels"]:  # the plan chose the DB hierarchy alone (one chain) or plain decoding
            cfg = cfg.replace(layers=[] if cfg.no_db else cfg.layers, candidates=1, no_db=False)
        return cfg, data

    # -- serialising ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in UNSERIALISED}

    @classmethod
    def from_dict(cls, data: dict, where: str = "configuration") -> "DecodingConfig":
        known = {f.name for f in dataclasses.fields(cls)} - set(UNSERIALISED)
        unknown = sorted(set(data) - known)
        if unknown:
            raise HdError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(sorted(known))})")
        for name, value in data.items():
            if _not_finite(value):   # NaN and Infinity parse as numbers (JSON, typer) and pass every `<`
                flag = FIELD_FLAGS.get(name) if where == "options" else None
                raise HdError(f"{where}: {flag or f'field {name!r}'} must be a finite number, not "
                              f"{_not_finite(value)}")
            check, what = FIELD_TYPES.get(name, (None, ""))
            if check is not None and not check(value):
                shown = json.dumps(value, default=str)
                raise HdError(f"{where}: field '{name}' must be {what}, not "
                              f"{shown if len(shown) <= 60 else shown[:57] + '...'}")
        try:
            return cls(**data)
        except (TypeError, ValueError, AttributeError) as exc:
            raise HdError(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path) -> "DecodingConfig":
        """A JSON configuration: a bare one, any hd `--json` output or bench summary that records
        one (its "config"), or a plan written by `hd plan --out` (its target, dtype and chain)."""
        if inputs.kind_of(path) == "missing":
            raise HdError(f"config {path} not found")
        text = inputs.read_text(path, "--config", inputs.DOCUMENT_BYTES, "a configuration is a JSON file hd wrote: pass that")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise HdError(f"cannot read config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise HdError(f"config {path}: a JSON object is needed")
        if data.get("kind") == "hd-plan":
            return cls.from_plan(path, data)
        if isinstance(data.get("config"), dict):
            data = data["config"]
        return cls.from_dict(data, where=f"config {path}")

    @classmethod
    def from_plan(cls, path, data: dict | None = None) -> "DecodingConfig":
        from .hsd import planner
        data = data or planner.read_plan_file(path)
        return cls(model=data.get("target", DEFAULT_MODEL), dtype=data.get("dtype", "auto"),
                   kernels=data.get("kernels", "auto"), plan=str(path), plan_document=(str(path), data))


UNSERIALISED = ("from_plan_file", "plan_document")   # what a run sets for itself, never written out


# What each field takes, from its declaration (from_dict checks it; hsd/planner reads plans by it)
FIELD_TYPES = {f.name: (f.metadata["kind"].check, f.metadata["kind"].what)
               for f in dataclasses.fields(DecodingConfig) if "kind" in f.metadata}
FIELD_FLAGS = {f.name: f.metadata["flags"][0] for f in dataclasses.fields(DecodingConfig) if f.metadata.get("flags")}
# the numbers each number field takes, and hd serve's where OpenAI's API takes fewer
RANGES = {f.name: f.metadata["range"] for f in dataclasses.fields(DecodingConfig) if "range" in f.metadata}
SERVED_RANGES = {**RANGES, **{f.name: f.metadata["served"] for f in dataclasses.fields(DecodingConfig)
                             if "served" in f.metadata}}


def served_bounds(name: str) -> dict:
    """A field's range in hd serve's request schema, as pydantic's Field takes it (ge/gt, le)."""
    return SERVED_RANGES[name].bounds()


def sampling_fields(sampling: Sampling) -> dict[str, Any]:
    """A Sampling as the DecodingConfig fields it is made from (config.sampling gives it back)."""
    fields = dataclasses.asdict(sampling)
    return {**fields, "logit_bias": dict(fields["logit_bias"])}


def level_problems(draft_models: Sequence[str], level_tokens: Sequence[int]) -> list[str]:
    """What is wrong with a list of draft models and their T per level (empty names ignored)."""
    names = [n for n in draft_models if n.strip()]
    if not names:
        return ["--draft-models is empty: name at least one draft model (e.g. self:blocks=8)"]
    Ts = list(level_tokens)
    if Ts and len(Ts) != len(names):
        return [f"--level-tokens gives {len(Ts)} sizes for {len(names)} draft models"]
    if any(t < 1 for t in Ts):
        return [f"--level-tokens must all be >= 1, not {Ts}"]
    return []


def split_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HdError(f"{flag} takes comma-separated numbers, not '{text}'") from None


def parse_draft_len(spec: str | int) -> int | dict[str, int]:
    """'16' -> 16; 'context=16,stats=8' -> {'context': 16, 'stats': 8}."""
    if isinstance(spec, int):
        return spec
    try:
        if "=" not in spec:
            return int(spec)
        out = {}
        for part in spec.split(","):
            name, _, n = part.partition("=")
            out[name.strip()] = int(n)
        return out
    except ValueError:
        raise HdError(f"--draft-len takes a number or layer=number pairs (context=16,stats=8), "
                      f"not {spec!r}") from None


def _not_finite(value) -> str | None:
    """The first NaN or infinity in a value (a number, or a dict's values or a list's items, as
    --logit-bias's), as written; None where there is none."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if isinstance(v, str) and "=" in v:   # a CLI item TOKEN=BIAS
            v = v.partition("=")[2].strip()
            try:
                v = float(v)
            except ValueError:
                continue
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
    return None


def parse_logit_bias(spec) -> dict[int, float]:
    """{token id: bias} from a dict (JSON's keys are strings) or CLI items 'ID=BIAS'."""
    if not spec:
        return {}
    items = spec.items() if isinstance(spec, dict) else (str(x).partition("=")[::2] for x in spec)
    out = {}
    try:
        for k, v in items:
            out[int(k)] = float(v)
    except (TypeError, ValueError):
        raise HdError(f"--logit-bias takes TOKEN_ID=BIAS items (e.g. 13=-100), not {spec!r}") from None
    return out

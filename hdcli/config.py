"""DecodingConfig: everything one decoding run is built from, in one object.

A run is built from one configuration: the CLI parses its options into one, `hd plan --out`
and every `--json` output hold one (`hd generate --config FILE` repeats the run), and Python code
makes one directly. `validate()` is the one place options are checked; `compose.build_drafter`
is the one place a configuration becomes the thing that drafts.

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
from typing import Any, Sequence

from .engine.loader import DEFAULT_MODEL
from .engine.decode.verify import Sampling
from .errors import HdError

DEFAULT_POLICY = "fill-tracked"  # measured: docs/engine.md, "Drafting policies"
DEFAULT_CANDIDATES = 4
DEFAULT_DRAFT_LEN = 16
DEFAULT_LEVEL_TOKENS = 4
POLICIES = ("first-hit", "fill", "fill-tracked", "adaptive")
SEED_RANGE = (0, 2 ** 64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20               # alternatives a token's log-probability comes with (OpenAI's most)


@dataclass
class DecodingConfig:
    # the target model and how it runs
    model: str = DEFAULT_MODEL          # bundled name, .gguf file, model folder or Hugging Face id
    dtype: str = "auto"                 # auto|bf16|fp16|fp32
    device: str = "auto"                # auto|cpu|cuda
    kernels: str = "auto"               # auto|gguf|onednn|torch (int4: an alias of gguf)
    invariant: str = "auto"             # auto|on|off: the M-invariant forward (engine/kernels/invariant.py)
    attention: str = "auto"             # auto|fused|torch: the invariant attention's kernel (fused.py);
                                        # auto times both once per machine; a run records its choice
    # the database hierarchy
    layers: list[str] | None = None     # most local first; [] = plain decoding; None = default
    policy: str = DEFAULT_POLICY        # first-hit|fill|fill-tracked|adaptive (drafting.Hierarchy)
    candidates: int = DEFAULT_CANDIDATES  # C: candidates per step, verified as one token tree
    draft_len: int | dict[str, int] = DEFAULT_DRAFT_LEN  # most tokens per candidate, or per layer
    min_n: int | None = None            # shortest context-DB key
    max_n: int = 4                      # longest context-DB key
    stats_dbs: list[str] = field(default_factory=list)   # asked in this order
    model_db: str | None = None
    stats_min_prob: float | None = None
    stats_min_expected: float | None = None
    learn: bool = False                 # add what was generated to the model DB
    # draft models stacked above the database hierarchy (hdcli/hsd), or a plan that chose them
    draft_models: list[str] = field(default_factory=list)  # smallest first
    level_tokens: list[int] = field(default_factory=list)  # T per draft model
    no_db: bool = False                 # the smallest draft model drafts alone
    plan: str | None = None             # a file written by `hd plan --out`
    # generation
    max_new_tokens: int = 256
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    # logits processors (OpenAI's), over the generated tokens; logit_bias {token id: bias}
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None         # return each token's log-probability and this many best
    seed: int | None = None
    chat: bool = True                   # through the model's chat template
    system: str | None = None
    stop: list[str] = field(default_factory=list)
    # set by with_plan(): draft_models came from the plan (not serialised)
    from_plan_file: bool = field(default=False, repr=False, compare=False)

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
        from .drafting import registry
        out = []
        if self.max_new_tokens < 1:
            out.append(f"--max-new-tokens must be >= 1, not {self.max_new_tokens}")
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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            out.append(f"--logprobs must be in 0..{MAX_LOGPROBS}, not {self.logprobs}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "from_plan_file"}

    @classmethod
    def from_dict(cls, data: dict, where: str = "configuration") -> "DecodingConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"from_plan_file"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HdError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(sorted(known))})")
        for name, value in data.items():
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
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            raise HdError(f"config {path} not found") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
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
                   kernels=data.get("kernels", "auto"), plan=str(path))


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str(v) -> bool:
    return isinstance(v, str)


def _path(v) -> bool:
    return isinstance(v, (str, os.PathLike))


def _list(item):
    return lambda v: isinstance(v, (list, tuple)) and all(map(item, v))


def _optional(check):
    return lambda v: v is None or check(v)


def _either(*checks):
    return lambda v: any(c(v) for c in checks)


# What each field takes (a JSON configuration, the CLI's parsed options, Python): from_dict refuses
# anything else in one line naming the field, so "eight" is never a token count, 8.7 never 9 and
# true never 1. A field not listed here is not checked by type.
FIELD_TYPES = {
    **{name: (_str, "a string") for name in ("model", "dtype", "device", "kernels", "invariant", "attention",
                                             "policy")},
    "layers": (_optional(_either(_str, _list(_str))), "a list of layer names (or null for the default)"),
    "candidates": (_int, "an integer"),
    "draft_len": (_either(_int, _str, lambda v: isinstance(v, dict) and all(map(_str, v)) and all(map(_int, v.values()))),
                  "an integer or {layer: integer}"),
    "min_n": (_optional(_int), "an integer or null"),
    "max_n": (_int, "an integer"),
    "stats_dbs": (_optional(_either(_path, _list(_path))), "a list of paths"),
    "model_db": (_optional(_path), "a path or null"),
    "stats_min_prob": (_optional(_number), "a number or null"),
    "stats_min_expected": (_optional(_number), "a number or null"),
    "learn": (lambda v: isinstance(v, bool), "true or false"),
    "draft_models": (_optional(_either(_str, _list(_str))), "a list of draft model names"),
    "level_tokens": (_optional(_either(_str, _list(_int))), "a list of integers"),
    "no_db": (lambda v: isinstance(v, bool), "true or false"),
    "plan": (_optional(_path), "a path or null"),
    "max_new_tokens": (_int, "an integer"),
    "temperature": (_number, "a number"),
    "top_p": (_number, "a number"),
    "top_k": (_int, "an integer"),
    "frequency_penalty": (_number, "a number"),
    "presence_penalty": (_number, "a number"),
    "logit_bias": (_optional(_either(lambda v: isinstance(v, dict) and all(map(_number, v.values())), _list(_str))),
                   "{token id: number}"),
    "logprobs": (_optional(_int), "an integer or null"),
    "seed": (_optional(_int), "an integer or null"),
    "chat": (lambda v: isinstance(v, bool), "true or false"),
    "system": (_optional(_str), "a string or null"),
    "stop": (_optional(_list(_str)), "a list of strings"),
}


def level_problems(draft_models: Sequence[str], level_tokens: Sequence[int]) -> list[str]:
    """What is wrong with a list of draft models and their T per level (empty names ignored)."""
    names = [n for n in draft_models if n.strip()]
    if not names:
        return ["--draft-models is empty: name at least one draft model (e.g. self:layers=8)"]
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

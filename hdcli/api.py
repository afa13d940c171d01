"""The Python API: the names a program that decodes with hd calls, in one place.

    from hdcli import api
    cfg = api.DecodingConfig(max_new_tokens=128)      # or DecodingConfig.from_file("run.json")
    lm = api.load_model_for(cfg)
    res = api.generate(lm, "Summarise: ...", config=cfg)
    print(res.text, res.stats.mean_accepted)

A run is built from one DecodingConfig (hdcli/config.py); compose.build_drafter turns it and a
loaded model into the drafter. Each name lives where its work is done; this module only gathers
them:

  configuration   DecodingConfig: everything a run is built from, validated in one place;
                  Sampling: how each next token is chosen (temperature 0: greedy; top_k,
                  top_p, penalties, logit_bias; generate takes them as the configuration's
                  fields: config.sampling_fields(s) gives a Sampling's);
                  HdError: every error a user can fix, one line
  models, text    load_model(name, dtype=, device=, kernels=): a target by bundled name, GGUF,
                  folder or hub id; load_model_for(cfg): the configuration's;
                  encode_prompt / encode_messages: a prompt or chat messages as token ids
  generation      generate(lm, prompt, config=, drafter=, grammar=, prediction=, **fields) -> Result
                  (text, tokens, the layer of each token, stop_reason, stats), greedy output equal
                  to plain decoding's; compile_grammar(lm, kind, source): a grammar the answer
                  follows; prepare(cfg) -> Run: the plan applied, the options checked, the DBs
                  open, the model loaded, then run.request(prompt_ids) -> Request (the context's
                  room checked), run.drafter() and run.generate(request, drafter) -> Result
  drafters        build_drafter(cfg, lm): the configuration's drafter (the one place drafters are
                  put together); make_drafter(layers, stats_stores=, model_db=, ...): a DB
                  hierarchy from open DBs; make_stack(lm, draft_models, ...): draft models over
                  one; default_layers: the
                  hierarchy run when none is given; open_stats_dbs(paths, lm): open DBs checked
                  against lm's tokenizer; cheap_verification(lm): whether verification is nearly
                  free here (it picks the drafting defaults); warm_up(lm): before timing a run
  learning        learn(model_db, prompt_ids, tokens): add a generation to a model DB

The `hd` commands' own functions live in their packages, and the CLI calls them there:
`hd generate` commands/generate.generate_report, `hd plan` commands/plan.plan, `hd bench`
commands/bench.bench_spec_bench and bench_agents, `hd build-stats`, `hd build-model-db` and
`hd db info|query` commands/db.py, `hd costs` engine/cost_report.cost_report, `hd models`
engine/local_models.report, `hd serve` serve/server.Server.
"""
from __future__ import annotations

from typing import Sequence

from .compose import (build_drafter, cheap_verification, load_model_for, make_drafter, make_stack,
                      open_stats_dbs, warm_up)
from .config import DecodingConfig
from .db.modeldb import learn
from .drafting import registry
from .engine import loader
from .engine.decode.request import Speculation
from .engine.decode.verify import Sampling
from .engine.text.prompts import encode_messages, encode_prompt
from .errors import HdError
from .generation import NoRoom, Result, Run, compile_grammar, generate, prepare

__all__ = [
    "DecodingConfig", "Sampling", "Speculation", "HdError",
    "load_model", "load_model_for", "encode_prompt", "encode_messages",
    "generate", "Result", "compile_grammar", "prepare", "Run", "NoRoom",
    "build_drafter", "make_drafter", "make_stack", "default_layers", "open_stats_dbs", "cheap_verification",
    "warm_up",
    "learn"]

load_model = loader.load


def default_layers(stats_dbs: Sequence = (), model_db=None) -> list[str]:
    """The hierarchy run when no layers are given, most local first (drafting.registry).
    Default order: context → model (model: the model DB's answers where given, and this process's;
    stats and recycle when named)."""
    return registry.default_layers(registry.LayerInputs(stats_stores=list(stats_dbs), model_db=model_db))

"""DecodingConfig (one object a run is built from), compose.build_drafter, the layer registry; a
configuration file's fields of the wrong type are one line naming them."""
from __future__ import annotations

import json

import pytest

from hdcli import api, compose
from hdcli.config import DecodingConfig
from hdcli.drafting import Hierarchy, LayerSpec, model, registry
from hdcli.errors import HdError
from hdcli.hsd.stack import ModelStack

from conftest import FakeLayer, hd_main



def test_every_form_of_an_option_gives_one_config():
    a = DecodingConfig(layers="context, stats", draft_len="context=8,stats=4", draft_models="x, y",
                       level_tokens="2,6", stats_dbs=["s.lmdb"])
    b = DecodingConfig(layers=["context", "stats"], draft_len={"context": 8, "stats": 4},
                       draft_models=["x", "y"], level_tokens=[2, 6], stats_dbs=["s.lmdb"])
    assert a == b
    assert DecodingConfig(layers="none").layers == []
    assert DecodingConfig.from_dict(json.loads(json.dumps(a.to_dict()))) == a


def test_every_bad_field_is_named_in_one_line():
    cfg = DecodingConfig(max_new_tokens=0, candidates=0, policy="bogus", layers=["nope", "stats"],
                         seed=-1, temperature=float("nan"), learn=True)
    problems = cfg.problems()
    for needle in ("--max-new-tokens", "--candidates", "--policy 'bogus'", "layer 'nope'",
                   "layer 'stats' needs a statistics DB", "--seed", "invalid sampling option",
                   "--learn adds to a model DB"):
        assert any(needle in p for p in problems), (needle, problems)
    with pytest.raises(HdError) as err:
        cfg.validate()
    assert "\n" not in str(err.value)
    assert DecodingConfig().problems() == []
    with pytest.raises(HdError, match="unknown field 'candidate'"):
        DecodingConfig.from_dict({"candidate": 3})
    with pytest.raises(HdError, match="go with --draft-models"):
        DecodingConfig(no_db=True).validate()
    with pytest.raises(HdError, match="--draft-models is empty"):  # given, but naming no model
        DecodingConfig(draft_models=" , ").validate()
    with pytest.raises(HdError, match="2 sizes for 1 draft models"):
        DecodingConfig(draft_models=["self:layers=1"], level_tokens=[2, 3]).validate()


def test_from_file_reads_a_run_record_a_bare_config_and_refuses_junk(tmp_path):
    cfg = DecodingConfig(candidates=2, layers=["context"], max_new_tokens=9)
    (tmp_path / "bare.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "run.json").write_text(json.dumps({"text": "x", "config": cfg.to_dict()}))
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert DecodingConfig.from_file(tmp_path / "bare.json") == cfg
    assert DecodingConfig.from_file(tmp_path / "run.json") == cfg
    with pytest.raises(HdError, match="a JSON object is needed"):
        DecodingConfig.from_file(tmp_path / "junk.json")
    with pytest.raises(HdError, match="not found"):
        DecodingConfig.from_file(tmp_path / "missing.json")


def test_build_drafter_gives_nothing_a_hierarchy_or_a_stack(tiny_lm):
    assert compose.build_drafter(DecodingConfig(layers=[]), tiny_lm) is None
    h = compose.build_drafter(DecodingConfig(candidates=3, policy="adaptive"), tiny_lm)
    # the model layer without a DB: this process's answers (where arctic-inference is installed)
    assert isinstance(h, Hierarchy) and [l.name for l in h.layers] == ["context", "model"][:1 + model.available()]
    assert (h.max_candidates, h.policy) == (3, "adaptive")
    stack = compose.build_drafter(DecodingConfig(draft_models=["self:layers=1"], level_tokens=[3]), tiny_lm)
    assert isinstance(stack, ModelStack)
    assert stack.all_levels[0].hier.max_candidates == 1  # a level under models verifies one chain


class _RepeatLast(FakeLayer):
    """A toy layer: drafts the last token again (rarely right, so the verifier must reject it)."""
    name = "repeat"

    def candidates(self, history, max_len, max_candidates=1):
        return [[history[-1]] * max_len] if history else []


@pytest.fixture
def repeat_layer():
    registry.register(LayerSpec(name="repeat", build=lambda s: [_RepeatLast()], help="toy",
                                prior=(0.1, 0.5, 0.5, 0.5)))
    yield
    del registry.LAYERS["repeat"], registry.PRIOR_RATES["repeat"]


def test_a_registered_layer_runs_without_touching_the_cli_and_stays_exact(tiny_lm, repeat_layer):
    cfg = DecodingConfig(layers=["context", "repeat"], max_new_tokens=40, chat=False)
    prompt = "the cat sat on the mat the cat sat on"
    plain = api.generate(tiny_lm, prompt, config=cfg.replace(layers=[]), drafter=None)
    res = api.generate(tiny_lm, prompt, config=cfg)
    assert res.tokens == plain.tokens
    assert res.stats.layers["repeat"].drafted > 0  # it did draft, and the target judged it
    assert "repeat" not in api.default_layers()


def test_generate_json_records_a_config_that_repeats_the_run(tiny_model_dir, tmp_path):
    args = ["generate", "--model", str(tiny_model_dir), "-p", "the cat sat on the", "-n", "12",
            "--raw", "--candidates", "2", "--json"]
    first = hd_main(*args)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run.json"
    run.write_text(first.stdout)
    rec = json.loads(first.stdout)
    assert rec["config"]["candidates"] == 2 and rec["config"]["layers"] == ["context", "model"]
    assert rec["config"]["kernels"] in ("torch", "onednn") and rec["config"]["min_n"] in (1, 2)
    again = hd_main("generate", "-p", "the cat sat on the", "--config", str(run), "--json")
    assert again.returncode == 0, again.stderr
    rec2 = json.loads(again.stdout)
    assert rec2["tokens"] == rec["tokens"] and rec2["config"] == rec["config"]
    # an option given beside --config wins over the file
    over = hd_main("generate", "-p", "the cat sat on the", "--config", str(run), "-n", "3", "--json")
    assert json.loads(over.stdout)["config"]["max_new_tokens"] == 3


def test_the_default_order_is_declared_not_the_import_order():
    """The layers' place comes from LayerSpec.rank (import order once moved `stats` by accident);
    a layer registered later with a lower rank goes before them. Control: without a rank it goes last."""
    assert registry.names()[:4] == ("context", "stats", "model", "recycle")
    try:
        registry.register(LayerSpec(name="early", build=lambda s: [], help="toy", prior=(0.1,) * 4, rank=-1))
        registry.register(LayerSpec(name="late", build=lambda s: [], help="toy", prior=(0.1,) * 4))
        assert registry.names() == ("early", "context", "stats", "model", "recycle", "late")
    finally:
        for name in ("early", "late"):
            registry.LAYERS.pop(name, None), registry.PRIOR_RATES.pop(name, None)


def test_a_configuration_makes_the_request_of_one_generation():
    """DecodingConfig.request: the API's and the CLI's one place a Request is made."""
    from hdcli.engine.decode.request import Request, Speculation
    cfg = DecodingConfig(max_new_tokens=9, temperature=0.5, top_k=3, seed=7, stop=["\n"], logprobs=2)
    r = cfg.request([1, 2, 3], prediction=[4, 5])
    assert r == Request((1, 2, 3), 9, cfg.sampling, 7, stop=("\n",), logprobs=2, prediction=(4, 5),
                        speculation=Speculation(governed=False))   # the run's --governor, off
    assert cfg.request([1], max_new_tokens=4).max_new_tokens == 4       # the room the context leaves
    assert Request.of([1, 2], max_new_tokens=3) == Request((1, 2), 3)   # the decode loop's shorthand
    assert Request.of(r, choice=1) == r.replace(choice=1) and r.choice == 0


def test_serve_takes_each_range_from_the_configuration():
    """One declaration per option: hd serve's request schema reads the configuration's ranges, and
    takes less only where OpenAI's API does (temperature up to 2, top_k -1 as off)."""
    from hdcli.serve.protocol import ApiError, CompletionRequest, parse

    def refused(**fields) -> bool:
        try:
            parse(CompletionRequest, {"model": "m", "prompt": "x", **fields})
            return False
        except ApiError:
            return True
    assert refused(temperature=-0.5) and refused(temperature=2.5) and not refused(temperature=2.0)
    assert DecodingConfig(temperature=2.5).problems() == []
    assert refused(top_p=0.0) and not refused(top_p=1.0) and refused(frequency_penalty=2.5)
    assert refused(max_tokens=0) and not refused(top_k=-1) and refused(top_k=-2)
    assert refused(seed=2 ** 63) and DecodingConfig(seed=2 ** 63).problems() == []
    assert any("--frequency-penalty" in p or "frequency_penalty" in p
               for p in DecodingConfig(frequency_penalty=2.5).problems())


def test_each_option_states_the_default_the_code_takes():
    """Every default a help text states is the one the code takes: the machine's drafting
    defaults (compose.py, by the measured cost curve), the default hierarchy and hd serve's."""
    import dataclasses
    import re

    from hdcli.serve import tenants
    from hdcli.serve.options import ServeOptions
    helps = {f.name: f.metadata.get("help") or "" for cls in (DecodingConfig, ServeOptions)
             for f in dataclasses.fields(cls)}
    defaults = {f.name: f.default for f in dataclasses.fields(ServeOptions)}
    by_cost = {"min_n": compose.default_min_n, "stats_min_prob": compose.default_min_prob,
               "stats_min_expected": compose.default_min_expected}
    for name, choose in by_cost.items():
        cheap, costly = re.search(r"default: (\S+) where `hd costs` finds verification cheap[^,]*, else ([\d.]+)",
                                  helps[name]).groups()
        assert (float(cheap), float(costly)) == (choose(True), choose(False)), name
    assert DecodingConfig().layers is None
    stated = re.search(r"Default: (\w+), (\w+) \(model: the model DB's answers where given, and this process's\) "
                       r"\((\w+), (\w+): when named\)", " ".join(helps["layers"].split())).groups()
    assert registry.default_layers(registry.LayerInputs()) == list(stated[:2])
    assert registry.default_layers(registry.LayerInputs(stats_stores=["s"], model_db="m")) == list(stated[:2])
    assert set(stated[2:]) == set(registry.names()) - set(stated[:2])
    assert "loopback by default" in helps["host"] and defaults["host"] == "127.0.0.1"
    assert "default: key with several keys, else shared" in helps["learn_scope"]
    assert defaults["learn_scope"] is None
    assert tenants.default_scope(tenants.Keys([("a", "1"), ("b", "2")])) == "key"
    assert tenants.default_scope(tenants.Keys([("a", "1")])) == tenants.default_scope(None) == "shared"
    assert "default: open" in helps["protect_metrics"] and defaults["protect_metrics"] is False
    assert "default: the --model given" in helps["name"] and defaults["name"] is None


def test_a_run_is_put_together_once(tiny_lm, tmp_path, monkeypatch):
    """hd generate's run: its plan read once, its fields checked once, one Request made per
    prompt; and a served request's ask beyond the context's room is refused there, the
    configuration's own cut to it and said."""
    from hdcli import generation
    from hdcli.commands.generate import generate_report
    from hdcli.hsd import planner
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kind": "hd-plan", "target": tiny_lm.name, "dtype": tiny_lm.dtype,
                                "chain": {"bottom": "db", "levels": []}, "db_layers": ["context"]}))
    reads, checks, made = [], [], []
    read, validate, request = planner.read_plan_file, DecodingConfig.validate, DecodingConfig.request
    monkeypatch.setattr(planner, "read_plan_file", lambda path: reads.append(path) or read(path))
    monkeypatch.setattr(DecodingConfig, "validate", lambda self: checks.append(1) or validate(self))
    monkeypatch.setattr(DecodingConfig, "request", lambda self, ids, **kw: made.append(1) or request(self, ids, **kw))
    rep = generate_report(DecodingConfig(plan=str(plan), max_new_tokens=4), "the cat sat", lm=tiny_lm)
    assert len(rep.data["tokens"]) <= 4 and rep.data["layers"] == ["context"]
    assert (len(reads), len(checks), len(made)) == (1, 1, 1)
    run = generation.Run(DecodingConfig(max_new_tokens=10 ** 6), tiny_lm)
    ids = [5, 6, 7]
    room = tiny_lm.max_context - len(ids)
    with pytest.raises(generation.NoRoom) as no:
        run.request(ids, {"max_new_tokens": room + 1})
    assert no.value.asked == room + 1 and f"at most {room}" in str(no.value)
    cut = []
    assert run.request(ids, on_cut=lambda asked, left: cut.append((asked, left))).max_new_tokens == room
    assert cut == [(10 ** 6, room)]
    with pytest.raises(generation.NoRoom, match="shorten the prompt"):
        run.request([5] * tiny_lm.max_context)


def test_a_plan_given_as_the_configuration_is_read_once(tiny_model_dir, tiny_lm, tmp_path, monkeypatch):
    """`--config plan.json` (and DecodingConfig.from_file of a plan): the file is read once, its
    document applied as `--plan`'s (it had been read again by with_plan); a `--plan` of another
    file than the one read is read itself."""
    from hdcli import inputs
    from hdcli.commands.generate import generate_report
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kind": "hd-plan", "target": tiny_lm.name, "dtype": tiny_lm.dtype,
                                "chain": {"bottom": "db", "levels": []}, "db_layers": ["context"]}))
    reads = []
    read = inputs.read_text
    monkeypatch.setattr(inputs, "read_text", lambda path, *a, **kw: reads.append(str(path)) or read(path, *a, **kw))
    cfg = DecodingConfig.from_file(plan)
    rep = generate_report(cfg.replace(max_new_tokens=4), "the cat sat", lm=tiny_lm)
    assert rep.data["layers"] == ["context"] and reads == [str(plan)]
    reads.clear()
    p = hd_main("generate", "--config", plan, "-m", tiny_model_dir, "-p", "the cat sat", "-n", "4", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["layers"] == ["context"] and reads == [str(plan)]
    other = tmp_path / "other.json"
    other.write_text(plan.read_text())
    reads.clear()
    generate_report(cfg.replace(plan=str(other), max_new_tokens=4), "the cat sat", lm=tiny_lm)
    assert reads == [str(other)]


# --- fields of a configuration file of the wrong type -----------------------------------------

@pytest.mark.parametrize("field,value,want", [
    ("max_new_tokens", "eight", "field 'max_new_tokens' must be an integer, not \"eight\""),
    ("max_new_tokens", 8.7, "field 'max_new_tokens' must be an integer, not 8.7"),
    ("max_new_tokens", True, "field 'max_new_tokens' must be an integer, not true"),
    ("draft_len", {"context": "x"}, "field 'draft_len' must be an integer or {layer: integer}"),
    ("stop", "abc", "field 'stop' must be a list of strings"),
    ("stats_dbs", [1], "field 'stats_dbs' must be a list of paths"),
    ("learn", "yes", "field 'learn' must be true or false"),
    ("temperature", "hot", "field 'temperature' must be a number"),
])
def test_config_fields_of_the_wrong_type_are_one_line(tmp_path, field, value, want):
    from hdcli.config import DecodingConfig
    f = tmp_path / "run.json"
    f.write_text(json.dumps({field: value}))
    with pytest.raises(HdError) as exc:
        DecodingConfig.from_file(f)
    assert want in str(exc.value) and str(f) in str(exc.value) and "\n" not in str(exc.value)


def test_config_types_that_are_right_still_read(tmp_path):
    from hdcli.config import DecodingConfig
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"max_new_tokens": 8, "temperature": 1, "draft_len": {"context": 4}, "stop": ["x"],
                             "stats_min_prob": 0, "layers": None, "seed": None}))
    cfg = DecodingConfig.from_file(f)
    assert cfg.max_new_tokens == 8 and cfg.temperature == 1 and cfg.draft_len == {"context": 4}

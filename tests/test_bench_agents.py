"""`hd bench agents` (issue 48, item 5): its workloads load and are well-formed, its validator is
right, and on the bundled model one question of each workload gives ar's answer under hd, and
constrained answers that validate."""
from __future__ import annotations

import json

import pytest

from hdcli.bench import agents
from hdcli.errors import HdError


def _items(workload: str, limit: int) -> list:
    try:
        return agents.load([workload], limit=limit)
    except HdError as exc:   # the shared data sets are not part of the repository
        pytest.skip(str(exc))


def _types(schema) -> set:
    if isinstance(schema, list):
        return set().union(*map(_types, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    got = {schema["type"]} if isinstance(schema.get("type"), str) else set()
    for k, v in schema.items():
        if k == "properties":
            got |= set().union(*map(_types, v.values())) if v else set()
        elif k in ("items", "anyOf", "oneOf"):
            got |= _types(v)
    return got


def test_tools_workload_covers_every_subset_and_choice():
    items = _items("tools", 12)
    assert {i.category for i in items} == {f"tools/{s}/{c}" for s in agents.BFCL_SUBSETS
                                           for c in agents.TOOL_CHOICES}
    for i in items:
        assert i.messages and i.messages[-1]["role"] == "user" and i.tools
        assert i.parallel == i.category.startswith("tools/parallel/")
        # BFCL's own types are mapped to JSON Schema's
        assert not _types([t.parameters for t in i.tools]) & {"dict", "float", "tuple", "any"}


def test_json_workload_alternates_bfcl_and_own_schemas():
    items = _items("json", 6)
    assert [i.category for i in items] == ["json/bfcl", "json/own"] * 3
    for i in items:
        assert i.schema["type"] == "object" and json.dumps(i.schema) in i.messages[0]["content"]
    own = [i for i in _items("json", 40) if i.category == "json/own"]
    assert len(own) == len(agents.OWN_REQUESTS) and {id(i.schema) for i in own} == {id(s) for s in agents.OWN_SCHEMAS.values()}


def test_edits_workload_sends_the_file_as_the_prediction():
    items = _items("edits", 8)
    assert [i.category for i in items] == [f"edits/{k}" for k in agents.EDIT_KINDS] * 2
    for i in items:
        code = agents.code_of(i.prediction)
        assert i.prediction in i.messages[0]["content"]            # the file as sent is the prediction
        assert 10 <= code.count("\n") <= 40 and agents.parse_python(i.extra["original"])
        assert (code != i.extra["original"]) == (i.category == "edits/fix_bug")   # the bug is put in


@pytest.mark.parametrize("value, ok", [
    ({"name": "a", "n": 3, "tags": ["x"]}, True),
    ({"name": "a", "n": 3.5, "tags": ["x"]}, False),          # integer
    ({"name": "a", "tags": ["x"]}, False),                     # required
    ({"name": "a", "n": 3, "tags": ["x"], "z": 1}, False),     # additionalProperties false
    ({"name": "a", "n": 3, "tags": ["x", "y", "z"]}, False),   # maxItems
    ({"name": "a", "n": 9, "tags": []}, False),                # maximum
    ({"name": "b", "n": 3, "tags": []}, False),                # enum
    ({"name": "a", "n": True, "tags": []}, False),             # a bool is not an integer
])
def test_problem_checks_the_schema_keywords_the_workloads_use(value, ok):
    schema = {"type": "object", "properties": {"name": {"enum": ["a"]}, "n": {"type": "integer", "maximum": 5},
                                                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
              "required": ["name", "n"], "additionalProperties": False}
    assert (agents.problem(value, schema) is None) == ok


@pytest.mark.bundled
def test_one_question_of_each_workload_same_under_hd_and_valid(bundled_lm, monkeypatch):
    """tools (tool_choice required), json (a schema of ours) and edits (the file as the
    prediction): hd's greedy answer is ar's token for token; the constrained answers validate; the
    grammar and prediction layers draft."""
    from hdcli.compose import DBs
    from hdcli.config import DecodingConfig
    from hdcli.engine.decode import costs
    from hdcli.engine.decode.verify import Sampling
    # a flat cost curve: no minutes measuring this machine's, and the cap keeps every drafted node
    monkeypatch.setattr(costs, "curve_for", lambda lm, *a, **k: costs.flat(1.0))
    items = [next(i for i in _items("tools", 2) if i.tool_choice == "required"),
             next(i for i in _items("json", 40) if i.question_id == "own_2_review"), _items("edits", 1)[0]]
    runners = agents.make_runners(bundled_lm, ["ar", "hd"], DecodingConfig(), DBs())
    results, checks = agents.run(bundled_lm, items, runners, Sampling(), 0, max_new_tokens=64)
    for n, item in enumerate(items):
        ar, hd = results["ar"][n][1][0], results["hd"][n][1][0]
        assert hd.tokens == ar.tokens, item.question_id
        if item.workload != "edits":   # constrained: complete within 64 tokens, and valid
            assert ar.tokens[-1] in bundled_lm.eos_ids, (item.question_id, ar.text)
            assert checks["ar"][n]["valid"] and checks["hd"][n]["valid"], (item.question_id, ar.text)
    layers = {k for _, turns in results["hd"] for k, v in turns[0].layers.items() if v["accepted"]}
    assert {"grammar", "prediction"} <= layers
    summary = agents.summarize(results, checks)
    assert summary["hd"]["workloads"]["json"]["differ_from_ar"] == 0
    assert summary["ar"]["workloads"]["tools"]["valid_rate"] == 1.0


@pytest.mark.parametrize("args, says", [
    (["--workloads", "tools,foo"], "error: unknown workload 'foo'; known: tools, json, edits"),
    (["--workloads", "json", "--bfcl", "{tmp}"], "error: --bfcl {tmp}: no BFCL_v4_simple_python.json there"),
    (["--methods", "hd"], "error: --methods must include 'ar'"),
])
def test_bad_options_are_one_line_before_the_model_loads(args, says, tmp_path):
    from conftest import hd_main, one_line_error
    p = hd_main("bench", "agents", *[a.format(tmp=tmp_path) for a in args])
    line = one_line_error(p)
    assert line.startswith(says.format(tmp=tmp_path)) and p.stderr.strip() == line, p.stderr

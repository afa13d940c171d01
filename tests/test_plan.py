"""hd plan (hdcli/hsd/planner.py): the expected-latency model (the classic formula, Monte Carlo, DP
vs brute force), and the plan files it writes (their fields checked, the DBs they carry drafted
from)."""
from __future__ import annotations

import json
import random

import pytest

from hdcli.db import stores
from hdcli.errors import HdError
from hdcli.hsd.planner import Chain, Params, brute_force, dp, expected_rounds, simulate, tokens_per_second, x_dist

from conftest import hd_main, one_line_error, stats_db_file


def linear(base: float, per_token: float):
    return lambda w: base + per_token * (w - 1)


@pytest.mark.parametrize("a,T,c", [(0.6, 4, 0.1), (0.8, 8, 0.05), (0.3, 2, 0.3), (0.95, 16, 0.02)])
def test_one_draft_level_is_the_classic_formula(a, T, c):
    """One draft model drafting alone, a target whose forward costs 1 at any width: speedup
    (1 - a^(T+1)) / ((1 - a)(T c + 1))."""
    p = Params(models=["d"], cost={"d": lambda w: c, "target": lambda w: 1.0},
               accept={("d", "target"): a})
    got = tokens_per_second(Chain("none", (("d", T),)), p)  # plain decoding: 1 token/s
    assert got == pytest.approx((1 - a ** (T + 1)) / ((1 - a) * (T * c + 1)), rel=1e-12)


def test_round_statistics_by_hand():
    assert x_dist(0.5, [0, 0, 1.0]) == pytest.approx([0, 0.5, 0.25, 0.25])
    assert expected_rounds(1, [0, 1.0]) == 1 and expected_rounds(5, [0, 1.0]) == 5
    # X in {1, 2} with equal odds: rounds to reach 2 = 1 + P(first round gave 1) = 1.5
    assert expected_rounds(2, [0, 0.5, 0.5]) == pytest.approx(1.5)


def random_params(rng: random.Random, n_models: int, with_db: bool) -> Params:
    models = [f"m{i}" for i in range(n_models)]
    cost = {"target": linear(1.0, rng.uniform(0.0, 0.1))}
    base = 0.02
    for m in models:
        base *= rng.uniform(2.0, 5.0)
        cost[m] = linear(min(base, 0.6), rng.uniform(0.0, 0.05))
    accept = {}
    lowers = ["none"] + (["db"] if with_db else []) + models
    for up in models + ["target"]:
        for lo in lowers:
            accept[(lo, up)] = rng.uniform(0.2, 0.95)
    lengths = [rng.random() for _ in range(6)] if with_db else []
    total = sum(lengths) or 1.0
    return Params(models=models, cost=cost, accept=accept,
                  db_lengths=[x / total for x in lengths], db_seconds=0.005 if with_db else 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_dp_finds_what_brute_force_finds(seed):
    rng = random.Random(seed)
    p = random_params(rng, n_models=2 + seed % 2, with_db=seed % 2 == 0)
    chain_dp, v_dp = dp(p, t_max=5)
    chain_bf, v_bf = brute_force(p, t_max=5)
    assert v_dp == pytest.approx(v_bf, rel=1e-12)
    assert tokens_per_second(chain_dp, p) == pytest.approx(v_dp, rel=1e-12)


@pytest.mark.parametrize("chain", [
    Chain("none", (("m0", 3),)),
    Chain("db", (("m0", 4),)),
    Chain("db", (("m0", 2), ("m1", 5))),
    Chain("none", (("m0", 3), ("m1", 6))),
    Chain("db", ()),
])
def test_formula_matches_monte_carlo(chain):
    """Within 2%: 40,000 simulated target steps put the standard error well under 0.5%."""
    p = random_params(random.Random(7), n_models=2, with_db=True)
    predicted = tokens_per_second(chain, p)
    simulated = simulate(chain, p, steps=40_000, seed=1)
    assert simulated == pytest.approx(predicted, rel=0.02)


# --- plan files: their fields, the DBs they carry ---------------------------------------------

def test_a_plan_field_of_the_wrong_type_names_the_plan(tmp_path):
    """A plan's dtype of 5 read as if the user had typed `--dtype 5` ("--dtype must be one of")."""
    from hdcli.hsd import planner
    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"kind": "hd-plan", "target": "x", "dtype": 5, "chain": {"bottom": "db", "levels": []}}))
    with pytest.raises(HdError, match=r"plan .*plan.json: field 'dtype' must be a string, not 5; run `hd plan` again"):
        planner.read_plan_file(f)


def test_generate_with_a_plan_drafts_from_the_plans_dbs(tiny_model_dir, tiny_lm, tmp_path):
    db = stats_db_file(tiny_model_dir, tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "kind": "hd-plan", "target": tiny_lm.name, "dtype": "fp32", "chain": {"bottom": "db", "levels": []},
        "db_layers": ["context", "stats"], "stats_dbs": [str(db.resolve())], "model_db": None,
        "db_digests": {str(db.resolve()): stores.Store(db).header["content_digest"]}}))
    m = str(tiny_model_dir)
    p = hd_main("generate", "-m", m, "-p", "the cat sat", "-n", "8", "--plan", plan, "--json",
                "--kernels", "torch")
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["stats_dbs"] == [str(db.resolve())] and report["layers"] == ["context", "stats"]
    other = stats_db_file(tiny_model_dir, tmp_path, "other.lmdb")
    err = one_line_error(hd_main("generate", "-m", m, "-p", "x", "--plan", plan, "--stats-db", other))
    assert "was measured with" in err and "s.lmdb" in err

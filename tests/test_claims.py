"""Claims: status pass / fail / n/a per seed, the verdict over seeds (pass / fail / unstable / n/a),
parts beside a ratio, the exit-code rule, claims.json and the report."""

import io
import json
import math
import re

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import taskgeom.experiments
from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN
from taskgeom.claims.catalog import with_preconditions
from taskgeom.claims.registry import Experiment
from taskgeom.claims.rules import (
    NOT_BAYES_OPTIMAL,
    Claim,
    check,
    counts,
    exit_code,
    gain_parts,
    not_applicable,
    over_seeds,
    summary,
    verdict,
)
from taskgeom.cli import app
from taskgeom.experiments import reproduce


def passing() -> Claim:
    return check("e1.P0", "e1", "cell R^2", 0.9, ">=", 0.8)


def failing() -> Claim:
    return check("e1.P1", "e1", "additive share", 0.5, ">=", 0.8)


def na() -> Claim:
    return not_applicable(
        "e1.P3.shrinks",
        "e1",
        "TV last / first quarter",
        "<",
        1.0,
        "fewer than 5 uncertain positions",
        parts={"uncertain_positions": 2},
    )


@pytest.mark.parametrize(
    ("value", "comparison", "threshold", "status"),
    [
        (0.9, ">=", 0.8, "pass"),
        (0.8, ">=", 0.8, "pass"),
        (0.8, ">", 0.8, "fail"),
        (0.7, ">=", 0.8, "fail"),
        (0.1, "<", 0.2, "pass"),
        (0.2, "<=", 0.2, "pass"),
        (0.3, "<=", 0.2, "fail"),
        (math.nan, ">=", 0.8, "fail"),
        (math.nan, "<", 0.8, "fail"),
    ],
)
def test_check_status(value, comparison, threshold, status):
    claim = check("x", "e1", "d", value, comparison, threshold)
    assert claim.status == status and claim.passed == (status == "pass")
    assert claim.parts is None and claim.reason is None


def test_not_applicable_is_neither_passed_nor_failed():
    claim = na()
    assert claim.status == "n/a" and not claim.passed and math.isnan(claim.value)
    assert claim.reason == "fewer than 5 uncertain positions" and claim.parts == {"uncertain_positions": 2}
    assert counts([claim]) == {"pass": 0, "fail": 0, "unstable": 0, "n/a": 1}


def test_a_claim_cannot_contradict_itself():
    with pytest.raises(ValueError, match="contradicts"):
        Claim("x", "e1", "d", 1.0, 0.5, True, "quick", ">=", "fail")
    with pytest.raises(ValueError, match="status must be one of"):
        Claim("x", "e1", "d", 1.0, 0.5, False, "quick", ">=", "skipped")
    with pytest.raises(ValueError, match="needs a reason"):
        not_applicable("x", "e1", "d", "<", 1.0, "")


@pytest.mark.parametrize(
    ("claims", "code"),
    [
        ([], 0),
        ([passing()], 0),
        ([na()], 0),
        ([passing(), na()], 0),
        ([failing()], 1),
        ([passing(), na(), failing()], 1),
    ],
)
def test_exit_code_is_1_only_when_a_claim_failed(claims, code):
    assert exit_code(claims) == code


def test_summary_counts_each_status():
    assert summary([passing(), passing(), failing(), na()]) == "2 pass, 1 fail, 0 unstable, 1 n/a of 4 claims"


def _seeded(values: dict[int, float | None], threshold: float = 0.9) -> list[tuple[int, Claim]]:
    """One claim e1.P0 >= threshold per seed; a value of None is an n/a seed."""
    return [
        (
            seed,
            check("e1.P0", "e1", "cell R^2", value, ">=", threshold, {"layer": seed})
            if value is not None
            else not_applicable("e1.P0", "e1", "cell R^2", ">=", threshold, f"nothing to measure on seed {seed}"),
        )
        for seed, value in values.items()
    ]


@pytest.mark.parametrize(
    ("values", "status", "median", "low", "high"),
    [
        ({0: 0.95, 1: 0.91, 2: 0.99}, "pass", 0.95, 0.91, 0.99),  # every seed passes
        ({0: 0.5, 1: 0.1, 2: 0.89}, "fail", 0.5, 0.1, 0.89),  # every seed fails
        ({0: 0.95, 1: 0.5, 2: 0.93}, "unstable", 0.93, 0.5, 0.95),  # they disagree
        (
            {0: 0.95, 1: None, 2: 0.97},
            "pass",
            0.96,
            0.95,
            0.97,
        ),  # an n/a seed counts neither way; even count: mean of the middle two
        ({0: None, 1: 0.2, 2: None}, "fail", 0.2, 0.2, 0.2),
        ({0: 0.95, 1: None, 2: 0.2}, "unstable", 0.575, 0.2, 0.95),
        (
            {0: 0.95, 1: math.nan, 2: 0.97},
            "unstable",
            0.96,
            0.95,
            0.97,
        ),  # NaN never passes and stays out of the statistics
    ],
)
def test_the_verdict_over_seeds_on_planted_values(values, status, median, low, high):
    [claim] = over_seeds(_seeded(values))
    assert claim.status == status and claim.passed == (status == "pass")
    assert claim.value == pytest.approx(median) and claim.median == pytest.approx(median)
    assert (claim.min, claim.max) == (pytest.approx(low), pytest.approx(high))
    assert [row["seed"] for row in claim.seeds] == list(values)
    assert [row["status"] for row in claim.seeds] == [
        "n/a" if v is None else "pass" if v >= 0.9 else "fail" for v in values.values()
    ]
    assert [row["parts"] for row in claim.seeds] == [
        None if v is None else {"layer": seed} for seed, v in values.items()
    ]
    assert (claim.reason is not None) == (status == "unstable")


def test_a_claim_na_on_every_seed_is_na_with_their_reasons():
    [claim] = over_seeds(_seeded({0: None, 1: None}))
    assert claim.status == "n/a" and math.isnan(claim.value) and math.isnan(claim.min) and math.isnan(claim.max)
    assert claim.reason == "nothing to measure on seed 0; nothing to measure on seed 1"


def test_unstable_names_the_seeds_on_each_side_and_fails_nothing():
    claims = over_seeds(_seeded({3: 0.95, 4: 0.5, 5: 0.2}))
    assert claims[0].reason == "seeds disagree: pass on seed 3; fail on seed 4, 5"
    assert exit_code(claims) == 0 and summary(claims) == "0 pass, 0 fail, 1 unstable, 0 n/a of 1 claims"
    assert exit_code(over_seeds(_seeded({0: 0.1, 1: 0.2}))) == 1


def test_each_m1_claim_carries_its_model_s_bayes_optimum_per_seed_and_the_verdict_rule_ignores_it(tmp_path):
    from taskgeom.report.markdown import by_recipe, verdict_text

    optimal = {0: 0.01, 1: 0.3}  # seed 1's model is not Bayes-optimal (threshold 0.02)
    measured = [
        (seed, check("e1.bayes_optimal", "e1", "excess loss", value, "<=", 0.02)) for seed, value in optimal.items()
    ]
    measured += [(seed, check("e1.P1", "e1", "additive share", 0.5, ">=", 0.8)) for seed in optimal]
    measured += [
        (seed, check("e3.P1", "e3", "additive share", 0.9, ">=", 0.8)) for seed in optimal
    ]  # no e3 optimum measured
    measured += [
        (seed, check("e1.ablate_S_ood", "e1", "share", 60.0, ">=", 50.0)) for seed in optimal
    ]  # not an M1 claim
    claims = {c.id: c for c in over_seeds(with_preconditions(measured))}
    p1 = claims["e1.P1"]
    assert [row["precondition"] for row in p1.seeds] == [
        {"claim": "e1.bayes_optimal", "value": 0.01, "status": "pass"},
        {"claim": "e1.bayes_optimal", "value": 0.3, "status": "fail"},
    ]
    assert p1.status == "fail" and p1.caveat == f"{NOT_BAYES_OPTIMAL} (seed 1)"
    assert verdict_text(p1.as_dict()) == f"**FAIL**, {NOT_BAYES_OPTIMAL} (seed 1)"
    table = by_recipe([c.as_dict() for c in claims.values()])
    assert "| `P1` | >= 0.8 | **FAIL** 0.5 † | pass 0.9 |" in table and table[-1].startswith(f"† {NOT_BAYES_OPTIMAL}")
    assert "| `bayes_optimal` | <= 0.02 | *unstable* 0.155 | - |" in table
    one_seed = over_seeds(
        [
            (0, check("e1.ablate_S_ood", "e1", "share", 10.0, "<", 20.0)),
            (1, not_applicable("e1.ablate_S_ood", "e1", "share", "<", 20.0, "unreliable gain")),
        ]
    )
    assert "| `ablate_S_ood` | < 20 | pass 10 (1 of 2 seeds) |" in by_recipe([c.as_dict() for c in one_seed])
    for plain in ("e3.P1", "e1.ablate_S_ood", "e1.bayes_optimal"):
        assert claims[plain].caveat is None and all(row["precondition"] is None for row in claims[plain].seeds), plain
    assert json.loads(json.dumps(p1.as_dict()))["caveat"] == p1.caveat


def test_verdict_rule_by_itself():
    assert verdict(["pass", "pass"]) == "pass" and verdict(["fail", "n/a"]) == "fail"
    assert verdict(["pass", "fail", "n/a"]) == "unstable" and verdict(["n/a"]) == "n/a" and verdict([]) == "n/a"
    with pytest.raises(ValueError, match="unstable"):
        verdict(["pass", "unstable"])


def test_over_seeds_keeps_the_order_of_claims_and_refuses_a_seed_measured_twice():
    measured = [(0, passing()), (0, failing()), (1, passing()), (1, failing())]
    assert [c.id for c in over_seeds(measured)] == ["e1.P0", "e1.P1"]
    with pytest.raises(ValueError, match="measured twice"):
        over_seeds([(0, passing()), (0, passing())])
    with pytest.raises(ValueError, match="threshold"):
        over_seeds([(0, passing()), (1, check("e1.P0", "e1", "cell R^2", 0.9, ">=", 0.5))])


def test_gain_parts_against_a_hand_computation():
    parts = gain_parts(clean=1.25, ablated=1.75, first=2.0)
    assert parts == {"clean_loss": 1.25, "ablated_loss": 1.75, "loss_first": 2.0, "gain": 0.75, "unreliable": False}
    assert (parts["ablated_loss"] - parts["clean_loss"]) / parts["gain"] == pytest.approx(
        2 / 3
    )  # the share, computed elsewhere


def test_gain_parts_unreliable_at_the_boundary():
    assert MIN_RELIABLE_GAIN == 0.05
    assert gain_parts(0.0, 0.01, MIN_RELIABLE_GAIN)["unreliable"] is False  # gain == 0.05: reliable
    assert gain_parts(0.0, 0.01, math.nextafter(MIN_RELIABLE_GAIN, 0.0))["unreliable"] is True
    assert gain_parts(1.0, 1.1, 1.25, min_gain=0.25)["unreliable"] is False
    assert gain_parts(1.0, 1.1, 1.25, min_gain=0.5)["unreliable"] is True
    assert gain_parts(1.0, 1.0, 0.5)["gain"] == -0.5 and gain_parts(1.0, 1.0, 0.5)["unreliable"] is True
    assert gain_parts(1.0, 1.0, math.nan)["unreliable"] is True


def test_parts_become_plain_python_values():
    claim = check(
        "x",
        "e1",
        "d",
        0.5,
        "<",
        1.0,
        parts={"n": np.int64(3), "loss": np.float32(0.25), "flag": np.bool_(True), "site": "resid_mid"},
    )
    assert claim.parts == {"n": 3, "loss": 0.25, "flag": True, "site": "resid_mid"}
    assert [type(v) for v in claim.parts.values()] == [int, float, bool, str]
    with pytest.raises(TypeError, match="part 'rows'"):
        check("x", "e1", "d", 0.5, "<", 1.0, parts={"rows": [1, 2]})


def test_as_dict_round_trips_through_json_and_pandas():
    shared = check(
        "d.S_major",
        "e3",
        "% major gain removed",
        62.0,
        ">=",
        50.0,
        parts=gain_parts(clean=1.0, ablated=1.31, first=1.5),
    )
    claims = [passing(), failing(), na(), shared, check("nan", "e1", "d", math.nan, ">=", 0.8)]
    rows = [c.as_dict() for c in claims]
    text = json.dumps(rows, allow_nan=False)  # strict JSON: no NaN
    assert json.loads(text) == rows
    assert rows[2]["value"] is None and rows[4]["value"] is None and rows[4]["status"] == "fail"
    table = pd.read_json(io.StringIO(text))
    assert set(table.columns) == {
        "id",
        "experiment",
        "description",
        "value",
        "threshold",
        "passed",
        "profile",
        "comparison",
        "status",
        "parts",
        "reason",
        "seeds",
        "median",
        "min",
        "max",
        "precondition",
        "caveat",
        "recipe",
    }
    assert list(table["recipe"]) == [c.id.partition(".")[0] for c in claims]  # a claim's recipe: its id's first part
    assert list(table["status"]) == ["pass", "fail", "n/a", "pass", "fail"]
    assert list(table["passed"]) == [True, False, False, True, False]
    assert table["value"].isna().tolist() == [False, False, True, False, True]
    assert table.loc[3, "parts"] == shared.parts and table.loc[2, "reason"] == "fewer than 5 uncertain positions"


def test_report_shows_status_parts_and_reason(tmp_path):
    unreliable = check(
        "d.V_ood", "e3", "% OOD gain removed", 80.0, ">=", 50.0, parts=gain_parts(clean=1.0, ablated=1.03, first=1.04)
    )
    fake = Experiment("fake", (), lambda ctx: ctx.claim(0, passing(), failing(), na(), unreliable))
    reproduce(tmp_path, "quick", {"fake": fake})
    page = (tmp_path / "report.html").read_text()
    assert "2 pass, 1 fail, 0 unstable, 1 n/a of 4 claims" in page
    assert "class='na'>n/a<div class=reason>fewer than 5 uncertain positions</div>" in page
    assert "class='fail'>FAIL" in page and "class='pass'>pass" in page
    assert (
        "<span class=warn>unreliable</span> ablated_loss&nbsp;=&nbsp;1.03, clean_loss&nbsp;=&nbsp;1," in page
    )  # claims.json sorts keys
    assert "gain&nbsp;=&nbsp;0.04" in page and "uncertain_positions&nbsp;=&nbsp;2" in page
    assert passing().profile is None  # a claim builder knows no profile: the experiment's context stamps it
    assert {row["profile"] for row in json.loads((tmp_path / "claims.json").read_text())} == {"quick"}


@pytest.mark.parametrize(("claims", "code"), [([passing(), na()], 0), ([passing(), na(), failing()], 1)])
def test_reproduce_prints_statuses_and_exits_on_failures_only(tmp_path, monkeypatch, claims, code):
    monkeypatch.setattr(
        taskgeom.experiments,
        "declared",
        lambda studies, profile: {"fake": Experiment("fake", (), lambda ctx: ctx.claim(0, *claims))},
    )
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == code, result.output
    assert re.search(r"^PASS +e1\.P0 ", result.output, re.M) and re.search(
        r"^N/A +e1\.P3\.shrinks ", result.output, re.M
    )
    assert "not applicable: fewer than 5 uncertain positions" in result.output
    assert f"1 pass, {code} fail, 0 unstable, 1 n/a of {len(claims)} claims" in result.output
    written = json.loads((tmp_path / "claims.json").read_text())
    assert [row["status"] for row in written] == [c.status for c in claims]


def test_reproduce_judges_each_claim_over_its_seeds(tmp_path, monkeypatch):
    """Seeds 3, 4, 5: P0 passes on 3 and 5 and fails on 4 (unstable, exit 0); P1 fails on all (exit 1)."""

    def fake(ctx):
        for seed in ctx.seeds:
            ctx.claim(
                seed,
                check("e1.P0", "e1", "cell R^2", {3: 0.95, 4: 0.5, 5: 0.97}[seed], ">=", 0.9),
                check("e1.P1", "e1", "additive share", 0.1 * seed, ">=", 0.9),
            )

    monkeypatch.setattr(
        taskgeom.experiments, "declared", lambda studies, profile: {"fake": Experiment("fake", (), fake)}
    )
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path), "--device", "cpu", "--seeds", "3,4,5"])
    assert result.exit_code == 1, result.output
    assert re.search(r"^UNSTABLE +e1\.P0 +0\.95 >= 0\.9  seeds: 3=0\.95, 4=0\.5, 5=0\.97$", result.output, re.M), (
        result.output
    )
    assert "0 pass, 1 fail, 1 unstable, 0 n/a of 2 claims" in result.output
    written = {row["id"]: row for row in json.loads((tmp_path / "claims.json").read_text())}
    assert written["e1.P0"]["status"] == "unstable" and written["e1.P0"]["median"] == 0.95
    assert [(r["seed"], r["status"]) for r in written["e1.P0"]["seeds"]] == [(3, "pass"), (4, "fail"), (5, "pass")]
    assert (written["e1.P1"]["min"], written["e1.P1"]["max"]) == (pytest.approx(0.3), pytest.approx(0.5))
    page = (tmp_path / "report.html").read_text()
    assert "0 pass, 1 fail, 1 unstable, 0 n/a of 2 claims</b> over seeds 3, 4, 5" in page
    assert page.count("<circle") == 6 and "class='unstable'>unstable" in page  # a dot per seed and claim
    assert json.loads((tmp_path / "reproduction.json").read_text())["seeds"] == [3, 4, 5]


def test_reproduce_refuses_a_seed_set_by_override(tmp_path):
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path / "out"), "--set", "train.seed=4"])
    assert result.exit_code == 2 and "say --seeds instead" in result.output
    assert not (tmp_path / "out").exists()

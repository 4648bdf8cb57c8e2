"""Claims: status pass / fail / n/a, parts beside a ratio, the exit-code rule, claims.json and the report."""

import io
import json
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import taskgeom.experiments
from taskgeom.claims import MIN_RELIABLE_GAIN, Claim, check, counts, exit_code, gain_parts, not_applicable, summary
from taskgeom.cli import app
from taskgeom.experiments.base import reproduce


def passing() -> Claim:
    return check("e1.P0", "e1", "cell R^2", 0.9, ">=", 0.8, "quick")


def failing() -> Claim:
    return check("e1.P1", "e1", "additive share", 0.5, ">=", 0.8, "quick")


def na() -> Claim:
    return not_applicable("e1.P3.shrinks", "e1", "TV last / first quarter", "<", 1.0, "quick",
                          "fewer than 5 uncertain positions", parts={"uncertain_positions": 2})


@pytest.mark.parametrize(("value", "comparison", "threshold", "status"), [
    (0.9, ">=", 0.8, "pass"), (0.8, ">=", 0.8, "pass"), (0.8, ">", 0.8, "fail"), (0.7, ">=", 0.8, "fail"),
    (0.1, "<", 0.2, "pass"), (0.2, "<=", 0.2, "pass"), (0.3, "<=", 0.2, "fail"),
    (math.nan, ">=", 0.8, "fail"), (math.nan, "<", 0.8, "fail"),
])
def test_check_status(value, comparison, threshold, status):
    claim = check("x", "e1", "d", value, comparison, threshold, "quick")
    assert claim.status == status and claim.passed == (status == "pass")
    assert claim.parts is None and claim.reason is None


def test_not_applicable_is_neither_passed_nor_failed():
    claim = na()
    assert claim.status == "n/a" and not claim.passed and math.isnan(claim.value)
    assert claim.reason == "fewer than 5 uncertain positions" and claim.parts == {"uncertain_positions": 2}
    assert counts([claim]) == {"pass": 0, "fail": 0, "n/a": 1}


def test_a_claim_cannot_contradict_itself():
    with pytest.raises(ValueError, match="contradicts"):
        Claim("x", "e1", "d", 1.0, 0.5, True, "quick", ">=", "fail")
    with pytest.raises(ValueError, match="status must be one of"):
        Claim("x", "e1", "d", 1.0, 0.5, False, "quick", ">=", "skipped")
    with pytest.raises(ValueError, match="needs a reason"):
        not_applicable("x", "e1", "d", "<", 1.0, "quick", "")


@pytest.mark.parametrize(("claims", "code"), [
    ([], 0), ([passing()], 0), ([na()], 0), ([passing(), na()], 0),
    ([failing()], 1), ([passing(), na(), failing()], 1),
])
def test_exit_code_is_1_only_when_a_claim_failed(claims, code):
    assert exit_code(claims) == code


def test_summary_counts_each_status():
    assert summary([passing(), passing(), failing(), na()]) == "2 pass, 1 fail, 1 n/a of 4 claims"


def test_gain_parts_against_a_hand_computation():
    parts = gain_parts(clean=1.25, ablated=1.75, first=2.0)
    assert parts == {"clean_loss": 1.25, "ablated_loss": 1.75, "loss_first": 2.0, "gain": 0.75, "unreliable": False}
    assert (parts["ablated_loss"] - parts["clean_loss"]) / parts["gain"] == pytest.approx(2 / 3)  # the share, computed elsewhere


def test_gain_parts_unreliable_at_the_boundary():
    assert MIN_RELIABLE_GAIN == 0.05
    assert gain_parts(0.0, 0.01, MIN_RELIABLE_GAIN)["unreliable"] is False  # gain == 0.05: reliable
    assert gain_parts(0.0, 0.01, math.nextafter(MIN_RELIABLE_GAIN, 0.0))["unreliable"] is True
    assert gain_parts(1.0, 1.1, 1.25, min_gain=0.25)["unreliable"] is False
    assert gain_parts(1.0, 1.1, 1.25, min_gain=0.5)["unreliable"] is True
    assert gain_parts(1.0, 1.0, 0.5)["gain"] == -0.5 and gain_parts(1.0, 1.0, 0.5)["unreliable"] is True
    assert gain_parts(1.0, 1.0, math.nan)["unreliable"] is True


def test_parts_become_plain_python_values():
    claim = check("x", "e1", "d", 0.5, "<", 1.0, "quick",
                  parts={"n": np.int64(3), "loss": np.float32(0.25), "flag": np.bool_(True), "site": "resid_mid"})
    assert claim.parts == {"n": 3, "loss": 0.25, "flag": True, "site": "resid_mid"}
    assert [type(v) for v in claim.parts.values()] == [int, float, bool, str]
    with pytest.raises(TypeError, match="part 'rows'"):
        check("x", "e1", "d", 0.5, "<", 1.0, "quick", parts={"rows": [1, 2]})


def test_as_dict_round_trips_through_json_and_pandas():
    shared = check("d.S_major", "e3", "% major gain removed", 62.0, ">=", 50.0, "quick",
                   parts=gain_parts(clean=1.0, ablated=1.31, first=1.5))
    claims = [passing(), failing(), na(), shared, check("nan", "e1", "d", math.nan, ">=", 0.8, "quick")]
    rows = [c.as_dict() for c in claims]
    text = json.dumps(rows, allow_nan=False)  # strict JSON: no NaN
    assert json.loads(text) == rows
    assert rows[2]["value"] is None and rows[4]["value"] is None and rows[4]["status"] == "fail"
    table = pd.read_json(io.StringIO(text))
    assert set(table.columns) == {"id", "experiment", "description", "value", "threshold", "passed", "profile",
                                  "comparison", "status", "parts", "reason"}
    assert list(table["status"]) == ["pass", "fail", "n/a", "pass", "fail"]
    assert list(table["passed"]) == [True, False, False, True, False]
    assert table["value"].isna().tolist() == [False, False, True, False, True]
    assert table.loc[3, "parts"] == shared.parts and table.loc[2, "reason"] == "fewer than 5 uncertain positions"


def test_report_shows_status_parts_and_reason(tmp_path):
    unreliable = check("d.V_ood", "e3", "% OOD gain removed", 80.0, ">=", 50.0, "quick",
                       parts=gain_parts(clean=1.0, ablated=1.03, first=1.04))
    reproduce(tmp_path, "quick", {"fake": lambda ctx: ctx.claims.extend([passing(), failing(), na(), unreliable])})
    page = (tmp_path / "report.html").read_text()
    assert "2 pass, 1 fail, 1 n/a of 4 claims" in page
    assert "class='na'>n/a<div class=reason>fewer than 5 uncertain positions</div>" in page
    assert "class='fail'>FAIL" in page and "class='pass'>pass" in page
    assert "<span class=warn>unreliable</span> ablated_loss&nbsp;=&nbsp;1.03, clean_loss&nbsp;=&nbsp;1," in page  # claims.json sorts keys
    assert "gain&nbsp;=&nbsp;0.04" in page and "uncertain_positions&nbsp;=&nbsp;2" in page


@pytest.mark.parametrize(("claims", "code"), [([passing(), na()], 0), ([passing(), na(), failing()], 1)])
def test_reproduce_prints_statuses_and_exits_on_failures_only(tmp_path, monkeypatch, claims, code):
    monkeypatch.setattr(taskgeom.experiments, "EXPERIMENTS", {"fake": lambda ctx: ctx.claims.extend(claims)})
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == code, result.output
    assert "PASS  e1.P0" in result.output and "N/A   e1.P3.shrinks" in result.output
    assert "not applicable: fewer than 5 uncertain positions" in result.output
    assert f"1 pass, {code} fail, 1 n/a of {len(claims)} claims" in result.output
    written = json.loads((tmp_path / "claims.json").read_text())
    assert [row["status"] for row in written] == [c.status for c in claims]

"""The dual-mode claims' precondition and Fig. 4's sampling error (docs/protocol.md, "Projection
R^2" and "The OOD mode"): the Bayes OOD predictor's losses against a loop over positions, the
OOD-mode precondition read from planted rows and carried to the verdict's caveat and its mark,
and projection R^2's standard error over tasks against numpy."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from taskgeom.analysis.reading.projection import ProjectionR2
from taskgeom.claims.dual_modes import OOD_CLAIMS, OOD_MODE_SHARE, claims, ood_mode
from taskgeom.claims.rules import NO_OOD_MODE, NOT_BAYES_OPTIMAL, over_seeds


def test_the_bayes_ood_losses_are_the_add_alpha_learner_s_cross_entropy_by_hand(tmp_path):
    """E1's OOD-optimal predictor after t tokens gives face a (count of a so far + alpha) / (t + 1 +
    V alpha); its loss at prediction t scores token t + 1. A loop over sequences and positions."""
    from conftest import tiny_config

    from taskgeom.analysis.stored.dual import bayes_ood_losses
    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run
    from taskgeom.training.train import train

    run = Run.create(tiny_config("dice", steps=5), tmp_path)
    train(run, device="cpu")
    study = StudyRun(run)
    ood = study.heldout("ood", 6, split="loss")
    measured = bayes_ood_losses(study, ood)
    tokens, V, alpha = ood.batch.tokens.tolist(), study.family.vocab_size, study.family.alpha
    by_hand = np.zeros(len(tokens[0]) - 1)
    for seq in tokens:
        for t in range(len(seq) - 1):
            count = sum(1 for x in seq[: t + 1] if x == seq[t + 1])
            by_hand[t] -= math.log((count + alpha) / (t + 1 + V * alpha)) / len(tokens)
    np.testing.assert_allclose(measured.numpy(), by_hand, rtol=1e-12)


def _rows(k: int, loss_first: float, loss: float, bayes_first: float, bayes: float) -> list[dict]:
    """Planted dual.json rows of the run at diversity k: the OOD losses and projection R^2."""
    at = {"diversity": k, "step": np.nan, "layer": np.nan, "set": "ood", "band": None, "site": None}
    return [
        {**at, "metric": m, "value": v}
        for m, v in (
            ("loss_first", loss_first),
            ("loss", loss),
            ("bayes_ood_loss_first", bayes_first),
            ("bayes_ood_loss", bayes),
            ("projection_r2", 0.3 if k == -1 else 0.19),
            ("projection_r2_se", 0.004),
            ("projection_r2_tasks", 1024),
            ("projection_r2_per_task", 128),
            ("projection_r2_study_draw", 0.21),
        )
    ]


def _seed(gain: float, bayes_gain: float) -> pd.DataFrame:
    rows = _rows(-1, 2.3, 2.2, 2.2, 2.0) + _rows(10, 2.1 + gain, 2.1, 2.0 + bayes_gain, 2.0)
    frame = pd.DataFrame(rows)
    frame.loc[frame["metric"] == "projection_r2", "band"] = pd.Series(
        [[0.1, 0.4]] * 2, index=frame.index[frame["metric"] == "projection_r2"]
    )
    frame.loc[frame["metric"] == "projection_r2", ["layer", "site"]] = [4, "resid_post"]
    return frame


def test_the_ood_mode_is_the_run_s_gain_over_the_bayes_ood_gain_and_only_ood_claims_carry_it():
    rows = _seed(0.04, 0.1)  # 0.4 of the Bayes OOD gain: no OOD mode
    mode = ood_mode(rows, "e3", 10)
    assert (
        mode["value"] == pytest.approx(0.4)
        and mode["ood_gain"] == pytest.approx(0.04)
        and mode["bayes_ood_gain"] == pytest.approx(0.1)
    )
    assert mode["status"] == "fail" and mode["claim"] == "e3.ood_mode" and OOD_MODE_SHARE == 0.5
    assert ood_mode(_seed(0.06, 0.1), "e3", 10)["status"] == "pass"
    assert ood_mode(rows[~rows["metric"].str.startswith("bayes")], "e3", 10) is None  # rows of an earlier version
    made = {c.id.split(".", 1)[1]: c for c in claims(rows, "e3", -1, 10)}
    assert {name for name, c in made.items() if c.precondition is not None} == set(OOD_CLAIMS) & set(made)
    assert made["projection_r2_high_diversity"].precondition == mode


def test_projection_claims_carry_the_standard_error_and_whether_the_threshold_is_within_two():
    made = {c.id.split(".", 1)[1]: c for c in claims(_seed(0.2, 0.1), "e1", -1, 10)}
    high = made["projection_r2_high_diversity"]
    assert (high.value, high.parts["se"], high.parts["within_2se"]) == (0.19, 0.004, False)  # |0.19 - 0.2| > 0.008
    assert high.parts["study_draw"] == 0.21 and high.parts["ood_tasks"] == 1024
    drop = made["projection_r2_drop"]  # the share of 0.3 lost at 0.19, its error to first order
    assert drop.value == pytest.approx((0.3 - 0.19) / 0.3)
    assert drop.parts["se"] == pytest.approx(math.hypot(0.004 / 0.3, 0.19 * 0.004 / 0.3**2))
    assert drop.parts["within_2se"] is False  # |0.367 - 0.4| > 2 x 0.0158


def test_a_verdict_on_a_seed_without_an_ood_mode_says_so_and_tables_mark_it():
    from taskgeom.report.markdown import by_recipe
    from taskgeom.report.verdicts import cell_text, footnotes

    measured = []
    for seed, (gain, bayes_gain) in enumerate([(0.2, 0.1), (0.01, 0.1)]):  # seed 1 has no OOD mode
        measured += [(seed, c) for c in claims(_seed(gain, bayes_gain), "e3", -1, 10)]
    judged = {c.id: c for c in over_seeds(measured)}
    claim = judged["e3.projection_r2_high_diversity"]
    assert claim.caveat == f"{NO_OOD_MODE} (seed 1)" and NOT_BAYES_OPTIMAL not in claim.caveat
    assert [row["precondition"]["status"] for row in claim.seeds] == ["pass", "fail"]
    table = by_recipe([c.as_dict() for c in judged.values()])
    assert "| `projection_r2_high_diversity` | < 0.2 | pass 0.19 \u2021 |" in table
    assert table[-1].startswith(f"\u2021 {NO_OOD_MODE} on at least one seed")
    row = {"status": "pass", "median": 0.19, "judged": 2, "seeds": 2, "caveat": claim.caveat}
    assert cell_text(row) == "0.19\u2021"
    both = {**row, "caveat": f"{NOT_BAYES_OPTIMAL} (seed 0); {NO_OOD_MODE} (seed 1)"}
    assert cell_text(both) == "0.19\u2020\u2021"
    notes = footnotes(pd.DataFrame([both]).assign(claim="e3.x"), ["quick"])
    assert [n[0] for n in notes] == ["\u2020", "\u2021"]


def test_the_standard_error_over_tasks_is_numpy_s():
    values = torch.tensor([0.1, 0.25, 0.3, 0.12, 0.4])
    r2 = ProjectionR2(values, 5, 128, None, "protocol")
    assert r2.standard_error == pytest.approx(np.std(values.double().numpy(), ddof=1) / math.sqrt(5), rel=1e-12)
    assert math.isnan(ProjectionR2(values[:1], 1, 128, None, "protocol").standard_error)

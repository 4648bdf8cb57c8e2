"""E2's own claims, in-context linear regression at k = -1: the model against the dMMSE (pool
posterior) and ridge (OOD-optimal) predictors, on the last half of the examples.

``e2.bayes_optimal``, the model's mean squared error on major-task prompts over the last half of
the examples relative to dMMSE's, minus one, at most 10%; ``e2.ood_between``, the model's OOD error
between ridge's and dMMSE's with ``bayes_optimal``'s tolerance at each end,
``max(L_model / L_dMMSE - 1, 1 - L_model / L_ridge) <= 0.1`` (the judged variant
``ood-between-g-interval``: ``g = (L_dMMSE - L_model) / (L_dMMSE - L_ridge)``, 0 at dMMSE and 1 at
ridge, checked as ``|g - 1/2| <= 1/2``, which puts the ideal on its boundary); ``e2.ood_near_dmmse``,
g <= 1/2 (closer to dMMSE than to ridge at low diversity).
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from taskgeom.analysis.protocol import active
from taskgeom.claims.rules import Claim, Spec

_RECIPES = "E2 (k = -1)"
SPECS: tuple[Spec, ...] = (
    Spec(
        "bayes_optimal",
        "e2",
        _RECIPES,
        "model MSE / dMMSE MSE - 1 on held-out major-task prompts, last half of the examples, k = -1",
        "<=",
        0.10,
        ("mse_by_example",),
    ),
    Spec(
        "ood_between",
        "e2",
        _RECIPES,
        "max(MSE_model / MSE_dMMSE - 1, 1 - MSE_model / MSE_ridge) on OOD prompts, last half of the examples, k = -1 "
        "(<= 0.1: the model's error lies between ridge's and dMMSE's, each end with bayes_optimal's 10% tolerance)",
        "<=",
        0.10,
        ("mse_by_example",),
    ),
    Spec(
        "ood_near_dmmse",
        "e2",
        _RECIPES,
        "g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the examples, "
        "k = -1 (<= 1/2: closer to dMMSE than to ridge at low diversity)",
        "<=",
        0.5,
        ("mse_by_example",),
    ),
)
NAMES = tuple(spec.name for spec in SPECS)
G_INTERVAL = replace(  # ood_between in the form published before the rule's (docs/protocol.md, "Claim forms")
    SPECS[1],
    description="|g - 1/2| for g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the "
    "examples, k = -1 (<= 1/2: the model's error lies between dMMSE's and ridge's)",
    threshold=0.5,
)


def late_means(table: pd.DataFrame, n_examples: int) -> pd.DataFrame:
    """Mean of each (set, metric) of ``evaluate_run``'s table over the last half of the examples (positions >= n / 2)."""
    late = table[table["position"] >= n_examples // 2]
    return late.groupby(["set", "metric"])["value"].mean().unstack()


def between(mse_model: float, mse_dmmse: float, mse_ridge: float) -> tuple[Spec, float, dict]:
    """(its spec, value, parts) of ``ood_between`` from the three OOD errors, in the active protocol's
    ``ood_between_form``: "g-interval", |g - 1/2| <= 1/2 (g in [0, 1]); "segment",
    max(MSE_model / MSE_dMMSE - 1, 1 - MSE_model / MSE_ridge) <= 0.1, the model's error between ridge's
    and dMMSE's with ``bayes_optimal``'s tolerance at each end (0 at either ideal, <= 0 inside)."""
    g = (mse_dmmse - mse_model) / (mse_dmmse - mse_ridge)
    parts = {"mse_model": mse_model, "mse_dmmse": mse_dmmse, "mse_ridge": mse_ridge}
    if active().ood_between_form == "g-interval":
        return G_INTERVAL, abs(g - 0.5), parts
    above, below = mse_model / mse_dmmse - 1, 1 - mse_model / mse_ridge
    return SPECS[1], max(above, below), {**parts, "g": g, "above_dmmse": above, "below_ridge": below}


def claims(means: pd.DataFrame, e: str = "e2") -> list[Claim]:
    """The claims of recipe ``e`` from one run's late means (``late_means``)."""
    major, ood = means.loc["major"], means.loc["ood"]
    g = (ood["bayes_id_loss"] - ood["loss"]) / (ood["bayes_id_loss"] - ood["bayes_ood_loss"])
    parts = {"mse_model": ood["loss"], "mse_dmmse": ood["bayes_id_loss"], "mse_ridge": ood["bayes_ood_loss"]}
    spec, value, between_parts = between(ood["loss"], ood["bayes_id_loss"], ood["bayes_ood_loss"])
    return [
        SPECS[0].judge(
            e,
            major["loss"] / major["bayes_id_loss"] - 1,
            {"mse_model": major["loss"], "mse_dmmse": major["bayes_id_loss"]},
        ),
        spec.judge(e, value, between_parts),
        SPECS[2].judge(e, g, parts),
    ]

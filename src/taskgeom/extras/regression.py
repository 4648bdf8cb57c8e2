"""E2, in-context linear regression at k = -1: the model against the dMMSE (pool posterior) and
ridge (OOD-optimal) predictors, on the last half of the examples.

Claims: ``e2.bayes_optimal``, the model's mean squared error on major-task prompts over the last
half of the examples relative to dMMSE's, minus one, at most 10%; ``e2.ood_between``, the model's
OOD error placed on the segment from dMMSE to ridge, ``g = (L_dMMSE - L_model) / (L_dMMSE -
L_ridge)`` (0 at dMMSE, 1 at ridge), lies in [0, 1], checked as ``|g - 1/2| <= 1/2``;
``e2.ood_near_dmmse``, g <= 1/2 (closer to dMMSE than to ridge at low diversity).
"""

from __future__ import annotations

import pandas as pd

from taskgeom.claims.catalog import spec
from taskgeom.training.evaluate import evaluate_run
from taskgeom.experiments.base import Context
from taskgeom.settings.recipes import Study
from taskgeom.report.figures import plot_loss_by_position


def late_means(table: pd.DataFrame, n_examples: int) -> pd.DataFrame:
    """Mean of each (set, metric) over the last half of the examples (positions >= n / 2)."""
    late = table[table["position"] >= n_examples // 2]
    return late.groupby(["set", "metric"])["value"].mean().unstack()


def e2(ctx: Context, study: Study) -> None:
    """E2's claims on the k = -1 runs of ``study`` (every seed), and one seed's figure."""
    name, shown = study.name, study.name.upper()
    for seed in ctx.seeds:
        run = ctx.trained(name, ("task.diversity=-1",), seed)
        with ctx.stage(f"evaluate {run.path.name}"):
            table = pd.DataFrame(evaluate_run(run))
        ctx.claim(seed, *claims(late_means(table, run.config.task.n_examples), ctx.profile, name))
        if seed == ctx.seeds[0]:  # one seed's curves illustrate; the claims read every seed
            plot_loss_by_position(table, ctx.figure(f"{name}_mse_by_example.png",
                                  f"{shown}: per-example squared error of the model against dMMSE (pool posterior) and ridge (OOD-optimal), "
                                  f"k = -1 (seed {seed})", tuple(f"{name}.{claim}" for claim in CLAIMS)),
                                  run.family.plot_labels, title=f"{shown} (k = -1, seed {seed})", log_scale=True)


e2.runs = lambda ctx, study: ctx.plans(study.name, ("task.diversity=-1",))  # for the schedule

CLAIMS = ("bayes_optimal", "ood_between", "ood_near_dmmse")


def claims(means: pd.DataFrame, profile: str, e: str = "e2") -> list:
    """The claims of recipe ``e`` from one run's late means (``late_means``)."""
    major, ood = means.loc["major"], means.loc["ood"]
    g = (ood["bayes_id_loss"] - ood["loss"]) / (ood["bayes_id_loss"] - ood["bayes_ood_loss"])
    parts = {"mse_model": ood["loss"], "mse_dmmse": ood["bayes_id_loss"], "mse_ridge": ood["bayes_ood_loss"]}
    return [
        spec("e2", "bayes_optimal").judge(
            e, "model MSE / dMMSE MSE - 1 on held-out major-task prompts, last half of the examples, k = -1",
            major["loss"] / major["bayes_id_loss"] - 1, profile, {"mse_model": major["loss"], "mse_dmmse": major["bayes_id_loss"]}),
        spec("e2", "ood_between").judge(
            e, "|g - 1/2| for g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the examples, k = -1 "
               "(<= 1/2: the model's error lies between dMMSE's and ridge's)", abs(g - 0.5), profile, parts),
        spec("e2", "ood_near_dmmse").judge(
            e, "g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the examples, k = -1 "
               "(<= 1/2: closer to dMMSE than to ridge at low diversity)", g, profile, parts),
    ]


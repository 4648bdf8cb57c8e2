"""E2, in-context linear regression at k = -1: the model against the dMMSE (pool posterior) and
ridge (OOD-optimal) predictors, on the last half of the examples.

Claims: ``e2.bayes_optimal``, the model's mean squared error on major-task prompts over the last
half of the examples relative to dMMSE's, minus one, at most 10%; ``e2.ood_between``, the model's
OOD error placed on the segment from dMMSE to ridge, ``g = (L_dMMSE - L_model) / (L_dMMSE -
L_ridge)`` (0 at dMMSE, 1 at ridge), lies in [0, 1], checked as ``|g - 1/2| <= 1/2``;
``e2.ood_near_dmmse``, g <= 1/2 (closer to dMMSE than to ridge at low diversity).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from taskgeom.claims import check  # noqa: E402
from taskgeom.evaluate import evaluate_run  # noqa: E402
from taskgeom.experiments.base import Context  # noqa: E402

MAX_RELATIVE_EXCESS = 0.10  # the "within 10% of the dMMSE predictor"
_LINES = {"loss": ("model", "C0", "-"), "bayes_id_loss": ("dMMSE (pool posterior)", "C1", "--"), "bayes_ood_loss": ("ridge, lambda = noise^2", "C2", ":")}


def late_means(table: pd.DataFrame, n_examples: int) -> pd.DataFrame:
    """Mean of each (set, metric) over the last half of the examples (positions >= n / 2)."""
    late = table[table["position"] >= n_examples // 2]
    return late.groupby(["set", "metric"])["value"].mean().unstack()


def e2(ctx: Context) -> None:
    run = ctx.trained("e2", ("task.diversity=-1",))
    table = pd.DataFrame(evaluate_run(run))
    means = late_means(table, run.config.task.n_examples)
    major, ood = means.loc["major"], means.loc["ood"]
    ctx.claims.append(check(
        "e2.bayes_optimal", "e2",
        "model MSE / dMMSE MSE - 1 on held-out major-task prompts, last half of the examples, k = -1",
        major["loss"] / major["bayes_id_loss"] - 1, "<=", MAX_RELATIVE_EXCESS, ctx.profile))
    g = (ood["bayes_id_loss"] - ood["loss"]) / (ood["bayes_id_loss"] - ood["bayes_ood_loss"])
    ctx.claims.append(check(
        "e2.ood_between", "e2",
        "|g - 1/2| for g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the examples, k = -1 "
        "(<= 1/2: the model's error lies between dMMSE's and ridge's)",
        abs(g - 0.5), "<=", 0.5, ctx.profile))
    ctx.claims.append(check(
        "e2.ood_near_dmmse", "e2",
        "g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts, last half of the examples, k = -1 "
        "(<= 1/2: closer to dMMSE than to ridge at low diversity)",
        g, "<=", 0.5, ctx.profile))
    plot_mse_by_example(table, ctx.figure("e2_mse_by_example.png",
                        "E2: per-example squared error of the model against dMMSE (pool posterior) and ridge (OOD-optimal), k = -1"),
                        title="E2 (k = -1)")


def plot_mse_by_example(table: pd.DataFrame, path, title: str = "") -> None:
    """One panel per evaluation set: mean squared error of the prediction of y_i against i."""
    sets = list(dict.fromkeys(table["set"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for metric, (label, color, style) in _LINES.items():
            rows = table[(table["set"] == name) & (table["metric"] == metric)]
            ax.plot(rows["position"], rows["value"], style, color=color, label=label)
        ax.set_title(f"{name} prompts")
        ax.set_xlabel("example index i (predicting y_i)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("mean squared error")
    axes[0, -1].legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

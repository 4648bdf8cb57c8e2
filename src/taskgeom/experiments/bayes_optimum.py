"""The k = -1 runs of the recipes that declare ``bayes_optimum`` (E1, E3) reach the ID-Bayes optimum
(the foundation's acceptance claim, ``claims.bayes_optimum``)."""

from __future__ import annotations

import pandas as pd

from taskgeom.claims.bayes_optimum import SPECS, bayes_optimal
from taskgeom.claims.registry import Experiment
from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import TrainTask
from taskgeom.report.figures import plot_loss_by_position
from taskgeom.training.evaluate import evaluate_run


def bayes_optimum(ctx: Context) -> None:
    for experiment in (study.name for study in ctx.taking_part("bayes_optimum")):
        for seed in ctx.seeds:
            run = ctx.trained(experiment, ("task.diversity=-1",), seed)
            with ctx.stage(f"evaluate {run.path.name}"):
                table = pd.DataFrame(evaluate_run(run))
            excess = table.query("set == 'major' and metric == 'excess'")["value"].mean()
            ctx.claim(seed, bayes_optimal(experiment, excess))
            if seed == ctx.seeds[0]:  # one seed's curves illustrate; the claim reads every seed
                plot_loss_by_position(
                    table,
                    ctx.figure(
                        f"{experiment}_loss_by_position.png",
                        f"{experiment.upper()}: per-position loss of the model against the ID-Bayes and OOD-optimal "
                        f"predictors (seed {seed})",
                        (f"{experiment}.bayes_optimal",),
                    ),
                    run.family.plot_labels,
                    title=f"{experiment.upper()} (k = -1, seed {seed})",
                )


def runs(ctx: Context) -> list[TrainTask]:
    """The k = -1 runs of every recipe that takes part, on every seed."""
    return [
        task for study in ctx.taking_part("bayes_optimum") for task in ctx.plans(study.name, ("task.diversity=-1",))
    ]


EXPERIMENT = Experiment("bayes_optimum", SPECS, bayes_optimum, runs)

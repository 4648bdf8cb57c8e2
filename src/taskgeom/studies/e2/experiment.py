"""E2, in-context linear regression at k = -1: its claims (``studies.e2.claims``) on every seed's run and
one seed's per-example squared error against the dMMSE and ridge predictors, for every recipe that
takes part in the experiment ``e2``."""

from __future__ import annotations

import pandas as pd

from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import TrainTask
from taskgeom.report.figures import plot_loss_by_position
from taskgeom.settings.recipes import Study
from taskgeom.studies.e2.claims import NAMES, claims, late_means
from taskgeom.training.evaluate import evaluate_run


def e2(ctx: Context) -> None:
    """E2's claims on the k = -1 runs of every recipe taking part (every seed), and one seed's figure."""
    for study in ctx.taking_part("e2"):
        measure(ctx, study)


def measure(ctx: Context, study: Study) -> None:
    """E2's claims on the k = -1 runs of ``study`` (every seed), and one seed's figure."""
    name, shown = study.name, study.name.upper()
    for seed in ctx.seeds:
        run = ctx.trained(name, ("task.diversity=-1",), seed)
        with ctx.stage(f"evaluate {run.path.name}"):
            table = pd.DataFrame(evaluate_run(run))
        ctx.claim(seed, *claims(late_means(table, run.config.task.n_examples), name))
        if seed == ctx.seeds[0]:  # one seed's curves illustrate; the claims read every seed
            plot_loss_by_position(
                table,
                ctx.figure(
                    f"{name}_mse_by_example.png",
                    f"{shown}: per-example squared error of the model against dMMSE (pool posterior) and ridge (OOD-optimal), "
                    f"k = -1 (seed {seed})",
                    tuple(f"{name}.{claim}" for claim in NAMES),
                ),
                run.family.plot_labels,
                title=f"{shown} (k = -1, seed {seed})",
                log_scale=True,
            )


def runs(ctx: Context) -> list[TrainTask]:
    """The k = -1 runs of every recipe taking part, on every seed."""
    return [task for study in ctx.taking_part("e2") for task in ctx.plans(study.name, ("task.diversity=-1",))]

"""The dual modes across task diversity (docs/concepts.md#m2-the-nearly-orthogonal-subspace): projection R^2, the double
dissociation, the predictor transition and Theorem 2, for the recipes that declare ``dual_modes``
at the profile (E1 and E3; E2 at paper): the sweep trains and analyses every run of the grid
(``analysis.stored.dual``, where docs/protocol.md pins each measurement), ``claims.dual_modes``
turns each seed's rows into its claims, and the figures are drawn here."""

from __future__ import annotations

from taskgeom.analysis.stored.rows import FIELDS, by_step
from taskgeom.claims.catalog import evidence
from taskgeom.claims.dual_modes import SPECS, claims
from taskgeom.claims.registry import Experiment
from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import TrainTask, analysed
from taskgeom.experiments.sweep import Job, job_seconds, run_sweep
from taskgeom.report.dual import (
    plot_dissociation,
    plot_projection_r2,
    plot_projection_r2_steps,
    plot_rank_curve,
    plot_theorem2,
    plot_transition,
    rank_curve,
)
from taskgeom.runs.storage import atomic_write_text
from taskgeom.settings.config import ConfigError
from taskgeom.settings.recipes import load_measure


def grid(ctx: Context) -> tuple[list[int], tuple[str, ...]]:
    """The sweep's diversities (``--grid``, else the profile's ``measure.grid`` in the recipes, which
    must agree) and the recipes it measures."""
    studies = ctx.taking_part("dual_modes")
    recipes = tuple(study.name for study in studies)
    if ctx.diversities:
        return list(ctx.diversities), recipes
    grids = {study.name: load_measure(study.path, ctx.profile).grid for study in studies}
    if len({tuple(g) for g in grids.values()}) > 1:
        raise ConfigError(
            f"the recipes' profiles {ctx.profile!r} name different diversity grids ({grids}); give one with --grid"
        )
    return (next(iter(grids.values())) if grids else []), recipes


DUAL_EVIDENCE = evidence(SPECS)


def _each_recipe(ctx: Context, *claims: str) -> tuple[str, ...]:
    """The ids of ``claims`` for every recipe of the profile's grid (``e1.ablate_V_ood``, ...)."""
    return tuple(f"{recipe}.{claim}" for recipe in grid(ctx)[1] for claim in claims)


def _jobs(ctx: Context) -> list[Job]:
    diversities, recipes = grid(ctx)
    paths = {study.name: str(study.path) for study in ctx.studies}
    return [
        Job(paths[recipe], k, seed, ctx.profile, str(ctx.runs_root), ctx.overrides, ctx.device, ctx.tracker)
        for recipe in recipes
        for k in diversities
        for seed in ctx.seeds
    ]


def runs(ctx: Context) -> list[TrainTask]:
    """The sweep's runs, for the schedule, each with the thread count the sweep gives it, and their
    dual-mode analysis (done there, the sweep then reads it)."""
    return [
        TrainTask(
            config,
            job.root,
            job.device,
            job.tracker,
            config.train.threads or ctx.executor.threads,
            analyse=True,
            projection_sizes=job.measure().projection_sizes,
            protocol=job.protocol(),
        )
        for job in _jobs(ctx)
        for config in [job.config()]
    ]


def dual_modes(ctx: Context) -> None:
    diversities, recipes = grid(ctx)
    if not recipes:  # --recipes named none of the sweep's
        return
    jobs = _jobs(ctx)
    table = run_sweep(jobs, ctx.executor, out=ctx.out / "tables")
    for job in job_seconds(table).itertuples():
        name = f"{job.recipe} k={job.diversity} seed={job.seed}"
        ctx.timings.add(ctx.experiment, f"train {name}", job.train_wall_s, job.train_cpu_s)
        ctx.timings.add(ctx.experiment, f"analyse {name}", job.analysis_wall_s, job.analysis_cpu_s)
    ok = table[table["status"] == "ok"]
    ok = ok.reindex(
        columns=list(dict.fromkeys([*ok.columns, *FIELDS]))
    )  # none finished: no row columns, the claims are n/a
    low, high = min(diversities), max(diversities)
    for recipe in recipes:
        rows = ok[ok["recipe"] == recipe]
        for seed in ctx.seeds:
            ctx.claim(seed, *claims(rows[rows["seed"] == seed], recipe, low, high))
        if len(rows):
            plot_dissociation(
                rows[rows["diversity"] == high],
                ctx.figure(
                    f"{recipe}_double_dissociation.png",
                    f"{recipe.upper()}, k = {high}: share of in-context gain removed by ablating S, V or a random direction "
                    "at each block and their mean",
                    tuple(f"{recipe}.{name}" for name in DUAL_EVIDENCE["dissociation"]),
                ),
                f"{recipe.upper()} double dissociation (k = {high})",
            )
    if len(ok):
        plot_projection_r2(
            ok,
            ctx.figure(
                "projection_r2.png",
                "Projection R^2 of OOD task means onto the major task means (the study's "
                "Fig. 4 statistic) across diversity: the claims' value (solid, IQR band over OOD tasks), the "
                "linear-code reference (dashed) and the per-sequence-r2 variant (dotted)",
                _each_recipe(ctx, *DUAL_EVIDENCE["projection"]),
            ),
        )
        curve = rank_curve(ok)
        atomic_write_text(ctx.out / "tables" / "rank_curve.csv", curve.to_csv(index=False))
        plot_rank_curve(
            curve,
            ctx.figure(
                "rank_curve.png",
                "Share of OOD in-context gain removed by ablating orthogonal directions V of "
                "rank r = 1..ceil(d0), mean over blocks (tables/rank_curve.csv: every block)",
                _each_recipe(ctx, *DUAL_EVIDENCE["rank"]),
            ),
        )
        plot_transition(
            by_step(ok),
            ctx.figure(
                "predictor_transition.png",
                "Predictor transition: log(KL to memorising / KL to generalising Bayes) over diversity and training step",
                _each_recipe(ctx, *DUAL_EVIDENCE["transition"]),
            ),
        )
        plot_projection_r2_steps(
            ok,
            ctx.figure(
                "projection_r2_steps.png",
                "The study's Fig. 4: projection R^2 of OOD task means across training, one line per diversity k "
                "(IQR band over OOD tasks), the linear-code reference dashed",
                _each_recipe(ctx, *DUAL_EVIDENCE["projection"]),
            ),
        )
        plot_theorem2(
            ok, ctx.figure("theorem2.png", "Theorem 2: distance of OOD states from S beside (c - delta)/L (last layer)")
        )


def left(ctx: Context) -> list[str]:
    """For ``--plan``: the sweep's runs whose dual analysis is not stored under its key."""
    return [task.name for task in runs(ctx) if task.analyse and not analysed(task.path, task.protocol)]


# cost [measured], CPU seconds per flop-second of the run's training (``Experiment.cost``): 2.5-3.4 (E3) and
# 3.8-5.3 (E1) on the quick three-seed reproduction at 7a2bd5c (benchmarks/plan_costs.py, 2-core AMD EPYC,
# 100 GFLOP/s; 2.0-2.3 and 2.9-4.0 at 6c99fae on another, 79 GFLOP/s)
EXPERIMENT = Experiment(
    "dual_modes", SPECS, dual_modes, runs, left=left, cost=4.5, on_pool=True, reads=("projection_window", "task_probe")
)

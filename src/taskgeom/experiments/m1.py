"""M1, Bayesian task retrieval (docs/concepts.md#m1-the-geometry-of-task-retrieval): P0-P3 and causal steering on the k = -1 runs
of the recipes that declare ``m1`` (E1, E2, E3; the runs ``bayes_optimum`` and E2's own experiment
read too, whichever comes first trains them): each run analysed (``analysis.stored.m1``; a stored result read back), its
claims read from the rows (``claims.m1``), and the figures. For E2 the analysis reads its
prediction positions: P0's "cells" are a per-task intercept and linear map of the query x_i (an
ANCOVA at each position), P2 reads r2_additive, and steering compares predictions of y_i by RMSE
instead of next-token laws by KL, one position per forward pass."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Callable, ContextManager

import pandas as pd
import torch

from taskgeom.analysis.reading.steering import KINDS
from taskgeom.analysis.stored.m1 import Result, analyze, load, write
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.catalog import evidence
from taskgeom.claims.m1 import SPECS, claim_values, claims
from taskgeom.claims.registry import Experiment
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import Prepared, TrainTask
from taskgeom.report.geometry import FIGURES, plot_retrieval
from taskgeom.runs.folders import Run
from taskgeom.training.timing import TRAIN_COST_PER_FLOP_SECOND, Timings

M1_EVIDENCE = evidence(SPECS)

_CAPTIONS = {
    "simplex": "{E}: fitted task coefficients beta_t (solid) and the exact posterior alpha_t (dashed) in the simplex for two "
    "sequences per major task; right: TV between the per-task mean beta_t and mean alpha_t (what P3 reads), and the "
    "per-position median per-state TV and KL(alpha || beta) with interquartile bands",
    "layers": "{E}: P0 (cell-means R^2), P1 (additive share), medians over the late window of the fits at each position, and P2 "
    "(r2_additive, beside a random subspace of equal dimension) per layer and site; with several seeds, the median over seeds and their range",
    "positions": "{E}: r2_additive of P2 at each position, every layer and site (the claims' place bold; shaded: the positions the claim averages)",
    "steering": "{E}: the readout over the target points a ~ Dirichlet(1) of the simplex (KL(model || q_a) of next-token laws; E2: "
    "RMSE of the prediction of y to y_a), unsteered and steered one position per forward pass, with the means of both, "
    "the mode task's and a random direction's of the same norm",
}


def m1(ctx: Context) -> None:
    for experiment in (study.name for study in ctx.taking_part("m1")):
        results = {}
        for seed in ctx.seeds:
            run = StudyRun(ctx.trained(experiment, ("task.diversity=-1",), seed))
            results[seed] = stored_or_analyzed(run, ctx.stage)
            ctx.claim(seed, *claims(results[seed]))
        first = ctx.seeds[0]  # its figures illustrate; the per-layer one spans every seed, and the tables hold them all
        captions = {
            name: _CAPTIONS[name].format(E=experiment.upper()) + ("" if name == "layers" else f" (seed {first})")
            for name in FIGURES
        }
        plot_retrieval(
            results[first],
            {
                name: ctx.figure(
                    f"{experiment}_m1_{name}.png",
                    captions[name],
                    tuple(f"{experiment}.{claim}" for claim in M1_EVIDENCE[name]),
                )
                for name in FIGURES
            },
            seeds=pd.concat([pd.DataFrame(r.rows).assign(seed=seed) for seed, r in results.items()], ignore_index=True),
        )


def stored_or_analyzed(run: StudyRun, stage: Callable[[str], ContextManager] = lambda name: nullcontext()) -> Result:
    """The run's stored M1 result (``analysis.stored.m1.load``), else analysed now, in ``stage("analyse
    RUN")`` (a timed stage of ``timings.json``: only what is measured is timed), and stored: a
    reproduction stopped midway measures only the runs it had not reached."""
    result = load(run)
    if result is None:
        with stage(f"analyse {run.path.name}"):
            result = analyze(run)
            write(run, result)
    return result


def prepared_name(run: str) -> str:
    """The schedule's name of the M1 analysis of the run named ``run`` (``prepare``)."""
    return f"m1 {run}"


def analyse_stored(path: Path) -> dict[str, tuple[float, float, float]]:
    """Analyse the run at ``path`` and store its result, unless it is stored (``stored_or_analyzed``);
    the (wall, CPU) seconds of the analysis and the process's peak memory (MB) at its end, by its
    stage; none when it was stored."""
    timings = Timings()
    stored_or_analyzed(StudyRun(Run.open(path)), lambda name: timings.stage("m1", name))
    return {stage.stage: (stage.wall_s, stage.cpu_s, stage.peak_mb) for stage in timings.stages}


def prepare(ctx: Context) -> list[Prepared]:
    """Each run's analysis whose result is not stored (``left``), for the schedule's pool, with this
    process's thread count, which would have analysed it otherwise."""
    missing = set(left(ctx))
    return [
        Prepared(
            "m1",
            prepared_name(task.name),
            (task.name,),
            torch.get_num_threads(),
            partial(analyse_stored, task.path),
            task.cost() * EXPERIMENT.cost / TRAIN_COST_PER_FLOP_SECOND,
            ctx.protocol,
        )
        for task in runs(ctx)
        if task.name in missing
    ]


def runs(ctx: Context) -> list[TrainTask]:
    """The k = -1 runs of every recipe that takes part, on every seed."""
    return [task for study in ctx.taking_part("m1") for task in ctx.plans(study.name, ("task.diversity=-1",))]


def left(ctx: Context) -> list[str]:
    """For ``--plan``: the runs whose M1 result is not stored (not trained yet, no current result, or a
    damaged one, which the reproduction reports and measures again)."""

    def missing(task: TrainTask) -> bool:
        try:
            return not (task.path / "model.safetensors").exists() or load(StudyRun(Run.open(task.path))) is None
        except TaskgeomError:
            return True

    return [task.name for task in runs(ctx) if missing(task)]


# cost [measured], CPU seconds per flop-second of the run's training (``Experiment.cost``): 0.31-0.34 (E2),
# 0.93-0.97 (E3), 2.23-2.28 (E1) on the quick three-seed reproduction at 7a2bd5c, measured beside the
# training with two threads asleep when waiting (benchmarks/plan_costs.py, 2-core AMD EPYC, 100 GFLOP/s);
# where families differ, the largest family's is taken
EXPERIMENT = Experiment(
    "m1", SPECS, m1, runs, prepare=prepare, left=left, cost=2.3, on_pool=True, reads=("steering_form",)
)


def analyze_one(
    run: StudyRun, layers: tuple[int, ...] | None = None, sites: tuple[str, ...] | None = None, n_sequences: int = 512
) -> str:
    """``taskgeom analyze``: the M1 analysis of one run (``analysis/m1.json`` and ``figures/m1_*.png``
    written in its folder), and what it prints: P0-P2 per layer and site on the measurement batch,
    the places the claims read, their values and the steering readouts."""
    result = analyze(run, layers=layers, sites=sites, n_sequences=n_sequences)
    write(run, result)
    (run.path / "figures").mkdir(parents=True, exist_ok=True)
    plot_retrieval(result, {name: run.path / "figures" / f"m1_{name}.png" for name in FIGURES})
    table = pd.DataFrame(result.rows)
    per_layer = table[
        table["position"].isna() & (table["batch"] == "measure") & table["metric"].str.startswith(("p0", "p1", "p2"))
    ]
    steering = result.steering
    lines = [
        "measurement batch:",
        per_layer.pivot_table(index=["layer", "site"], columns="metric", values="value", sort=False)
        .round(4)
        .to_string(),
        f"the claims read layer {result.place[0]} ({result.place[1]}), P3 layer {result.p3_place[0]} ({result.p3_place[1]}); "
        f"the selected-place variant: layer {result.selected[0]} ({result.selected[1]})",
        *(f"  {claim:<24} {reading.value:.4g}" for claim, reading in claim_values(result.rows).items()),
        f"steering at layer {steering.place.layer} ({steering.place.site}), positions {steering.positions[0]}-{steering.positions[-1]}, "
        f"mean {steering.label} over {steering.n_points} target points:",
        *(f"  {kind:<24} {steering.mean(kind):.4g}" for kind in KINDS),
        str(run.path / "analysis" / "m1.json"),
    ]
    return "\n".join(lines)

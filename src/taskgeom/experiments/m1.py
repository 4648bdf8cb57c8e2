"""M1, Bayesian task retrieval (PAPER.md section 4): P0-P3 and causal steering on the k = -1 runs
of the recipes that declare ``m1`` (E1, E2, E3; the runs ``bayes_optimum`` and E2's own experiment
read too, whichever comes first trains them). Claims are read at the place (layer, site)
selected on a separate batch (highest R^2_task), measured on an independent batch (PAPER.md
section 7); every threshold is fixed here, beside its check, and the same for every family. For E2
the analysis reads the separators: P0's "cells" are a per-task intercept and linear map of the
query x_i, and steering compares predictions of y_i by RMSE instead of next-token laws by KL.
Steering is read at the study's own place (``analysis.steering.steering_place``)."""

from __future__ import annotations

import math

import pandas as pd

from taskgeom.analysis.retrieval import Result, analyze, write
from taskgeom.analysis.steering import KINDS, Steering
from taskgeom.analysis.study import StudyRun
from taskgeom.claims import Claim, check, not_applicable
from taskgeom.experiments.base import Context
from taskgeom.report.geometry import FIGURES, plot_retrieval
from taskgeom.report.manifest import M1_EVIDENCE

# P0, stability: share of late-window variance explained by the (task, current token) cell means.
MIN_CELL_R2 = 0.9
# P1, decoupling: share of the between-cell variance that task + token effects explain additively.
MIN_ADDITIVE_SHARE = 0.9
# P2, interpolation: R^2_task of the sum-to-one fit projected onto the simplex, over the late window ...
MIN_R2_TASK = 0.8
# ... and its margin over the same fit on a random subspace of equal dimension (mean over draws).
MIN_R2_MARGIN = 0.3
# P3, alignment: median total variation between beta_t and the posterior alpha_t over the last
# quarter of positions ...
MAX_TV_LATE = 0.1
# ... and shrinking: mean TV over the last quarter of the uncertain positions (largest alpha_t below
# 0.99) divided by that over their first quarter must be below one (n/a with fewer than 5 such).
MAX_TV_RATIO = 1.0
# Steering (PAPER.md section 9): the steered readout (the mean over the steered sequences and target
# points of KL(model || q_a); E2: of the RMSE to y_a) at most 1 / STEERING_FACTOR of the unsteered one
# and below the mode task's; the claim's value, max(factor * steered / unsteered, steered / mode),
# must be at most MAX_STEERING_SHARE (a tie with the mode task, of probability zero, would pass).
STEERING_FACTOR = {"kl": 3.0, "rmse": 2.0}
MAX_STEERING_SHARE = 1.0

_CAPTIONS = {
    "simplex": "{E}: fitted task coefficients beta_t (solid) and the exact posterior alpha_t (dashed) in the simplex for two "
               "sequences per major task; right: per-position median TV and KL(alpha || beta) with interquartile bands (P3)",
    "layers": "{E}: P0 (cell-means R^2), P1 (additive share) and P2 (R^2_task, beside a random subspace of equal dimension) per layer and site; "
              "with several seeds, the median over seeds and their range",
    "positions": "{E}: R^2_task of P2 at each position, every layer and site (the selected place bold; shaded: the late window the claim reads)",
    "steering": "{E}: the readout over the target points a ~ Dirichlet(1) of the simplex (KL(model || q_a) of next-token laws; E2: "
                "RMSE of the prediction of y to y_a), unsteered and steered one position per forward pass, with the means of both, "
                "the mode task's and a random direction's of the same norm",
}



def m1(ctx: Context) -> None:
    for experiment in (study.name for study in ctx.taking_part("m1")):
        results = {}
        for seed in ctx.seeds:
            run = StudyRun(ctx.trained(experiment, ("task.diversity=-1",), seed))
            with ctx.stage(f"analyse {run.path.name}"):
                results[seed] = analyze(run)
                write(run, results[seed])
            ctx.claim(seed, *claims(results[seed], ctx.profile))
        first = ctx.seeds[0]  # its figures illustrate; the per-layer one spans every seed, and the tables hold them all
        captions = {name: _CAPTIONS[name].format(E=experiment.upper()) + ("" if name == "layers" else f" (seed {first})") for name in FIGURES}
        plot_retrieval(results[first], {name: ctx.figure(f"{experiment}_m1_{name}.png", captions[name],
                                                         tuple(f"{experiment}.{claim}" for claim in M1_EVIDENCE[name]))
                                        for name in FIGURES},
                       seeds=pd.concat([pd.DataFrame(r.rows).assign(seed=seed) for seed, r in results.items()], ignore_index=True))


m1.runs = lambda ctx: [task for study in ctx.taking_part("m1") for task in ctx.plans(study.name, ("task.diversity=-1",))]  # for the schedule


def claims(result: Result, profile: str) -> list:
    """The M1 claims of one analysed run, read at its selected place on the measurement batch."""
    e, s = result.experiment, result.summary
    where = "at the place selected by R^2_task on a separate batch; layer and site in the parts"
    place = {"layer": result.best[0], "site": result.best[1]}
    if result.runner_up is not None:
        place |= {"runner_up_layer": result.runner_up[0], "runner_up_site": result.runner_up[1]}
    if result.effect == "current token":
        p0 = "P0: cell-means R^2 of (task, current token)"
    else:
        p0 = f"P0: R^2 of a per-task intercept and per-task {result.effect}"
    shrink = result.shrinkage
    shrink_description = ("P3: mean TV(beta_t, alpha_t) over the last quarter of the positions where the posterior is uncertain "
                          "(median max alpha_t < 0.99) divided by that over their first quarter")
    shrink_parts = {"tv_first": shrink.tv_first, "tv_last": shrink.tv_last, "uncertain_positions": len(shrink.positions)}
    if shrink.reason is None:
        shrinks = check(f"{e}.P3.shrinks", e, shrink_description, shrink.tv_last / shrink.tv_first, "<", MAX_TV_RATIO, profile, shrink_parts)
    else:
        shrinks = not_applicable(f"{e}.P3.shrinks", e, shrink_description, "<", MAX_TV_RATIO, profile, shrink.reason, shrink_parts)
    return [
        check(f"{e}.P0", e, f"{p0} over the late window ({where})", s["p0.cell_r2"], ">=", MIN_CELL_R2, profile, place),
        check(f"{e}.P1", e, f"P1: additive (task + {result.effect}, no interaction) share of the variance P0's model explains ({where})",
              s["p1.additive_share"], ">=", MIN_ADDITIVE_SHARE, profile, place),
        check(f"{e}.P2", e, f"P2: R^2_task of the simplex fit of h_t - mu_t - nu(x_t) on the task vectors, late window ({where})",
              s["p2.r2_task"], ">=", MIN_R2_TASK, profile, place),
        check(f"{e}.P2.vs_random", e, f"P2: R^2_task minus R^2 of the same fit on a random subspace of equal dimension ({where})",
              s["p2.r2_task"] - s["p2.r2_random"], ">=", MIN_R2_MARGIN, profile,
              {"r2_task": s["p2.r2_task"], "r2_random": s["p2.r2_random"], **place}),
        check(f"{e}.P3", e, f"P3: median TV(beta_t, alpha_t) over the last quarter of positions ({where})",
              s["p3.tv_last_quarter"], "<=", MAX_TV_LATE, profile, place),
        shrinks,
        steering_claim(result.steering, e, profile),
    ]


def steering_claim(steering: Steering, e: str, profile: str) -> Claim:
    """The steering claim of one run (PAPER.md sections 7 and 9) from its ``Steering``."""
    factor = STEERING_FACTOR[steering.measure]
    means = {kind: steering.mean(kind) for kind in KINDS}
    value = max(_ratio(factor * means["steered"], means["unsteered"]), _ratio(means["steered"], means["mode"]))
    return check(f"{e}.steering", e,
                 f"steering: max({factor:g} x steered / unsteered, steered / mode task) of the mean {steering.label} over the target points "
                 f"a ~ Dirichlet(1), one position per forward pass (<= 1: steered at most 1/{factor:g} of unsteered and below the mode task's); "
                 f"the study's place", value, "<=", MAX_STEERING_SHARE, profile,
                 {**means, "layer": steering.place.layer, "site": steering.place.site, "position_first": steering.positions[0],
                  "position_last": steering.positions[-1], "n_positions": len(steering.positions), "n_sequences": steering.n_sequences,
                  "n_points": steering.n_points, "form": steering.form})


def _ratio(x: float, y: float) -> float:
    """x / y for readouts x, y >= 0: inf when only y is 0, NaN (never passing) when both are."""
    return x / y if y > 0 else math.inf if x > 0 else math.nan

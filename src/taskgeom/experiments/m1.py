"""M1, Bayesian task retrieval (docs/concepts.md#m1-the-geometry-of-task-retrieval): P0-P3 and causal steering on the k = -1 runs
of the recipes that declare ``m1`` (E1, E2, E3; the runs ``bayes_optimum`` and E2's own experiment
read too, whichever comes first trains them). Claims are read as docs/protocol.md pins them: at
the study's block at the same relative depth, ``resid_post`` (``retrieval.claim_places``; the
parts name the layer and site each claim read), with the values of ``retrieval.claim_values``;
every threshold is fixed here, beside its check (docs/protocol.md#thresholds), and the same for every family. For
E2 the analysis reads its prediction positions: P0's "cells" are a per-task intercept and linear
map of the query x_i (an ANCOVA at each position), P2 reads r2_additive, and steering compares
predictions of y_i by RMSE instead of next-token laws by KL, one position per forward pass."""

from __future__ import annotations

import math

import pandas as pd

from taskgeom.analysis.retrieval import Result, analyze, claim_values, write
from taskgeom.analysis.steering import KINDS, Steering
from taskgeom.analysis.study import StudyRun
from taskgeom.claims import Claim, check, not_applicable
from taskgeom.experiments.base import Context
from taskgeom.report.geometry import FIGURES, plot_retrieval
from taskgeom.report.manifest import M1_EVIDENCE

# P0, stability: share of the variance at each position explained by the (task, current token) cell
# means (E2: per-task intercept and slope on x_t), median over the late window (the last quarter).
MIN_CELL_R2 = 0.9
# P1, decoupling: share of the between-cell variance that task + token effects explain additively,
# at each position, median over the late window.
MIN_ADDITIVE_SHARE = 0.9
# P2, interpolation: R^2_task of the sum-to-one fit projected onto the simplex, over the late window
# (E2: r2_additive, the task simplex plus a per-position linear map of x_t) ...
MIN_R2_TASK = 0.8
# ... and the margin of R^2_task over the same fit on a random subspace of equal dimension (mean over draws).
MIN_R2_MARGIN = 0.3
# P3, alignment: total variation between the per-task mean beta_t (projected) and the mean posterior
# alpha_t, mean over the tasks and the last quarter of positions ...
MAX_TV_LATE = 0.1
# ... and shrinking: on those mean curves, mean TV over the last quarter of the uncertain positions
# (the mean posterior's largest weight below 0.99, median over tasks) divided by that over their
# first quarter must be below one (n/a with fewer than 5 such).
MAX_TV_RATIO = 1.0
# Steering (docs/protocol.md#thresholds): the steered readout (the mean over the steered sequences and target
# points of KL(model || q_a); E2: of the RMSE to y_a) at most 1 / STEERING_FACTOR of the unsteered one
# and below the mode task's; the claim's value, max(factor * steered / unsteered, steered / mode),
# must be at most MAX_STEERING_SHARE (a tie with the mode task, of probability zero, would pass).
STEERING_FACTOR = {"kl": 3.0, "rmse": 2.0}
MAX_STEERING_SHARE = 1.0

_CAPTIONS = {
    "simplex": "{E}: fitted task coefficients beta_t (solid) and the exact posterior alpha_t (dashed) in the simplex for two "
               "sequences per major task; right: TV between the per-task mean beta_t and mean alpha_t (what P3 reads), and the "
               "per-position median per-state TV and KL(alpha || beta) with interquartile bands",
    "layers": "{E}: P0 (cell-means R^2), P1 (additive share), medians over the late window of the fits at each position, and P2 "
              "(R^2_task, beside a random subspace of equal dimension) per layer and site; with several seeds, the median over seeds and their range",
    "positions": "{E}: R^2_task of P2 at each position, every layer and site (the claims' place bold; shaded: the late window the claim reads)",
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
    """The M1 claims of one analysed run, read at the study's blocks on the measurement batch."""
    return [*retrieval_claims(claim_values(result.rows), result.experiment, profile, result.effect), steering_claim(result.steering, result.experiment, profile)]


def retrieval_claims(values: dict, e: str, profile: str, effect: str = "current token") -> list:
    """The claims P0-P3 of recipe ``e`` from ``retrieval.claim_values`` (the protocol's, or a
    variant's) of one run; ``effect``: the token-effect model in words."""
    where = "at the study's block at the same relative depth, resid_post (docs/protocol.md); layer and site in the parts"
    if effect == "current token":
        p0 = "P0: cell-means R^2 of (task, current token)"
        p2 = "P2: R^2_task of the simplex fit of h_t - mu_t - nu(x_t) on the task vectors, late window"
    else:
        p0 = f"P0: R^2 of a per-task intercept and per-task {effect}"
        p2 = "P2: r2_additive, the share of the variance of h_t - mu_t explained by the task simplex plus a per-position linear map of x_t, late window"
    late = "at each position, median over the last quarter of positions"
    shrink_description = ("P3: on the per-task mean curves, mean TV(mean beta_t, mean alpha_t) over the last quarter of the positions "
                          "where the mean posterior is uncertain (median over tasks of its largest weight < 0.99) divided by that over their first quarter")
    shrink = values["P3.shrinks"]
    if shrink.reason is None:
        shrinks = check(f"{e}.P3.shrinks", e, shrink_description, shrink.value, "<", MAX_TV_RATIO, profile, shrink.parts)
    else:
        shrinks = not_applicable(f"{e}.P3.shrinks", e, shrink_description, "<", MAX_TV_RATIO, profile, shrink.reason, shrink.parts)
    return [
        check(f"{e}.P0", e, f"{p0}, {late} ({where})", values["P0"].value, ">=", MIN_CELL_R2, profile, values["P0"].parts),
        check(f"{e}.P1", e, f"P1: additive (task + {effect}, no interaction) share of the variance P0's model explains, {late} ({where})",
              values["P1"].value, ">=", MIN_ADDITIVE_SHARE, profile, values["P1"].parts),
        check(f"{e}.P2", e, f"{p2} ({where})", values["P2"].value, ">=", MIN_R2_TASK, profile, values["P2"].parts),
        check(f"{e}.P2.vs_random", e, f"P2: R^2_task minus R^2 of the same fit on a random subspace of equal dimension ({where})",
              values["P2.vs_random"].value, ">=", MIN_R2_MARGIN, profile, values["P2.vs_random"].parts),
        check(f"{e}.P3", e, "P3: TV between the per-task mean of beta_t (projected onto the simplex) and the mean posterior alpha_t, "
              f"mean over the tasks and the last quarter of positions ({where}; E2: block 9 of 16)",
              values["P3"].value, "<=", MAX_TV_LATE, profile, values["P3"].parts),
        shrinks,
    ]


def steering_claim(steering: Steering, e: str, profile: str) -> Claim:
    """The steering claim of one run (docs/protocol.md) from its ``Steering``."""
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

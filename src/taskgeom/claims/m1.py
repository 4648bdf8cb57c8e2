"""The claims of M1, Bayesian task retrieval (docs/concepts.md#m1-the-geometry-of-task-retrieval):
P0-P3 and causal steering, each measured on a recipe's k = -1 run (E1, E2, E3), whose
``bayes_optimal`` claim is their precondition. Here is each claim's spec (threshold, figures),
how its value is read from a run's ``analysis/m1.json`` rows (``claim_values``, under the protocol
or a named variant, so the claims and ``taskgeom sensitivity`` read one function) and its judgement
(``claims``).

**The place** (docs/protocol.md): the claims read the study's block at the same relative depth,
``resid_post`` (the rows' ``place.m1`` and ``place.p3``); the parts name the layer and site each
claim read. P2 reads the study's ``r2_additive`` (R^2_task beside it; the variant ``p2-task-only``
reads R^2_task); for E2 steering compares predictions of y_i by RMSE instead of next-token laws by KL.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch

from taskgeom.analysis.measures.properties import too_few_uncertain, uncertain_quarters
from taskgeom.analysis.protocol import Protocol, active
from taskgeom.analysis.reading.steering import KINDS, Steering
from taskgeom.analysis.stored.m1 import Result
from taskgeom.claims.rules import Claim, Spec
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place

# Steering's normalisation: the steered readout must be at most 1 / factor of the unsteered one (KL of
# next-token laws; E2: RMSE of the prediction of y), and below the mode task's. The claim's value is
# max(factor x steered / unsteered, steered / mode); a value <= 1 passes.
STEERING_FACTOR = {"kl": 3.0, "rmse": 2.0}

_RECIPES = "E1, E2, E3 (k = -1)"
_WHERE = "at the study's block at the same relative depth, resid_post (layer and site in the parts)"
SPECS: tuple[Spec, ...] = (
    Spec(
        "P0",
        "m1",
        _RECIPES,
        "P0, stability: cell-means R^2 of (task, current token) on the study's forced-token cells at the last "
        "position it reads, T - 2 (per task and token value seen there, fresh prefixes of the task with that token "
        "written at the position; the natural late-window median in the parts); E2: R^2 of a per-task intercept and "
        "per-task linear map of x_t (the ANCOVA's r2_full) at its last position, on paired sequences of every major "
        f"task (the late-window median in the parts); {_WHERE}",
        ">=",
        0.9,
        ("layers",),
    ),
    Spec(
        "P1",
        "m1",
        _RECIPES,
        "P1, decoupling: the additive (task + current token, no interaction; E2: task + linear map of x_t) share "
        f"of the variance P0's model explains, on P0's cells (E2: at its last position, on P0's paired sequences); {_WHERE}",
        ">=",
        0.9,
        ("layers",),
    ),
    Spec(
        "P2",
        "m1",
        _RECIPES,
        "P2, interpolation: r2_additive, the share of the variance of h_t about its per-position mean explained by "
        "nu(x_t) and the simplex fit of h_t - mu_t - nu(x_t) on the task vectors (E3 after the next block's "
        "LayerNorm where one follows; E2: a per-position linear map of x_t), mean over the last ten of the study's "
        "evaluation positions, E1 and E3 on its forced-token cells (theta and nu from the cells of the task "
        f"vectors' window); {_WHERE}",
        ">=",
        0.8,
        ("layers", "positions"),
    ),
    Spec(
        "P2.vs_random",
        "m1",
        _RECIPES,
        "P2's r2_additive beyond that of the same fit on a random subspace of equal dimension, "
        f"as a partial R^2: (r2 - r2_random) / (1 - r2_random); {_WHERE}",
        ">=",
        0.3,
        ("layers",),
    ),
    Spec(
        "P3",
        "m1",
        _RECIPES,
        "P3, alignment: TV between the mean of beta_t over task 0's sequences (projected onto the simplex; beta the "
        "sum-to-one fit of h_t - mu_t on the averaged task vectors of positions 40-59, the token effect kept) and "
        "their mean posterior alpha_t, the study's trajectory figure, mean over the last quarter of its plotted "
        f"positions 0-59; {_WHERE}",
        "<=",
        0.1,
        ("simplex",),
    ),
    Spec(
        "P3.shrinks",
        "m1",
        _RECIPES,
        "P3.shrinks on P3's trajectory (task 0, its plotted positions): mean TV over the last "
        "quarter of the positions where task 0's mean posterior is uncertain (largest weight < 0.99) divided by that over "
        "their first quarter, floored at P3's 0.1 (n/a with fewer than 5 uncertain positions)",
        "<",
        1.0,
        ("simplex",),
    ),
    Spec(
        "steering",
        "m1",
        _RECIPES,
        "steering: max(3 x steered / unsteered, steered / mode task) of the mean KL(model || q_a) over the target "
        "points a ~ Dirichlet(1), one position per forward pass (E2: RMSE of the model's y to y_a, factor 2); <= 1: "
        "steered at most a third (E2: half) of unsteered and below the mode task's; the study's place (in the parts)",
        "<=",
        1.0,
        ("steering",),
    ),
)
_SPEC = {spec.name: spec for spec in SPECS}
# the forms published before the rule's (docs/protocol.md, "Claim forms"; the judged variants): the
# description a claim is judged with in that form
_FORMS = {
    ("P0", "late-median"): "P0, stability: cell-means R^2 of (task, current token) on the study's forced-token "
    "cells at the last position it reads, T - 2 (per task and token value seen there, fresh prefixes of the task with "
    "that token written at the position; the natural late-window median in the parts); E2: R^2 of a per-task "
    f"intercept and per-task linear map of x_t at each position, median over the last quarter of positions; {_WHERE}",
    ("P1", "late-median"): "P1, decoupling: the additive (task + current token, no interaction; E2: task + linear "
    f"map of x_t) share of the variance P0's model explains, on P0's cells (E2: at P0's positions); {_WHERE}",
    (
        "P2.vs_random",
        "difference",
    ): f"P2's r2_additive minus that of the same fit on a random subspace of equal dimension; {_WHERE}",
    ("P3.shrinks", "mean-curves"): "P3 on the per-task mean curves: mean TV(mean beta_t, mean alpha_t) over the "
    "last quarter of the positions where the mean posterior is uncertain (median over tasks of its largest weight "
    "< 0.99) divided by that over their first quarter (n/a with fewer than 5 uncertain positions)",
}


def _spec(name: str, protocol: Protocol) -> Spec:
    """Claim ``name``'s spec in ``protocol``'s form (its description says the form)."""
    form = {
        "P0": protocol.e2_p0_form,
        "P1": protocol.e2_p0_form,
        "P2.vs_random": protocol.p2_random_form,
        "P3.shrinks": protocol.p3_shrinks_form,
    }.get(name)
    found = _FORMS.get((name, form))
    return _SPEC[name] if found is None else replace(_SPEC[name], description=found)


class Reading(NamedTuple):
    """One M1 claim's value read from m1.json rows, its parts (the place it read: ``layer``,
    ``site``; the numbers it is made of) and, for a claim that does not apply (value NaN), why."""

    value: float
    parts: dict
    reason: str | None = None


def claim_values(rows: list[dict], protocol: Protocol | None = None) -> dict[str, Reading]:
    """{name of a P0-P3 claim: Reading} from a run's m1.json ``rows`` as ``protocol`` reads them (the
    study's, or a variant's, ``analysis.measures.variants``): ``place="selected"`` reads every claim at
    the place of best R^2_task on the selection batch; ``read_site`` at that site of the protocol's
    blocks; ``anova="pooled"`` reads P0/P1 pooled over the late window; ``cells="natural"`` reads them
    on natural states grouped by their token, the median over the late window (the study's:
    forced-token cells at the last position it reads; E2, which has no tokens to force, reads its
    paired layout's late-window median); ``p2="task-only"`` reads R^2_task; ``p3="late-window"`` the
    two-way layout's P3; ``p2_random_form`` and ``p3_shrinks_form`` are the forms of P2.vs_random
    (``beyond_random``) and P3.shrinks (``trajectory_shrinks`` for "trajectory"). Fields these claims do not read change nothing (the variants of the data
    are other runs: pass their rows). AnalysisError when the rows lack a value."""
    protocol = active() if protocol is None else protocol
    place, p3_place = _place(rows, "place.m1", "measure"), _place(rows, "place.p3", "measure")
    if protocol.read_site is not None:
        place, p3_place = Place(place.layer, protocol.read_site), Place(p3_place.layer, protocol.read_site)
    if protocol.place == "selected":
        place = p3_place = _place(rows, "place.selected", "select")
    table = {
        (r["metric"], r["layer"], r["site"]): r["value"]
        for r in rows
        if r["batch"] in ("measure", "cells", "trajectory") and r["position"] is None and r["task"] is None
    }
    cells = any(r["metric"] == "cells.tokens" for r in rows)  # a token family's forced-token cells (none: E2)
    # E2's layout at its last position (no tokens to force), read in the form that decides it
    last_position = protocol.e2_p0_form == "last-position" and any(r["metric"] == "cells.position" for r in rows)

    def at(metric: str, where: Place = place) -> float:
        if (metric, *where) not in table:
            raise AnalysisError(
                f"the m1.json rows hold no {metric} at layer {where.layer} ({where.site}); analyse the run again"
            )
        value = table[(metric, *where)]
        return math.nan if value is None else value

    placed, p3_placed = {"layer": place.layer, "site": place.site}, {"layer": p3_place.layer, "site": p3_place.site}
    r2_task, r2_random = at("p2.r2_task"), at("p2.r2_random")
    natural = protocol.cells == "natural" or not cells
    if protocol.anova == "pooled":  # natural states pooled over the late window
        p0, p1 = Reading(at("p0.cell_r2_pooled"), placed), Reading(at("p1.additive_share_pooled"), placed)
    elif natural and not (last_position and protocol.cells == "forced"):
        # natural states grouped by their token (E2: its paired layout), late-window medians
        p0 = Reading(at("p0.cell_r2"), {**placed, "cells": "natural"})
        p1 = Reading(
            at("p1.additive_share"), {**placed, "cells": "natural", "last_position": at("p1.additive_share_last")}
        )
    else:  # the study's forced-token cells (E2: paired sequences) at the last position it reads, the natural late-window median beside
        beside = {
            **placed,
            "cells": "forced" if cells else "paired",
            "position": int(at("cells.position")),
            "per_cell": int(at("cells.per_cell")),
        }
        p0 = Reading(at("p0.cell_r2_forced"), {**beside, "natural_late_median": at("p0.cell_r2")})
        p1 = Reading(at("p1.additive_share_forced"), {**beside, "natural_late_median": at("p1.additive_share")})
    if protocol.p2 == "task-only":  # the earlier quantity: R^2_task, the token effect removed from the total
        p2 = Reading(r2_task, placed)
        vs_random = beyond_random(r2_task, r2_random, protocol, {"r2_task": r2_task, "r2_random": r2_random, **placed})
    else:  # the study's r2_additive (on its forced-token cells; natural states for E2 and under natural-cells), R^2_task beside
        forced = "" if natural else "_forced"
        additive, additive_random = at(f"p2.r2_additive{forced}"), at(f"p2.r2_additive{forced}_random")
        p2 = Reading(
            additive,
            {
                **placed,
                "cells": "forced" if forced else "natural",
                "r2_task": r2_task,
                "post_layernorm": bool(at("p2.post_layernorm")),
            },
        )
        vs_random = beyond_random(
            additive,
            additive_random,
            protocol,
            {"r2_additive": additive, "r2_additive_random": additive_random, **placed},
        )
    late_window = Reading(
        at("p3.tv_mean_beta", p3_place), {"tv_per_state_last_quarter": at("p3.tv_last_quarter", p3_place), **p3_placed}
    )
    if protocol.p3 == "late-window":
        p3 = late_window
    else:  # the study's trajectory figure: task 0, its vectors from positions 40-59, the last quarter of its plotted 0-59 [ours]
        span = {
            key: int(at(f"p3.trajectory_{key}", p3_place))
            for key in ("first", "last", "estimation_first", "estimation_last")
        }
        p3 = Reading(
            at("p3.tv_trajectory", p3_place), {**span, "late_window_all_tasks": late_window.value, **p3_placed}
        )
    if protocol.p3_shrinks_form == "trajectory":
        shrinks = trajectory_shrinks(rows, p3_place, p3_placed)
    else:
        count = int(at("p3.uncertain_positions", p3_place))
        first, last = at("p3.tv_first_uncertain", p3_place), at("p3.tv_last_uncertain", p3_place)
        reason = too_few_uncertain(count)
        shrinks = Reading(
            math.nan if reason else last / first,
            {"tv_first": first, "tv_last": last, "uncertain_positions": count, **p3_placed},
            reason,
        )
    return {
        "P0": p0,
        "P1": p1,
        "P2": p2,
        "P2.vs_random": vs_random,
        "P3": p3,
        "P3.shrinks": shrinks,
    }


def trajectory_shrinks(rows: list[dict], place: Place, placed: dict) -> Reading:
    """P3.shrinks on the trajectory P3 reads (the ``trajectory`` form): among its plotted positions
    where the shown task's mean posterior is uncertain (``uncertain_quarters``), the mean TV over the
    last quarter over that over the first, the first floored at P3's threshold (a start already within
    P3's tolerance leaves nothing measurable to shrink); n/a with too few uncertain positions."""
    curves: dict[str, dict[tuple[int, int], float]] = {"p3.tv_trajectory": {}, "p3.trajectory_alpha_max": {}}
    for r in rows:
        if r["metric"] in curves and r["batch"] == "trajectory" and r["position"] is not None:
            if (r["layer"], r["site"]) == tuple(place):
                curves[r["metric"]][(r["task"], r["position"])] = r["value"]
    cells = sorted(curves["p3.tv_trajectory"])
    if not cells or set(cells) != set(curves["p3.trajectory_alpha_max"]):
        raise AnalysisError(
            "the m1.json rows hold no trajectory posterior (p3.trajectory_alpha_max); analyse the run again"
        )
    tasks, positions = sorted({k for k, _ in cells}), sorted({t for _, t in cells})
    tv, top = (
        torch.tensor([[curves[metric][(k, t)] for t in positions] for k in tasks], dtype=torch.float64)
        for metric in curves
    )
    found = uncertain_quarters(tv, top)
    floor = _SPEC["P3"].threshold
    parts = {
        "tv_first": found.tv_first,
        "tv_last": found.tv_last,
        "start_floor": floor,
        "uncertain_positions": len(found.positions),
        "first_uncertain": positions[found.positions[0]] if found.positions else None,
        "last_uncertain": positions[found.positions[-1]] if found.positions else None,
        **placed,
    }
    if found.reason:
        return Reading(math.nan, parts, found.reason)
    return Reading(found.tv_last / max(found.tv_first, floor), parts)


def beyond_random(r2: float, r2_random: float, protocol: Protocol, parts: dict) -> Reading:
    """P2.vs_random from P2's R^2 and the same fit's on a random subspace of equal dimension (``parts``
    beside them), in ``protocol.p2_random_form``: "difference", r2 - r2_random (its ceiling is
    1 - r2_random); "partial", (r2 - r2_random) / (1 - r2_random), the coefficient of partial
    determination of the task simplex beyond the random subspace (at most 1 whatever the baseline,
    negative where the fit explains less than the random one; n/a when the random subspace leaves
    nothing to explain)."""
    if protocol.p2_random_form == "difference":
        return Reading(r2 - r2_random, parts)
    if not r2_random < 1:
        return Reading(math.nan, parts, f"the random subspace leaves nothing to explain (its R^2 is {r2_random:.4g})")
    return Reading((r2 - r2_random) / (1 - r2_random), {**parts, "difference": r2 - r2_random})


def _place(rows: list[dict], label: str, batch: str) -> Place:
    """The place of the row ``label`` (``place.m1``, ``place.p3``, ``place.selected``) of ``batch``."""
    found = [r for r in rows if r["metric"] == label and r["batch"] == batch]
    if not found:
        raise AnalysisError(f"the m1.json rows have no {label} row; analyse the run again")
    return Place(int(found[0]["layer"]), found[0]["site"])


def claims(result: Result) -> list[Claim]:
    """The M1 claims of one analysed run, read at the study's blocks on the measurement batch."""
    return [
        *retrieval_claims(claim_values(result.rows), result.experiment),
        steering_claim(result.steering, result.experiment),
    ]


def retrieval_claims(values: dict[str, Reading], e: str) -> list[Claim]:
    """The claims P0-P3 of recipe ``e`` from ``claim_values`` (the protocol's, or a variant's) of one run."""
    protocol = active()
    return [
        _spec(name, protocol).judge(e, reading.value, reading.parts, reading.reason) for name, reading in values.items()
    ]


def steering_value(means: dict[str, float], measure: str) -> float:
    """The steering claim's value from the mean readouts {kind: mean} (``KINDS``) of ``measure``
    ("kl", "rmse"): max(factor x steered / unsteered, steered / mode task)."""
    factor = STEERING_FACTOR[measure]
    return max(_ratio(factor * means["steered"], means["unsteered"]), _ratio(means["steered"], means["mode"]))


def stored_steering(rows: list[dict], prefix: str = "steering") -> tuple[float, dict[str, float]] | None:
    """(value, {kind: mean}) of the steering stored in m1.json ``rows`` under ``prefix`` ("steering",
    the protocol's; ``analysis.stored.m1.READ_SITE_PREFIX``, the variant's); None if absent."""
    for measure in STEERING_FACTOR:
        means = {
            r["metric"].rsplit("_", 1)[1]: r["value"]
            for r in rows
            if r["metric"] in {f"{prefix}.{measure}_{kind}" for kind in KINDS} and r["position"] is None
        }
        if len(means) == len(KINDS):
            return steering_value(means, measure), means
    return None


def steering_claim(steering: Steering, e: str) -> Claim:
    """The steering claim of one run (docs/protocol.md) from its ``Steering``."""
    means = {kind: steering.mean(kind) for kind in KINDS}
    value = steering_value(means, steering.measure)
    return _SPEC["steering"].judge(
        e,
        value,
        {
            **means,
            "layer": steering.place.layer,
            "site": steering.place.site,
            "position_first": steering.positions[0],
            "position_last": steering.positions[-1],
            "n_positions": len(steering.positions),
            "n_sequences": steering.n_sequences,
            "n_points": steering.n_points,
            "form": steering.form,
        },
    )


def _ratio(x: float, y: float) -> float:
    """x / y for readouts x, y >= 0: inf when only y is 0, NaN (never passing) when both are."""
    return x / y if y > 0 else math.inf if x > 0 else math.nan

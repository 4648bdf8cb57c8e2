"""The M1 analysis of one finished run (``taskgeom analyze``, the M1 experiment): P0-P2 at every
requested layer and site, P3 at the selected place and causal steering at the study's place
(``steering.steering_place``, PAPER.md section 7), as the rows of
``analysis/m1.json`` (``rows``' layout; batch: the split, ``select`` or ``measure``). It is
written with the objects of ``analysis.study``, so each stored number is what they return.

**Selected, then measured apart** (PAPER.md section 7): on a selection batch of held-out major
sequences the full table of P0-P2 is computed at every (layer, site), and the place where the
task-vector description fits best (highest R^2_task of P2) is chosen; its runner-up is recorded.
Every claim is then measured at that place on an independent measurement batch (other sequences,
another stream), where the full table is written again. ``analyze``'s ``site`` restricts the
choice to one site (``taskgeom analyze --primary``).

The families differ in one place, ``heldout.family_inputs``: the token families (E1, E3, E4) take the
current token as x_t, a two-way layout over (task, token) for P0/P1, the posterior after each token
for P3 and KL to the target mixture for steering; E2 (regression) is read at its separators only,
where the model predicts y_i: x_t is that example's x with a linear token effect ``nu(x) = A x``
(``stability_linear``), alpha the posterior given the earlier examples, and steering compares the
prediction of y_i by RMSE. E2's analysis batches are paired: all K tasks share the same x
sequences, so the x effects cancel when task means are subtracted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.analysis.properties import Shrinkage, quantiles
from taskgeom.analysis.rows import row
from taskgeom.analysis.steering import KINDS, Steering, steering_place
from taskgeom.analysis.edits import Place
from taskgeom.analysis.geometry import Alignment, Geometry
from taskgeom.analysis.study import DEFAULT_SITES, StudyRun
from taskgeom.analysis.task_vectors import check_major_tasks
from taskgeom.errors import AnalysisError
from taskgeom.storage import atomic_write_json


@dataclass(frozen=True)
class Result:
    """rows: the m1.json rows; best: the selected place; runner_up: the second place (None when
    only one was measured); alpha, beta: [N, P, K] posterior and fitted coefficients there
    (measurement batch); task: [N]; steering: at ``steering.steering_place``; shrinkage: P3.shrinks' parts;
    summary: {metric: value} of the non-positional measurement rows at the best place; window: the
    late analysed positions."""

    experiment: str
    rows: list[dict]
    best: Place
    runner_up: Place | None
    task: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    steering: Steering
    shrinkage: Shrinkage
    summary: dict[str, float]
    window: slice
    effect: str = "current token"


def check_request(run: StudyRun, layers: tuple[int, ...] | None = None, sites: tuple[str, ...] | None = None, site: str | None = None,
                  n_sequences: int = 512, window: float = 0.25) -> list[Place]:
    """The places to analyse; AnalysisError (before any work) for what the run cannot give.
    layers: None for all; sites: those measured (None: those of DEFAULT_SITES the model has);
    site: the site the selected place must have (None: any measured one); window: the late
    fraction of positions (task vectors, P0/P1, P2, steering, P3's last quarter)."""
    n_layers = run.config.model.n_layers
    if layers is not None and not layers:
        raise AnalysisError(f"layers (none) do not exist; the model has layers 0..{n_layers - 1}")
    sites = sites or tuple(s for s in DEFAULT_SITES if s in run.directory.sites)
    places = run.places(sites, layers)
    if site is not None and site not in run.directory.sites:
        raise AnalysisError(f"unknown sites {[site]}; this model has {list(run.directory.sites)}")
    if site is not None and site not in sites:
        raise AnalysisError(f"the primary site {site!r} must be among the measured sites {list(sites)}")
    check_major_tasks(run.pool.n_major, f"analysing {run.path}")
    if n_sequences < 4 * run.pool.n_major:
        raise AnalysisError(f"n_sequences must be at least 4 per major task ({4 * run.pool.n_major}), got {n_sequences}")
    if not 0 < window <= 0.5:
        raise AnalysisError(f"window must lie in (0, 0.5], got {window}")
    return places


def place_rows(geometry: Geometry, per_position: bool) -> list[dict]:
    """P0-P2 of one place on its batch (and R^2_task per position)."""
    layout, p2, where = geometry.fit.layout, geometry.p2, {"place": geometry.place, "batch": geometry.sequences.split.value, "set": "major"}
    r2_random = p2.r2_random.double()
    rows = [
        row("p0.within_share", layout.within_share, **where),
        row("p0.cell_r2", geometry.p0, **where),
        row("p1.additive_share", geometry.p1, **where),
        row("p2.r2_task", p2.r2_task, **where),
        row("p2.r2_task_exact", p2.r2_exact, **where),
        row("p2.r2_random", r2_random.mean() if len(r2_random) else float("nan"),
            (r2_random.min(), r2_random.max()) if len(r2_random) else None, **where),
    ]
    if per_position:
        rows += [row("p2.r2_task", value, position=t, **where) for t, value in enumerate(p2.r2_by_position.tolist())]
    return rows


def analyze(run: StudyRun, *, layers: tuple[int, ...] | None = None, sites: tuple[str, ...] | None = None, site: str | None = None,
            n_sequences: int = 512, window: float = 0.25, n_random: int = 8) -> Result:
    """The M1 geometry of a finished run (options: ``check_request``; ``n_random``: P2's random
    subspaces); RunDirError if unfinished, AnalysisError for a bad request. Steering is measured at
    ``steering.steering_place`` on the measurement batch, whether or not that place is among the
    requested ones."""
    places = check_request(run, layers, sites, site, n_sequences, window)
    options = {"window": window, "n_random": n_random}
    selection = run.select_place(run.heldout("major", n_sequences, split="select"), places, site=site, **options)
    best, runner_up = selection.best, selection.runner_up
    rows: list[dict] = []
    for geometry in selection.geometries:
        rows += place_rows(geometry, per_position=False)
    r2 = {g.place: g.p2.r2_task for g in selection.geometries}
    for label, place in (("place.selected", best), ("place.runner_up", runner_up)):
        if place is not None:
            rows.append(row(label, r2[place], place=place, batch="select", set="major"))
    del selection  # its states, before the measurement batch's

    measure = run.heldout("major", n_sequences, split="measure")
    steered_at = steering_place(run.family, run.config.model.n_layers)
    kept = steering = None
    for geometry in run.geometries(measure, places, **options):
        rows += place_rows(geometry, per_position=True)
        if geometry.place == best:
            kept = geometry
        if geometry.place == steered_at:
            steering = geometry.steer("dirichlet")
    rows += alignment_rows(best, kept.p3, measure.batch.task)
    if steering is None:
        steering = run.geometry(measure, steered_at, **options).steer("dirichlet")
    rows += steering_rows(steering)

    summary = {r["metric"]: r["value"] for r in rows
               if r["batch"] == "measure" and (r["layer"], r["site"]) == best and r["position"] is None and r["task"] is None}
    return Result(run.config.name, rows, best, runner_up, measure.batch.task, measure.alpha.float(), kept.beta, steering,
                  kept.p3.shrinkage, summary, kept.window, measure.inputs.effect)


def alignment_rows(place: Place, p3: Alignment, task: torch.Tensor) -> list[dict]:
    """P3 at ``place`` of the measurement batch of tasks task: [N]: per position (median with
    interquartile band over sequences: all major sequences, then those of each task, ``task``
    set), over the first and last quarter of positions (median over all their states), and
    P3.shrinks' parts (mean TV over the first and last quarter of the uncertain positions, and how
    many there are)."""
    where = {"place": place, "batch": "measure", "set": "major"}
    rows = []
    for metric in ("tv", "kl"):
        values = getattr(p3, metric)
        for k in [None, *range(int(task.max()) + 1)]:
            med, low, high = quantiles(values if k is None else values[task == k], dim=0)
            rows += [row(f"p3.{metric}", med[t], (low[t], high[t]), position=t, task=k, **where) for t in range(values.shape[1])]
        for part in ("first", "last"):
            med, low, high = p3.quarter(metric, part)
            rows.append(row(f"p3.{metric}_{part}_quarter", med, (low, high), **where))
    shrink = p3.shrinkage
    rows += [row("p3.uncertain_positions", len(shrink.positions), **where),
             row("p3.tv_first_uncertain", shrink.tv_first, **where),
             row("p3.tv_last_uncertain", shrink.tv_last, **where)]
    return rows


def steering_rows(steering: Steering) -> list[dict]:
    """At the steering's place: steering.{measure}_{kind} (measure kl, or rmse for E2; kind one of
    unsteered, steered, mode, random): the mean over the (sequence, point) pairs with their
    interquartile band; and what was steered: the number of sequences and target points, the first
    and last edited position and how many were edited (one forward pass each)."""
    where = {"place": steering.place, "batch": "measure", "set": "major"}
    rows = []
    for kind in KINDS:
        _, low, high = quantiles(getattr(steering, kind).reshape(-1))
        rows.append(row(f"steering.{steering.measure}_{kind}", steering.mean(kind), (low, high), **where))
    rows += [row("steering.n_sequences", steering.n_sequences, **where), row("steering.n_points", steering.n_points, **where),
             row("steering.position_first", steering.positions[0], **where), row("steering.position_last", steering.positions[-1], **where),
             row("steering.n_positions", len(steering.positions), **where)]
    return rows


def write(run: StudyRun, result: Result) -> None:
    """Save the rows to ``analysis/m1.json`` (``pandas.read_json`` reads it in one call)."""
    atomic_write_json(run.path / "analysis" / "m1.json", result.rows)

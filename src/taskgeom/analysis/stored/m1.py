"""The M1 analysis of one finished run (``taskgeom analyze``, the M1 experiment): P0-P3 at every
requested layer and site, steering at the claims' block, as the rows of ``analysis/m1.json``
(``rows``' layout; batch: the split, ``select`` or ``measure``), and the rest of the ``Result`` in
``analysis/m1.safetensors`` (``write``; ``load`` reads both back for the same request). It is written with the objects of
``analysis.study``, so each stored number is what they return.

**The place** (docs/protocol.md): the M1 claims read a fixed block at ``resid_post``, the
study's block at the same relative depth (``claim_places``: the family's ``m1_block``, P3 its
``p3_block``; E1, E3 block 3 of 6, E2 block 10 of 16 and P3 block 9). Nothing measured chooses
it. The full table (P0-P3 at every layer and site) is written on the measurement batch; P3's
per-position rows at P3's place only. The selection batch's P0-P2 table and the place of best
R^2_task on it (``place.selected``, with ``place.runner_up``) remain for the ``selected-place``
variant (docs/protocol.md#variants). The claims read their values from these rows in
``claims.m1.claim_values``.

Rows (measurement batch, every place): ``p0.cell_r2``, ``p0.within_share``, ``p1.additive_share``
(medians over the late window, the last quarter of positions, of the layout fitted at each
position; also per position), ``p1.additive_share_last`` (the last position), the
``pooled-anova`` variant's ``*_pooled``; ``p2.r2_task`` (also per position), ``p2.r2_task_exact``,
``p2.r2_random``, ``p2.r2_additive`` (the claim; also per position) with ``p2.r2_additive_random`` and
``p2.post_layernorm``; ``p3.tv_mean_beta`` (the claim:
the TV of the per-task mean curves, averaged over the tasks and the last quarter; per position
and per task at P3's place), the per-state ``p3.tv`` / ``p3.kl`` medians by quarter (per position
and task at P3's place) and P3.shrinks' parts on the mean curves. Token families, on the study's forced-token cells
(batch ``cells``, every place; ``cell_rows``): ``p0.cell_r2_forced``, ``p0.within_share_forced``,
``p1.additive_share_forced`` at ``cells.position`` (T - 2; the claims P0, P1), and
``p2.r2_additive_forced`` with its random baseline (the claims P2, P2.vs_random; the rows above are
the variant ``natural-cells``). E2, with no tokens to force, has the same P0 and P1 rows at its last
analysed position, on ``cell_sequences`` paired sequences a task (``last_position_rows``; read under
``e2_p0_form="last-position"``). P3 as the study's trajectory figure computes it (batch
``trajectory``, every place; ``trajectory_rows``): ``p3.tv_trajectory`` (the claim P3; also per
position with ``p3.trajectory_alpha_max``, what P3.shrinks reads; the
``p3.tv_mean_beta`` rows above are the variant ``p3-late-window``). At the claims' block:
``steering.*`` (the protocol, written at ``resid_mid``) and ``steering_at_read_site.*`` (the variant).

The families differ in one place, ``analysis.reading.heldout.family_inputs``: the token families (E1, E3, E4) take the
current token as x_t, a two-way layout over (task, token) for P0/P1, the posterior after each token
for P3 and KL to the target mixture for steering; E2 (regression) is read at its prediction
positions, where the model predicts y_i: x_t is that example's x with a linear token effect
``nu(x) = A x`` (the ANCOVA of ``analysis.measures.properties.by_position``), alpha the posterior given the earlier
examples, and steering compares the prediction of y_i by RMSE. E2's analysis batches are
paired: all K tasks share the same x sequences, so the x effects cancel when task means are
subtracted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taskgeom.analysis.geometry import AdditiveR2, Alignment, Geometry
from taskgeom.analysis.measures.properties import MeanAlignment, quantiles
from taskgeom.analysis.measures.task_vectors import check_major_tasks
from taskgeom.analysis.measures.variants import protocol as variant_protocol
from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading.cells import ForcedCells
from taskgeom.analysis.reading.steering import KINDS, Steering, steering_place
from taskgeom.analysis.reading.trajectory import Trajectory
from taskgeom.analysis.stored.keys import is_current, key
from taskgeom.analysis.stored.rows import row, stamped, stored_rows
from taskgeom.analysis.study import StudyRun
from taskgeom.errors import AnalysisError, CheckpointError
from taskgeom.hooks import Place
from taskgeom.runs.storage import atomic_write_json, load_tensors, save_tensors
from taskgeom.tasks import TokenFamily


@dataclass(frozen=True)
class Result:
    """rows: the m1.json rows; place: where the M1 claims read (``claim_places``); p3_place: P3's;
    selected: the place of best R^2_task on the selection batch (the ``selected-place`` variant)
    and runner_up (None when only one was measured); alpha, beta: [N, P, K] posterior and fitted
    coefficients at p3_place (measurement batch); mean: P3's per-task mean curves there; task: [N];
    steering: at ``place``'s block; summary: {metric: value} of the non-positional measurement rows at
    ``place``; window: the late analysed positions; p2_window: those P2's claim averages."""

    experiment: str
    rows: list[dict]
    place: Place
    p3_place: Place
    selected: Place
    runner_up: Place | None
    task: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    mean: MeanAlignment
    steering: Steering
    summary: dict[str, float]
    window: slice
    p2_window: slice
    effect: str = "current token"
    request: dict = field(
        default_factory=dict
    )  # what was asked (``analysis_request``): a stored result is read back only for the same


READ_SITE_PREFIX = "steering_at_read_site"  # the rows of the variant steer-at-read-site


def claim_places(run: StudyRun) -> tuple[Place, Place]:
    """(the M1 claims' place, P3's): the study's blocks (the family's ``m1_block`` and
    ``p3_block``) at the same relative depth of this model, at ``resid_post`` (docs/protocol.md)."""
    n_layers, family = run.config.model.n_layers, run.family
    return steering_place(family, n_layers), Place.at_depth(*family.p3_block, n_layers)  # steering reads the M1 place


def check_request(
    run: StudyRun,
    layers: tuple[int, ...] | None = None,
    sites: tuple[str, ...] | None = None,
    n_sequences: int | None = None,
    window: float = 0.25,
    per_cell: int | None = None,
) -> list[Place]:
    """The places to analyse; AnalysisError (before any work) for what the run cannot give.
    layers: None for all; sites: those measured (None: those of the protocol's ``sites`` the model has); both
    must include the claims' places (``claim_places``); window: the late fraction of positions
    where the claims read P0-P3 (the task vectors' window is the family's ``vector_window``);
    per_cell: sequences a forced-token cell (the protocol's ``cell_sequences`` when None)."""
    per_cell = active().cell_sequences if per_cell is None else per_cell
    n_sequences = active().selection_sequences if n_sequences is None else n_sequences
    n_layers = run.config.model.n_layers
    if layers is not None and not layers:
        raise AnalysisError(f"layers (none) do not exist; the model has layers 0..{n_layers - 1}")
    sites = sites or tuple(s for s in active().sites if s in run.directory.sites)
    places = run.places(sites, layers)
    missing = [tuple(p) for p in dict.fromkeys(claim_places(run)) if p not in places]
    if missing:
        raise AnalysisError(f"the M1 claims read (layer, site) {missing} (docs/protocol.md); measure them too")
    check_major_tasks(run.pool.n_major, f"analysing {run.path}")
    if n_sequences < 4 * run.pool.n_major:
        raise AnalysisError(
            f"n_sequences must be at least 4 per major task ({4 * run.pool.n_major}), got {n_sequences}"
        )
    if not 0 < window <= 0.5:
        raise AnalysisError(f"window must lie in (0, 0.5], got {window}")
    if per_cell < 2:
        raise AnalysisError(f"per_cell (sequences a forced-token cell) must be at least 2, got {per_cell}")
    return places


def place_rows(geometry: Geometry, per_position: bool) -> list[dict]:
    """P0-P2 of one place on its batch (module docstring; and per position)."""
    pooled, p2, where = (
        geometry.pooled,
        geometry.p2,
        {"place": geometry.place, "batch": geometry.sequences.split.value, "set": "major"},
    )
    r2_random = p2.r2_random.double()
    rows = [
        row("p0.within_share", 1 - geometry.p0, **where),
        row("p0.cell_r2", geometry.p0, **where),
        row("p1.additive_share", geometry.p1, **where),
        row("p1.additive_share_last", geometry.p1_last, **where),
        row("p0.within_share_pooled", pooled.within_share, **where),
        row("p0.cell_r2_pooled", pooled.cell_r2, **where),
        row("p1.additive_share_pooled", pooled.additive_share, **where),
        row("p2.r2_task", p2.r2_task, **where),
        row("p2.r2_task_exact", p2.r2_exact, **where),
        row(
            "p2.r2_random",
            r2_random.mean() if len(r2_random) else float("nan"),
            (r2_random.min(), r2_random.max()) if len(r2_random) else None,
            **where,
        ),
    ]
    additive = geometry.p2_additive
    random = additive.random
    rows += [
        row("p2.r2_additive", additive.value, **where),
        row(
            "p2.r2_additive_random",
            random.mean() if len(random) else float("nan"),
            (random.min(), random.max()) if len(random) else None,
            **where,
        ),
        row("p2.post_layernorm", float(additive.post_layernorm), **where),
    ]
    curves = {
        "p2.r2_task": p2.r2_by_position,
        "p0.cell_r2": geometry.shares.cell_r2,
        "p1.additive_share": geometry.shares.additive_share,
        "p2.r2_additive": additive.by_position,
    }
    if per_position:
        rows += [
            row(metric, value, position=t, **where)
            for metric, curve in curves.items()
            for t, value in enumerate(curve.tolist())
        ]
    return rows


def cell_rows(cells: ForcedCells, p2: dict[Place, AdditiveR2]) -> list[dict]:
    """P0-P2 on the study's forced-token cells (batch ``cells``) at every place: P0 and P1 at the
    cells' position (``p0.cell_r2_forced``, ``p0.within_share_forced``, ``p1.additive_share_forced``,
    with ``cells.position``, ``cells.per_cell`` and ``cells.tokens``); P2's r2_additive on its own cells
    (``StudyRun.cell_p2``), the mean over its window (``p2.r2_additive_forced``, with its random
    baseline ``p2.r2_additive_forced_random``) and at each position of it."""
    rows = []
    for place in cells.states:
        layout, where = cells.layout(place), {"place": place, "batch": "cells", "set": "major"}
        A, _, N, _ = cells.states[place].shape
        rows += [
            row("p0.cell_r2_forced", layout.cell_r2, **where),
            row("p0.within_share_forced", layout.within_share, **where),
            row("p1.additive_share_forced", layout.additive_share, **where),
            row("cells.position", cells.position, **where),
            row("cells.per_cell", N, **where),
            row("cells.tokens", A, **where),
        ]
        additive = p2[place]
        random = additive.random
        rows += [
            row("p2.r2_additive_forced", additive.value, **where),
            row(
                "p2.r2_additive_forced_random",
                random.mean() if len(random) else float("nan"),
                (random.min(), random.max()) if len(random) else None,
                **where,
            ),
        ]
        rows += [
            row("p2.r2_additive_forced", float(additive.by_position[t]), position=t, **where)
            for t in range(additive.positions.start, additive.positions.stop)
        ]
    return rows


def last_position_rows(run: StudyRun, places: list[Place], per_task: int) -> list[dict]:
    """P0 and P1 of a family with no tokens to force (E2) as the study's table reads them: its layout
    (the ANCOVA) at the last analysed position, on ``per_task`` paired sequences of every major task
    (split ``cells``), at every place (batch ``cells``): ``p0.cell_r2_forced`` (the ANCOVA's r2_full),
    ``p0.within_share_forced``, ``p1.additive_share_forced``, with ``cells.position`` (in the analysed
    positions) and ``cells.per_cell`` (sequences a task)."""
    rows, cells = [], run.heldout_tasks("major", per_task, split="cells")
    for geometry in run.geometries(cells, places):
        shares, where = geometry.shares, {"place": geometry.place, "batch": "cells", "set": "major"}
        last = len(shares.within_share) - 1
        rows += [
            row("p0.cell_r2_forced", float(shares.cell_r2[last]), **where),
            row("p0.within_share_forced", float(shares.within_share[last]), **where),
            row("p1.additive_share_forced", float(shares.additive_share[last]), **where),
            row("cells.position", last, **where),
            row("cells.per_cell", per_task, **where),
        ]
    return rows


def trajectory_rows(trajectories: dict[Place, Trajectory]) -> list[dict]:
    """P3 as the study's trajectory figure computes it (batch ``trajectory``; ``StudyRun.trajectories``):
    ``p3.tv_trajectory`` at every place (the claim's reading, the mean over the last quarter of the
    plotted positions) with ``p3.trajectory_first`` and ``p3.trajectory_last`` (the plotted span) and
    ``p3.trajectory_estimation_first`` / ``_last`` (the task vectors' positions); and per plotted
    position and per shown task, with ``p3.trajectory_alpha_max``, the largest weight of the task's
    mean posterior (where P3.shrinks finds the uncertain positions, at any place a variant reads)."""
    rows = []
    for place, found in trajectories.items():
        where = {"place": place, "batch": "trajectory", "set": "major"}
        rows += [
            row("p3.tv_trajectory", found.value, **where),
            row("p3.trajectory_first", found.positions[0], **where),
            row("p3.trajectory_last", found.positions[-1], **where),
            row("p3.trajectory_estimation_first", found.estimation[0], **where),
            row("p3.trajectory_estimation_last", found.estimation[-1], **where),
        ]
        top = found.alpha.amax(-1)  # [tasks, P'] the mean posterior's largest weight
        rows += [
            row(metric, value, position=t, task=k, **where)
            for metric, curves in (("p3.tv_trajectory", found.tv), ("p3.trajectory_alpha_max", top))
            for k, curve in zip(found.tasks, curves.tolist())
            for t, value in zip(found.positions, curve)
        ]
    return rows


def analyze(
    run: StudyRun,
    *,
    layers: tuple[int, ...] | None = None,
    sites: tuple[str, ...] | None = None,
    n_sequences: int | None = None,
    window: float = 0.25,
    n_random: int = 8,
    per_cell: int | None = None,
) -> Result:
    """The M1 geometry of a finished run (options: ``check_request``; ``n_random``: P2's random
    subspaces; ``per_cell``: sequences a forced-token cell, ``StudyRun.forced_cells``, for P0 and P1
    of a token family); RunDirError if unfinished, AnalysisError for a bad request. Steering is measured at
    the claims' block (``analysis.reading.steering.steering_place``) as the study's injection does,
    on the protocol's ``steering_sequences`` sequences of the ``steering`` split, and as the variant
    ``steer-at-read-site`` on the measurement batch; ``per_cell``: the protocol's ``cell_sequences``
    when None."""
    per_cell = active().cell_sequences if per_cell is None else per_cell
    n_sequences = active().selection_sequences if n_sequences is None else n_sequences
    places = check_request(run, layers, sites, n_sequences, window, per_cell)
    request = analysis_request(places, n_sequences, window, n_random, per_cell)
    place, p3_place = claim_places(run)
    options = {"window": window, "n_random": n_random}
    selection = run.select_place(
        run.heldout("major", n_sequences, split="select"), places, **options
    )  # the selected-place variant
    rows: list[dict] = []
    for geometry in selection.geometries:
        rows += place_rows(geometry, per_position=False)
    r2 = {g.place: g.p2.r2_task for g in selection.geometries}
    for label, chosen in (("place.selected", selection.best), ("place.runner_up", selection.runner_up)):
        if chosen is not None:
            rows.append(row(label, r2[chosen], place=chosen, batch="select", set="major"))
    selected, runner_up = selection.best, selection.runner_up
    del selection  # its states, before the measurement batch's

    measure = run.heldout("major", n_sequences, split="measure")
    kept = {}
    for geometry in run.geometries(measure, places, **options):
        rows += place_rows(geometry, per_position=True)
        rows += alignment_rows(geometry.place, geometry.p3, measure.batch.task, per_position=geometry.place == p3_place)
        if geometry.place in (place, p3_place):
            kept[geometry.place] = geometry
    rows += [
        row(label, 1.0, place=at, batch="measure", set="major")
        for label, at in (("place.m1", place), ("place.p3", p3_place))
    ]
    rows += trajectory_rows(run.trajectories(places))
    if isinstance(run.family, TokenFamily):
        rows += cell_rows(run.forced_cells(places, per_cell=per_cell), run.cell_p2(places, n_random=n_random))
    else:
        rows += last_position_rows(run, places, per_cell)
    steered = run.heldout("major", active().steering_sequences, split="steering")
    steering = kept[place].steer("dirichlet", sequences=steered)
    rows += steering_rows(steering)
    rows += steering_rows(
        kept[place].steer("dirichlet", protocol=variant_protocol("steer-at-read-site")), READ_SITE_PREFIX
    )

    p3 = kept[p3_place]
    return Result(
        run.config.name,
        stamped(rows, "m1"),
        place,
        p3_place,
        selected,
        runner_up,
        measure.batch.task,
        measure.alpha.float(),
        p3.beta,
        p3.p3.mean,
        steering,
        _summary(rows, place),
        p3.window,
        kept[place].p2_additive.positions,
        measure.inputs.effect,
        request,
    )


def analysis_request(places: list[Place], n_sequences: int, window: float, n_random: int, per_cell: int) -> dict:
    """What one ``analyze`` call measured, as stored beside its result: the places and the options."""
    return {
        "places": [list(p) for p in places],
        "n_sequences": n_sequences,
        "window": window,
        "n_random": n_random,
        "per_cell": per_cell,
    }


def _summary(rows: list[dict], place: Place) -> dict[str, float]:
    """{metric: value} of the non-positional measurement-batch rows at ``place``."""
    return {
        r["metric"]: r["value"]
        for r in rows
        if r["batch"] == "measure"
        and (r["layer"], r["site"]) == tuple(place)
        and r["position"] is None
        and r["task"] is None
    }


def alignment_rows(place: Place, p3: Alignment, task: torch.Tensor, per_position: bool = True) -> list[dict]:
    """P3 at ``place`` of the measurement batch of tasks task: [N]: the claim's ``p3.tv_mean_beta``
    (the TV of the per-task mean curves, mean over the tasks and the last quarter of positions);
    the per-state TV and KL over the first and last quarter of positions (median over all their
    states); P3.shrinks' parts on the mean curves (mean TV over the first and last quarter of the
    uncertain positions, and how many there are). With ``per_position``: ``p3.tv_mean_beta`` per
    position (mean over the tasks, then each task's, ``task`` set) and the per-state TV and KL per
    position (median with interquartile band over sequences: all major sequences, then those of
    each task)."""
    where = {"place": place, "batch": "measure", "set": "major"}
    rows = [row("p3.tv_mean_beta", p3.tv_mean_beta, **where)]
    if per_position:
        curves = p3.mean.tv
        rows += [row("p3.tv_mean_beta", value, position=t, **where) for t, value in enumerate(curves.mean(0).tolist())]
        rows += [
            row("p3.tv_mean_beta", value, position=t, task=k, **where)
            for k, curve in enumerate(curves.tolist())
            for t, value in enumerate(curve)
        ]
    for metric in ("tv", "kl"):
        values = getattr(p3, metric)
        if per_position:
            for k in [None, *range(int(task.max()) + 1)]:
                med, low, high = quantiles(values if k is None else values[task == k], dim=0)
                rows += [
                    row(f"p3.{metric}", med[t], (low[t], high[t]), position=t, task=k, **where)
                    for t in range(values.shape[1])
                ]
        for part in ("first", "last"):
            med, low, high = p3.quarter(metric, part)
            rows.append(row(f"p3.{metric}_{part}_quarter", med, (low, high), **where))
    shrink = p3.shrinkage
    rows += [
        row("p3.uncertain_positions", len(shrink.positions), **where),
        row("p3.tv_first_uncertain", shrink.tv_first, **where),
        row("p3.tv_last_uncertain", shrink.tv_last, **where),
    ]
    return rows


def steering_rows(steering: Steering, prefix: str = "steering") -> list[dict]:
    """At the place steering wrote (the protocol: ``resid_mid`` of the M1 block; the variant
    ``steer-at-read-site``, ``prefix`` READ_SITE_PREFIX: ``resid_post``): {prefix}.{measure}_{kind}
    (measure kl, or rmse for E2; kind one of unsteered, steered, mode, random): the mean over the
    (sequence, point) pairs with their interquartile band; and what was steered: the number of
    sequences and target points, the first and last edited position and how many were edited (one
    forward pass each)."""
    where = {"place": steering.place, "batch": "measure", "set": "major"}
    rows = []
    for kind in KINDS:
        _, low, high = quantiles(getattr(steering, kind).reshape(-1))
        rows.append(row(f"{prefix}.{steering.measure}_{kind}", steering.mean(kind), (low, high), **where))
    rows += [
        row(f"{prefix}.n_sequences", steering.n_sequences, **where),
        row(f"{prefix}.n_points", steering.n_points, **where),
        row(f"{prefix}.position_first", steering.positions[0], **where),
        row(f"{prefix}.position_last", steering.positions[-1], **where),
        row(f"{prefix}.n_positions", len(steering.positions), **where),
    ]
    return rows


RESULT_FILE = "m1.safetensors"  # beside m1.json: the rest of a Result (its tensors, places and steering), for ``load``
_TENSORS = ("task", "alpha", "beta")
_STEERING_TENSORS = ("a", "sequence", "unsteered", "steered", "mode", "random")


def write(run: StudyRun, result: Result) -> None:
    """Save the rows to ``analysis/m1.json`` (``pandas.read_json`` reads it in one call) and the rest
    of ``result`` to ``analysis/m1.safetensors`` with the sha256 of that m1.json, so that ``load`` gives
    it back without measuring, and never beside other rows."""
    rows_path = run.path / "analysis" / "m1.json"
    atomic_write_json(rows_path, result.rows)
    steering = result.steering
    tensors = {
        **{name: getattr(result, name) for name in _TENSORS},
        **{f"mean.{name}": getattr(result.mean, name) for name in ("beta", "alpha", "tv")},
        **{f"steering.{name}": getattr(steering, name) for name in _STEERING_TENSORS},
    }
    fields = {
        "experiment": result.experiment,
        "place": result.place,
        "p3_place": result.p3_place,
        "selected": result.selected,
        "runner_up": result.runner_up,
        "window": _span(result.window),
        "p2_window": _span(result.p2_window),
        "effect": result.effect,
        "request": result.request,
        "steering": {
            "positions": steering.positions,
            "measure": steering.measure,
            "label": steering.label,
            "form": steering.form,
            "place": steering.place,
            "n_sequences": steering.n_sequences,
        },
    }
    save_tensors(
        run.path / "analysis" / RESULT_FILE,
        {name: t.clone() for name, t in tensors.items()},
        {
            "analysis": "m1",
            **{name: str(value) for name, value in key("m1").items()},
            "fields": json.dumps(fields),
            "rows_sha256": _sha256(rows_path),
        },
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(
    run: StudyRun,
    *,
    layers: tuple[int, ...] | None = None,
    sites: tuple[str, ...] | None = None,
    n_sequences: int | None = None,
    window: float = 0.25,
    n_random: int = 8,
    per_cell: int | None = None,
) -> Result | None:
    """The ``Result`` that ``analyze`` with these options gave, as ``write`` stored it, or None when the
    run has none: no file, another key (``keys.key``: format number, protocol), another request, or an m1.json written
    since (by another analysis). CheckpointError naming the file when it is damaged or not a stored M1
    result."""
    per_cell = active().cell_sequences if per_cell is None else per_cell
    n_sequences = active().selection_sequences if n_sequences is None else n_sequences
    path = run.path / "analysis" / RESULT_FILE
    rows = stored_rows(run, "m1")
    if rows is None or not path.exists():
        return None
    try:
        tensors, meta = load_tensors(path)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; delete it to measure the run again") from None
    if meta.get("analysis") != "m1" or "fields" not in meta:
        raise CheckpointError(f"{path} is not a stored M1 result; delete it to measure the run again")
    if meta.get("rows_sha256") != _sha256(run.path / "analysis" / "m1.json"):
        return None
    request = analysis_request(
        check_request(run, layers, sites, n_sequences, window, per_cell), n_sequences, window, n_random, per_cell
    )
    fields = json.loads(meta["fields"])
    if not is_current({name: meta.get(name) for name in key("m1")}, "m1", as_text=True) or fields["request"] != request:
        return None
    s = fields["steering"]
    steering = Steering(
        **{name: tensors[f"steering.{name}"] for name in _STEERING_TENSORS},
        positions=tuple(s["positions"]),
        measure=s["measure"],
        label=s["label"],
        form=s["form"],
        place=Place(*s["place"]),
        n_sequences=s["n_sequences"],
    )
    place = Place(*fields["place"])
    mean = MeanAlignment(tensors["mean.beta"], tensors["mean.alpha"], tensors["mean.tv"])
    return Result(
        fields["experiment"],
        rows,
        place,
        Place(*fields["p3_place"]),
        Place(*fields["selected"]),
        None if fields["runner_up"] is None else Place(*fields["runner_up"]),
        *(tensors[name] for name in _TENSORS),
        mean,
        steering,
        _summary(rows, place),
        slice(*fields["window"]),
        slice(*fields["p2_window"]),
        fields["effect"],
        request,
    )


def _span(window: slice) -> list[int | None]:
    return [window.start, window.stop]

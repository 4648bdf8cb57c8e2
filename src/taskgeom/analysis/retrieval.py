"""The M1 analysis of one finished run (``taskgeom analyze``): P0-P2 at every requested layer and
site, P3 and causal steering at the selected place, as tidy rows ``{experiment, batch, layer,
site, metric, value, band, position, task}`` (batch: ``selection`` or ``measure``; band: [low,
high] or None; position: None unless per position; task: None unless the row is one major task's).

**Selected, then measured apart** (PAPER.md section 7): on a selection batch of held-out major
sequences the full table of P0-P2 is computed at every (layer, site), and the place where the
task-vector description fits best (highest R^2_task of P2) is chosen; its runner-up is recorded.
Every claim is then measured at that place on an independent measurement batch (other sequences,
another stream), where the full table is written again. ``Options.site`` restricts the choice to
one site (``taskgeom analyze --primary``).

The families differ in one place, ``family_inputs``: the token families (E1, E3, E4) take the
current token as x_t, a two-way layout over (task, token) for P0/P1, the posterior after each token
for P3 and KL to the target mixture for steering; E2 (regression) is read at its separators only,
where the model predicts y_i: x_t is that example's x with a linear token effect ``nu(x) = A x``
(``stability_linear``), alpha the posterior given the earlier examples, and steering compares the
prediction of y_i by squared error. E2's analysis batches are paired: all K tasks share the same x
sequences, so the x effects cancel when task means are subtracted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch

from taskgeom.analysis.properties import (Geometry, Interpolation, Shrinkage, alignment, interpolation, quantiles, shrinkage, stability,
                                          stability_linear)
from taskgeom.analysis.states import stream_layers
from taskgeom.analysis.steering import (PredictionReadout, Readout, Steering, TokenReadout, code_from_layout, code_from_regression,
                                        steer)
from taskgeom.analysis.task_vectors import check_major_tasks, late_window
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Site
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json
from taskgeom.tasks import FAMILIES, Batch, TaskFamily, TaskPool, TokenFamily
from taskgeom.tasks.regression import Regression

Directions = Literal["task_vectors", "regression"]
DEFAULT_SITES = ("resid_mid", "resid_post")
SELECTION_STREAM, MEASURE_STREAM = "m1-select", "m1-measure"


@dataclass(frozen=True)
class Options:
    """layers: None for all; sites: the sites measured (None: those of DEFAULT_SITES the model has);
    site: restrict the selected place to this site (None: any measured site); window: the late
    fraction of positions (task vectors, P0/P1, P2, steering, P3's last quarter)."""

    layers: tuple[int, ...] | None = None
    sites: tuple[str, ...] | None = None
    site: str | None = None
    n_sequences: int = 512
    window: float = 0.25
    n_random: int = 8
    directions: Directions = "task_vectors"


@dataclass(frozen=True)
class Result:
    """rows: the tidy table; best: the selected (layer, site); runner_up: the second place (None
    when only one was measured); alpha, beta: [N, T, K] posterior and fitted coefficients there
    (measurement batch); task: [N]; steering: at the best place; shrinkage: P3.shrinks' parts;
    summary: {metric: value} of the non-positional measurement rows at the best place; window: the
    late analysed positions."""

    experiment: str
    rows: list[dict]
    best: tuple[int, str]
    runner_up: tuple[int, str] | None
    task: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    steering: Steering
    shrinkage: Shrinkage
    summary: dict[str, float]
    window: slice
    effect: str = "current token"


_SUPPORTED = (TokenFamily, Regression)


@dataclass(frozen=True)
class Inputs:
    """How a family's sequences enter the analysis. batch: the sequences; positions: [P] the model
    positions analysed (None: all); current: [N, P] tokens or [N, P, d] x_t there; fit: (h, task,
    current, K, window) -> Geometry (P0/P1 and the task subspace); vocab: the token count (None for
    continuous x_t); alpha: [N, P, K] exact posterior over the majors; readout: what steering
    compares; effect: the token-effect model in words."""

    batch: Batch
    positions: torch.Tensor | None
    current: torch.Tensor
    fit: Callable[..., Geometry]
    vocab: int | None
    alpha: torch.Tensor
    readout: Readout
    effect: str

    def select(self, h: torch.Tensor) -> torch.Tensor:
        """[N, P, D] the analysed positions of model states h: [N, T, D]."""
        return h if self.positions is None else h[:, self.positions]

    def model_positions(self, analysed: slice) -> slice | torch.Tensor:
        """The model positions of a slice of the analysed positions (what hooks edit)."""
        return analysed if self.positions is None else self.positions[analysed]


def family_inputs(family: TaskFamily, batch: Batch, pool: TaskPool) -> Inputs:
    """The one place the analysis depends on the family: the token-effect model and its companions."""
    if isinstance(family, TokenFamily):
        V = family.vocab_size

        def fit(h, task, current, K, window):
            return stability(h, task, current, K, V, window)

        return Inputs(batch, None, batch.tokens, fit, V, family.log_posterior(batch.tokens, pool).exp(),
                      TokenReadout(family, batch.tokens, pool.params), "current token")
    if isinstance(family, Regression):
        separators = family.prediction_positions(batch.x.shape[1])
        return Inputs(batch, separators, batch.x, stability_linear, None, family.log_posterior(batch, pool).exp(),
                      PredictionReadout(family, batch, pool.params), "linear map of x_t")
    raise AnalysisError(_unsupported(family))


def analysis_inputs(run: Run, stream: str, size: int) -> Inputs:
    """Held-out major-task sequences of ``stream`` with their family inputs (E2: paired over tasks)."""
    family, cfg, majors = run.family, run.config, run.pool.subset("major")
    if isinstance(family, Regression):
        batch = family.sample_paired(majors, size, cfg.task.seq_len, cfg.train.seed, 0, stream)
    else:
        batch = family.sample(run.pool, size, cfg.task.seq_len, cfg.train.seed, 0, stream, "major")
    if len(torch.unique(batch.task)) < majors.size:
        raise AnalysisError(f"{size} sequences do not cover all {majors.size} major tasks; ask for more")
    return family_inputs(family, batch, majors)


def _unsupported(family: TaskFamily) -> str:
    names = sorted(name for name, cls in FAMILIES.items() if issubclass(cls, _SUPPORTED))
    return f"the M1 analysis supports the families {names}; {family.name!r} is not supported yet"


def check_request(run: Run, options: Options) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The layers and sites to analyse; AnalysisError (before any work) for what the run cannot give."""
    if not isinstance(run.family, _SUPPORTED):
        raise AnalysisError(_unsupported(run.family))
    n_layers = run.config.model.n_layers
    layers = tuple(range(n_layers)) if options.layers is None else tuple(options.layers)
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad or not layers:
        raise AnalysisError(f"layers {bad or '(none)'} do not exist; the model has layers 0..{n_layers - 1}")
    sites = options.sites or tuple(s for s in DEFAULT_SITES if s in run.sites)
    unknown = [s for s in (*sites, *([options.site] if options.site else [])) if s not in run.sites]
    if unknown:
        raise AnalysisError(f"unknown sites {unknown}; this model has {list(run.sites)}")
    if options.site is not None and options.site not in sites:
        raise AnalysisError(f"the primary site {options.site!r} must be among the measured sites {list(sites)}")
    check_major_tasks(run.pool.n_major, f"analysing {run.path}")
    if options.n_sequences < 4 * run.pool.n_major:
        raise AnalysisError(f"n_sequences must be at least 4 per major task ({4 * run.pool.n_major}), got {options.n_sequences}")
    if not 0 < options.window <= 0.5:
        raise AnalysisError(f"window must lie in (0, 0.5], got {options.window}")
    return layers, sites


def _row(experiment: str, batch: str, layer: int | None, site: str | None, metric: str, value: float, band=None,
         position: int | None = None, task: int | None = None) -> dict:
    band = None if band is None else [float(band[0]), float(band[1])]
    return {"experiment": experiment, "batch": batch, "layer": layer, "site": site, "metric": metric, "value": float(value),
            "band": band, "position": position, "task": task}


@dataclass(frozen=True)
class Place:
    """One (layer, site) measured on one batch: its geometry, P2 fit and (when kept) states [N, P, D]."""

    site: Site
    geometry: Geometry
    p2: Interpolation
    states: torch.Tensor | None = None


def measure_places(model: torch.nn.Module, inputs: Inputs, sites: list[Site], window: slice, n_random: int, seed: int,
                   keep: Site | None = None) -> Iterator[Place]:
    """P0-P2 at each site, in layer order, from one streamed forward pass; ``keep``: the site whose
    analysed states are returned too."""
    K = inputs.alpha.shape[-1]
    task = inputs.batch.task
    for layer, states in stream_layers(model, inputs.batch.tokens, sites):
        for name, h in states.items():
            h = inputs.select(h)
            geometry = inputs.fit(h, task, inputs.current, K, window)
            p2 = interpolation(geometry.residual(h, inputs.current), geometry.subspace.theta, window, n_random, seed)
            yield Place((layer, name), geometry, p2, h if (layer, name) == keep else None)


def _place_rows(experiment: str, batch: str, place: Place, per_position: bool) -> list[dict]:
    layer, name = place.site
    layout, p2 = place.geometry.layout, place.p2
    r2_random = p2.r2_random.double()
    rows = [
        _row(experiment, batch, layer, name, "p0.within_share", layout.within_share),
        _row(experiment, batch, layer, name, "p0.cell_r2", layout.cell_r2),
        _row(experiment, batch, layer, name, "p1.additive_share", layout.additive_share),
        _row(experiment, batch, layer, name, "p2.r2_task", p2.r2_task),
        _row(experiment, batch, layer, name, "p2.r2_task_exact", p2.r2_exact),
        _row(experiment, batch, layer, name, "p2.r2_random", r2_random.mean() if len(r2_random) else float("nan"),
             (r2_random.min(), r2_random.max()) if len(r2_random) else None),
    ]
    if per_position:
        rows += [_row(experiment, batch, layer, name, "p2.r2_task", value, position=t) for t, value in enumerate(p2.r2_by_position.tolist())]
    return rows


def select_place(model: torch.nn.Module, inputs: Inputs, sites: list[Site], window: slice, n_random: int, seed: int,
                 site: str | None = None) -> tuple[Site, Site | None, list[Place]]:
    """(best, runner-up, every measured place) by R^2_task of P2 on the selection inputs; ``site``
    restricts the candidates to one site name."""
    places = list(measure_places(model, inputs, sites, window, n_random, seed))
    ranked = sorted((p for p in places if (site is None or p.site[1] == site) and math.isfinite(p.p2.r2_task)), key=lambda p: -p.p2.r2_task)
    if not ranked:
        raise AnalysisError("no place has a finite R^2_task to select by")
    return ranked[0].site, ranked[1].site if len(ranked) > 1 else None, places


def analyze(run: Run, options: Options = Options()) -> Result:
    """The M1 geometry of a finished run; RunDirError if unfinished, AnalysisError for a bad request."""
    layers, site_names = check_request(run, options)
    model = run.load_model()
    experiment, seed = run.config.name, run.config.train.seed
    sites = [(layer, name) for layer in layers for name in site_names]
    selection = analysis_inputs(run, SELECTION_STREAM, options.n_sequences)
    window = late_window(selection.current.shape[1], options.window)

    best, runner_up, chosen_from = select_place(model, selection, sites, window, options.n_random, seed, options.site)
    rows: list[dict] = []
    for place in chosen_from:
        rows += _place_rows(experiment, "selection", place, per_position=False)
    by_site = {p.site: p.p2.r2_task for p in chosen_from}
    for label, place in (("place.selected", best), ("place.runner_up", runner_up)):
        if place is not None:
            rows.append(_row(experiment, "selection", *place, label, by_site[place]))

    inputs = analysis_inputs(run, MEASURE_STREAM, options.n_sequences)
    kept = None
    for place in measure_places(model, inputs, sites, window, options.n_random, seed, keep=best):
        rows += _place_rows(experiment, "measure", place, per_position=True)
        if place.site == best:
            kept = place
    geometry, beta, alpha, task = kept.geometry, kept.p2.beta, inputs.alpha, inputs.batch.task
    tv_rows, shrink = _alignment_rows(experiment, best, beta, alpha, task, window)
    rows += tv_rows

    if options.directions == "task_vectors":
        code = code_from_layout(geometry.layout)
    else:
        late = kept.states[:, window]
        K = alpha.shape[-1]
        code = code_from_regression(late.reshape(-1, late.shape[-1]), alpha[:, window].reshape(-1, K),
                                    inputs.current[:, window].reshape(-1, *inputs.current.shape[2:]), inputs.vocab)
    steering = steer(model, inputs.readout, inputs.batch.tokens, inputs.current[:, window], best, inputs.model_positions(window), window,
                     geometry.subspace.basis, code, generator(seed, 0, "steering"))
    rows += _steering_rows(experiment, best, steering)

    summary = {r["metric"]: r["value"] for r in rows
               if r["batch"] == "measure" and (r["layer"], r["site"]) == best and r["position"] is None and r["task"] is None}
    return Result(experiment, rows, best, runner_up, task, alpha.float(), beta, steering, shrink, summary, window, inputs.effect)


def _alignment_rows(experiment: str, place: Site, beta: torch.Tensor, alpha: torch.Tensor, task: torch.Tensor,
                    window: slice) -> tuple[list[dict], Shrinkage]:
    """P3 per position (median with interquartile band over sequences: all major sequences, then
    those of each task, ``task`` key set), over the first and last quarter of positions (median
    over all their states), and P3.shrinks' parts (mean TV over the first and last quarter of the
    uncertain positions, and how many there are)."""
    layer, site = place
    tv, kl = alignment(beta, alpha)
    T = tv.shape[1]
    first = slice(0, T - window.start)
    rows = []
    for metric, values in (("p3.tv", tv), ("p3.kl", kl)):
        for k in [None, *range(alpha.shape[-1])]:
            med, low, high = quantiles(values if k is None else values[task == k], dim=0)
            rows += [_row(experiment, "measure", layer, site, metric, med[t], (low[t], high[t]), t, k) for t in range(T)]
        for part, span in (("first_quarter", first), ("last_quarter", window)):
            med, low, high = quantiles(values[:, span].reshape(-1))
            rows.append(_row(experiment, "measure", layer, site, f"{metric}_{part}", med, (low, high)))
    shrink = shrinkage(tv, alpha)
    rows += [_row(experiment, "measure", layer, site, "p3.uncertain_positions", len(shrink.positions)),
             _row(experiment, "measure", layer, site, "p3.tv_first_uncertain", shrink.tv_first),
             _row(experiment, "measure", layer, site, "p3.tv_last_uncertain", shrink.tv_last)]
    return rows, shrink


def _steering_rows(experiment: str, place: Site, steering: Steering) -> list[dict]:
    """steering.{measure}_{kind} (measure: kl, or sq for E2's squared error) and the ratio of medians."""
    rows, medians = [], {}
    for kind in ("unsteered", "steered", "random"):
        med, low, high = quantiles(getattr(steering, kind).reshape(-1))
        medians[kind] = float(med)
        rows.append(_row(experiment, "measure", *place, f"steering.{steering.measure}_{kind}", med, (low, high)))
    rows.append(_row(experiment, "measure", *place, "steering.ratio", medians["unsteered"] / medians["steered"]))
    return rows


def write(run: Run, result: Result) -> None:
    """Save the rows to ``analysis/m1.json`` (``pandas.read_json`` reads it in one call)."""
    atomic_write_json(run.path / "analysis" / "m1.json", result.rows)

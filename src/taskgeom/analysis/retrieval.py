"""The M1 analysis of one finished run (``taskgeom analyze``): P0-P2 at every requested layer and
site, P3 and causal steering at the best layer, as tidy rows ``{experiment, layer, site, metric,
value, band, position, task}`` (band: [low, high] or None; position: None unless per position;
task: None unless the row is one major task's).

The best layer is the one whose cell-means R^2 (P0) is highest at the primary site; P1-P3 claims
and steering use that (layer, primary site). States come from held-out major-task sequences
(``n_sequences`` in all, tasks drawn uniformly), streamed one layer at a time.

The families differ in one place, ``family_inputs``: the token families (E1, E3, E4) take the
current token as x_t, a two-way layout over (task, token) for P0/P1, the posterior after each token
for P3 and KL to the target mixture for steering; E2 (regression) takes the current example's x as
x_t with a linear token effect ``nu(x) = A x`` (``stability_linear``), the posterior in force at each
model position, and the squared error of the prediction of y_i for steering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from taskgeom.analysis.properties import Geometry, alignment, interpolation, quantiles, stability, stability_linear
from taskgeom.analysis.states import analysis_batch, stream_layers
from taskgeom.analysis.steering import (PredictionReadout, Readout, Steering, TokenReadout, code_from_layout, code_from_regression,
                                        steer)
from taskgeom.analysis.task_vectors import late_window
from taskgeom.errors import AnalysisError
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json
from taskgeom.tasks import FAMILIES, Batch, TaskFamily, TaskPool, TokenFamily
from taskgeom.tasks.regression import Regression

Directions = Literal["task_vectors", "regression"]
DEFAULT_SITES = ("resid_mid", "resid_post")


@dataclass(frozen=True)
class Options:
    """layers: None for all; sites: the sites measured (None: those of DEFAULT_SITES the model has);
    site: the primary site (claims, steering); window: the late fraction of positions (task vectors,
    P0/P1, steering, P3's last quarter)."""

    layers: tuple[int, ...] | None = None
    sites: tuple[str, ...] | None = None
    site: str = "resid_post"
    n_sequences: int = 512
    window: float = 0.25
    n_random: int = 8
    directions: Directions = "task_vectors"


@dataclass(frozen=True)
class Result:
    """rows: the tidy table; best: (layer, site) of the claims; alpha, beta: [N, T, K] posterior and
    fitted coefficients there; task: [N]; steering: at the best layer; summary: {metric: value} of
    the non-positional rows at the best (layer, site)."""

    experiment: str
    rows: list[dict]
    best: tuple[int, str]
    task: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    steering: Steering
    summary: dict[str, float]
    effect: str = "current token"


_SUPPORTED = (TokenFamily, Regression)


@dataclass(frozen=True)
class Inputs:
    """How a family's current input enters the analysis. current: [N, T] tokens or [N, T, d] x_t;
    fit: (h, task, current, K, window) -> Geometry (P0/P1 and the task vectors); vocab: the token
    count (None for continuous x_t); alpha: [N, T, K] exact posterior over the majors at each
    position; readout: what steering compares; effect: the token-effect model in words."""

    current: torch.Tensor
    fit: Callable[..., Geometry]
    vocab: int | None
    alpha: torch.Tensor
    readout: Readout
    effect: str


def family_inputs(family: TaskFamily, batch: Batch, pool: TaskPool) -> Inputs:
    """The one place the analysis depends on the family: the token-effect model and its companions."""
    if isinstance(family, TokenFamily):
        V = family.vocab_size

        def fit(h, task, current, K, window):
            return stability(h, task, current, K, V, window)

        return Inputs(batch.tokens, fit, V, family.log_posterior(batch.tokens, pool).exp(), TokenReadout(family, batch.tokens, pool.params),
                      "current token")
    if isinstance(family, Regression):
        return Inputs(family.current_x(batch), stability_linear, None, family.position_log_posterior(batch, pool).exp(),
                      PredictionReadout(family, batch, pool.params), "linear map of x_t")
    raise AnalysisError(_unsupported(family))


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
    unknown = [s for s in (*sites, options.site) if s not in run.sites]
    if unknown:
        raise AnalysisError(f"unknown sites {unknown}; this model has {list(run.sites)}")
    if options.site not in sites:
        raise AnalysisError(f"the primary site {options.site!r} must be among the measured sites {list(sites)}")
    if run.pool.n_major < 2:
        raise AnalysisError(f"the task subspace needs at least 2 major tasks; this run has {run.pool.n_major}")
    if options.n_sequences < 4 * run.pool.n_major:
        raise AnalysisError(f"n_sequences must be at least 4 per major task ({4 * run.pool.n_major}), got {options.n_sequences}")
    if not 0 < options.window <= 0.5:
        raise AnalysisError(f"window must lie in (0, 0.5], got {options.window}")
    return layers, sites


def _row(experiment: str, layer: int | None, site: str | None, metric: str, value: float, band=None, position: int | None = None,
         task: int | None = None) -> dict:
    band = None if band is None else [float(band[0]), float(band[1])]
    return {"experiment": experiment, "layer": layer, "site": site, "metric": metric, "value": float(value), "band": band,
            "position": position, "task": task}


def analyze(run: Run, options: Options = Options()) -> Result:
    """The M1 geometry of a finished run; RunDirError if unfinished, AnalysisError for a bad request."""
    layers, site_names = check_request(run, options)
    model = run.load_model()
    family, pool, experiment = run.family, run.pool.subset("major"), run.config.name
    K, T = pool.size, run.config.task.seq_len
    batch = analysis_batch(run, "major", options.n_sequences)
    tokens, task = batch.tokens, batch.task
    inputs = family_inputs(family, batch, pool)
    current, alpha = inputs.current, inputs.alpha  # x_t: [N, T] or [N, T, d]; alpha: [N, T, K]
    if len(torch.unique(task)) < K:
        raise AnalysisError(f"{options.n_sequences} sequences do not cover all {K} major tasks; ask for more")
    window = late_window(T, options.window)
    seed = run.config.train.seed

    rows: list[dict] = []
    kept: dict[int, tuple[Geometry, torch.Tensor]] = {}
    sites = [(layer, name) for layer in layers for name in site_names]
    for layer, states in stream_layers(model, tokens, sites):
        for name, h in states.items():
            geometry = inputs.fit(h, task, current, K, window)
            p2 = interpolation(geometry.residual(h, current), geometry.vectors.theta, options.n_random, seed)
            r2_random = p2.r2_random.double()
            rows += [
                _row(experiment, layer, name, "p0.within_share", geometry.layout.within_share),
                _row(experiment, layer, name, "p0.cell_r2", geometry.layout.cell_r2),
                _row(experiment, layer, name, "p1.additive_share", geometry.layout.additive_share),
                _row(experiment, layer, name, "p2.r2_task", p2.r2_task),
                _row(experiment, layer, name, "p2.r2_task_exact", p2.r2_exact),
                _row(experiment, layer, name, "p2.r2_random", r2_random.mean(), (r2_random.min(), r2_random.max())),
            ]
            if name == options.site:
                kept[layer] = (geometry, p2.beta)

    cell_r2 = {layer: geometry.layout.cell_r2 for layer, (geometry, _) in kept.items()}
    best = max(cell_r2, key=cell_r2.get)
    geometry, beta = kept[best]
    rows += _alignment_rows(experiment, best, options.site, beta, alpha, task, window)

    if options.directions == "task_vectors":
        code = code_from_layout(geometry.layout)
    else:
        late = next(states for _, states in stream_layers(model, tokens, [(best, options.site)], positions=window))[options.site]
        late_inputs = current[:, window].reshape(-1, *current.shape[2:])
        code = code_from_regression(late.reshape(-1, late.shape[-1]), alpha[:, window].reshape(-1, K), late_inputs, inputs.vocab)
    steering = steer(model, inputs.readout, tokens, current, (best, options.site), window, geometry.vectors.basis, code,
                     generator(seed, 0, "steering"))
    rows += _steering_rows(experiment, best, options.site, steering)

    summary = {r["metric"]: r["value"] for r in rows if r["layer"] == best and r["site"] == options.site and r["position"] is None}
    return Result(experiment, rows, (best, options.site), task, alpha.float(), beta, steering, summary, inputs.effect)


def _alignment_rows(experiment: str, layer: int, site: str, beta: torch.Tensor, alpha: torch.Tensor, task: torch.Tensor,
                    window: slice) -> list[dict]:
    """P3 per position (median with interquartile band over sequences: all major sequences, then
    those of each task, ``task`` key set) and over the first and last quarter of positions (median
    over all their states)."""
    tv, kl = alignment(beta, alpha)
    T = tv.shape[1]
    first = slice(0, T - window.start)
    rows = []
    for metric, values in (("p3.tv", tv), ("p3.kl", kl)):
        for k in [None, *range(alpha.shape[-1])]:
            med, low, high = quantiles(values if k is None else values[task == k], dim=0)
            rows += [_row(experiment, layer, site, metric, med[t], (low[t], high[t]), t, k) for t in range(T)]
        for part, span in (("first_quarter", first), ("last_quarter", window)):
            med, low, high = quantiles(values[:, span].reshape(-1))
            rows.append(_row(experiment, layer, site, f"{metric}_{part}", med, (low, high)))
    return rows


def _steering_rows(experiment: str, layer: int, site: str, steering: Steering) -> list[dict]:
    """steering.{measure}_{kind} (measure: kl, or sq for E2's squared error) and the ratio of medians."""
    rows, medians = [], {}
    for kind in ("unsteered", "steered", "random"):
        med, low, high = quantiles(getattr(steering, kind).reshape(-1))
        medians[kind] = float(med)
        rows.append(_row(experiment, layer, site, f"steering.{steering.measure}_{kind}", med, (low, high)))
    rows.append(_row(experiment, layer, site, "steering.ratio", medians["unsteered"] / medians["steered"]))
    return rows


def write(run: Run, result: Result) -> None:
    """Save the rows to ``analysis/m1.json`` (``pandas.read_json`` reads it in one call)."""
    atomic_write_json(run.path / "analysis" / "m1.json", result.rows)

"""The researcher's objects (``import taskgeom as tg``): a run, its held-out sequences, a place, the
geometry there and the edits made there; the verbs are their methods, the options keywords.

- ``StudyRun`` (``tg.open_run(path)``): the model, family, pool and config of a finished run;
  ``heldout`` sequences of a named ``Split``; ``cache`` states at places; ``geometry`` there;
  ``select_place``; ``loss`` (under any edit whose ``with`` block is open); ``ablate`` directions;
  ``orthogonal_search``; ``snapshots`` (the run at each kept training step).
- ``Sequences``: one held-out batch with what the analysis reads of it (``inputs``, the exact
  posterior ``alpha``, the Bayes ``references`` of its losses).
- ``Place``: ``(layer, site)``, a named tuple that every hook accepts.
- ``Geometry``: the M1 geometry at a place (PAPER.md section 4): task vectors, the basis of S,
  token effects, P0-P3 and beta; ``steer`` toward a point of the simplex, ``ablate`` S,
  ``projection_r2`` of other states (section 5).
- ``Edit``: a change of the states at one place, in force while its ``with`` block runs.

The stored analyses (``m1.json``, ``dual.json``) are written with these objects
(``analysis.retrieval``, ``analysis.dual``), so a stored number is what the API returns.

Shapes: ``N`` sequences, ``P`` analysed positions (every position; E2: its separators), ``D``
width, ``K`` major tasks.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator, Literal, NamedTuple, Sequence

import torch

from taskgeom.analysis.heldout import Inputs, Kind, Split, family_inputs, sample, unsupported
from taskgeom.analysis.orthogonal import BATCH_SIZE, avoid_basis, orthogonal_searches, token_subspace
from taskgeom.analysis.properties import Geometry as Fit, Interpolation, Shrinkage, alignment, interpolation, quantiles, shrinkage
from taskgeom.analysis.states import LayerStreams, stream_layers
from taskgeom.analysis.steering import Steering, code_from_layout, code_from_regression, dirichlet_points, steer
from taskgeom.analysis.subspace import direction_ablation, projection_r2, task_ablation
from taskgeom.analysis.task_vectors import late_window
from taskgeom.errors import AnalysisError
from taskgeom.hooks import intervene
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.tasks import Batch
from taskgeom.tasks.regression import Regression

DEFAULT_SITES = ("resid_mid", "resid_post")
SEARCH_STREAM = "dual-ood-search"  # the orthogonal search's fresh OOD batch of each step
Form = Literal["token", "plain"]
Directions = Literal["task_vectors", "regression"]


class Place(NamedTuple):
    """Where states are read or edited: block ``layer``, hook ``site`` (resid_mid, resid_post, ...)."""

    layer: int
    site: str


class Sequences:
    """Held-out sequences of one run: ``batch`` (``kind`` sequences of ``split``), with what the
    analysis reads of them, computed when first asked for."""

    def __init__(self, run: "StudyRun", kind: Kind, split: Split, batch: Batch):
        self.kind, self.split, self.batch = kind, split, batch
        self._family, self._pool = run.family, run.pool

    def __len__(self) -> int:
        return self.batch.tokens.shape[0]

    @cached_property
    def inputs(self) -> Inputs:
        """The family's inputs (analysed positions, current tokens or x_t, posterior over the majors)."""
        return family_inputs(self._family, self.batch, self._pool.subset("major"))

    @property
    def alpha(self) -> torch.Tensor:
        """[N, P, K] the exact posterior over the major tasks after each analysed position."""
        return self.inputs.alpha

    @cached_property
    def references(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (ID-Bayes, OOD-optimal) predictions the losses are scored beside (float64)."""
        return self._family.reference_predictions(self.batch, self._pool)


class Edit:
    """A change ``change: [B, P', D] -> [B, P', D]`` of the states at ``place`` on ``positions``
    (None: all), in force on the run's model while its ``with`` block runs (removed on exit, even
    on error)."""

    def __init__(self, run: "StudyRun", place: Place, change: Callable[[torch.Tensor], torch.Tensor],
                 positions: slice | torch.Tensor | None):
        self.run, self.place, self.change, self.positions = run, Place(*place), change, positions
        self._hook = None

    def __enter__(self) -> "Edit":
        if self._hook is not None:
            raise AnalysisError(f"this edit at {tuple(self.place)} is already in force")
        self._hook = intervene(self.run.model, self.place, self.change, self.positions)
        self._hook.__enter__()
        self.run._edits.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.run._edits.remove(self)
        hook, self._hook = self._hook, None
        hook.__exit__(*exc)


@dataclass(frozen=True)
class Alignment:
    """P3 at a place: tv, kl: [N, P] distances between beta_t and the posterior alpha_t (total
    variation, KL(alpha || beta)); shrinkage: P3.shrinks' parts; window: the late positions."""

    tv: torch.Tensor
    kl: torch.Tensor
    shrinkage: Shrinkage
    window: slice

    @classmethod
    def of(cls, beta: torch.Tensor, alpha: torch.Tensor, window: slice) -> "Alignment":
        """P3 of fitted coefficients beta and the posterior alpha: [N, P, K]."""
        tv, kl = alignment(beta, alpha)
        return cls(tv, kl, shrinkage(tv, alpha), window)

    def quarter(self, metric: Literal["tv", "kl"], part: Literal["first", "last"]) -> tuple[float, float, float]:
        """(median, lower, upper quartile) of ``metric`` over every state of the first or last quarter of positions."""
        values = getattr(self, metric)
        span = self.window if part == "last" else slice(0, values.shape[1] - self.window.start)
        return tuple(float(q) for q in quantiles(values[:, span].reshape(-1)))

    @property
    def tv_last_quarter(self) -> float:
        """The median TV over the last quarter of positions: what the P3 claim reads."""
        return self.quarter("tv", "last")[0]


class Geometry:
    """The M1 geometry at ``place`` fitted on the major ``sequences`` (states: [N, P, D] there):
    the two-way layout over (task, current token) of the late window (E2: task and a linear map of
    x_t) and the task subspace S of its centred task effects."""

    def __init__(self, run: "StudyRun", place: Place, sequences: Sequences, states: torch.Tensor, window: slice, n_random: int):
        self.run, self.place, self.sequences, self.states, self.window, self.n_random = run, place, sequences, states, window, n_random
        inputs = sequences.inputs
        self.fit: Fit = inputs.fit(states, sequences.batch.task, inputs.current, sequences.alpha.shape[-1], window)

    @property
    def task_vectors(self) -> torch.Tensor:
        """[K, D] theta_k, centred over the tasks (float64)."""
        return self.fit.subspace.theta

    @property
    def basis(self) -> torch.Tensor:
        """[D, K-1] orthonormal basis of the task subspace S (float64)."""
        return self.fit.subspace.basis

    @property
    def token_effects(self) -> torch.Tensor:
        """[V, D] nu(a) (E2: [d, D], the map A of x_t)."""
        return self.fit.nu

    @property
    def mu(self) -> torch.Tensor:
        """[P, D] the mean state per position over the major tasks (float64)."""
        return self.fit.subspace.mu

    @property
    def p0(self) -> float:
        """P0, stability: the cell-means R^2 of the late window (``fit.layout.within_share`` its complement)."""
        return self.fit.layout.cell_r2

    @property
    def p1(self) -> float:
        """P1, decoupling: the additive share of the between-cell variance."""
        return self.fit.layout.additive_share

    @cached_property
    def p2(self) -> Interpolation:
        """P2, interpolation: beta and R^2_task (beside ``n_random`` random subspaces, seeded by the run's seed)."""
        residual = self.fit.residual(self.states, self.sequences.inputs.current)
        return interpolation(residual, self.task_vectors, self.window, self.n_random, self.run.seed)

    @property
    def beta(self) -> torch.Tensor:
        """[N, P, K] fitted task coefficients on the simplex."""
        return self.p2.beta

    @cached_property
    def p3(self) -> Alignment:
        """P3, alignment of beta_t with the exact posterior alpha_t."""
        return Alignment.of(self.beta, self.sequences.alpha, self.window)

    def steer(self, to: torch.Tensor | Sequence[float] | Literal["dirichlet"] = "dirichlet",
              directions: Directions = "task_vectors") -> Steering:
        """Replace the task component of the late states of these sequences by a point ``to`` of
        the simplex ([K] for every sequence, [N, K] one per sequence, or ``"dirichlet"``: a
        Dirichlet(1) draw per sequence) and compare the model with the target mixture
        (PAPER.md section 4); ``directions``: the additive code from the task vectors or from a
        joint regression of h on [posterior, one-hot token]. Random draws come from the run's seed."""
        inputs, window, N, K = self.sequences.inputs, self.window, len(self.sequences), self.task_vectors.shape[0]
        gen = generator(self.run.seed, 0, "steering")
        a = dirichlet_points(N, K, gen) if isinstance(to, str) and to == "dirichlet" else simplex_point(to, N, K)
        if directions == "task_vectors":
            code = code_from_layout(self.fit.layout)
        elif directions == "regression":
            late, alpha = self.states[:, window], self.sequences.alpha[:, window]
            code = code_from_regression(late.reshape(-1, late.shape[-1]), alpha.reshape(-1, K),
                                        inputs.current[:, window].reshape(-1, *inputs.current.shape[2:]), inputs.vocab)
        else:
            raise AnalysisError(f"unknown directions {directions!r}; choose task_vectors or regression")
        return steer(self.run.model, inputs.readout, self.sequences.batch.tokens, inputs.current[:, window], self.place,
                     inputs.model_positions(window), window, self.basis, code, a, gen)

    def ablate(self) -> Edit:
        """The S ablation h <- h - P_S (h - mu_t) at this place on the analysed positions."""
        return Edit(self.run, self.place, task_ablation(self.fit.subspace), self.sequences.inputs.model_positions(slice(None)))

    def projection_r2(self, sequences: Sequences, form: Form = "token", states: torch.Tensor | None = None) -> torch.Tensor:
        """[N' * W] projection R^2 on S of the late states of other ``sequences`` (OOD ones, as a
        rule) at this place (``states``: [N', P, D] if already captured): centred by mu_t and
        regressed on the task vectors (``plain``), or centred by mu_t + nu(x_t) and regressed on
        theta_{k, x_t} (``token``; E2 and E1 give both forms alike). Its mean is the stored value."""
        if form not in ("token", "plain"):
            raise AnalysisError(f"unknown form {form!r}; choose token or plain")
        h = self.run.cache(sequences, [self.place])[self.place] if states is None else states
        subspace, window = self.fit.subspace, self.window
        late = sequences.inputs.current[:, window]
        centred = (h[:, window].double() - subspace.mu[window]).flatten(0, 1)  # [N' * W, D]
        if form == "plain":
            return projection_r2(centred, subspace.basis)
        return projection_r2(centred - self.fit.layout.effect(late).double().flatten(0, 1), subspace.conditioned_basis(late).flatten(0, 1))

    @cached_property
    def avoided(self) -> torch.Tensor:
        """[D, m] where the orthogonal search may not go: S and the token subspace (PAPER.md section 7)."""
        tokens = token_subspace(self.token_effects.float(), centre=not isinstance(self.run.family, Regression))
        return avoid_basis(self.basis.float(), tokens)


def simplex_point(to, n: int, K: int) -> torch.Tensor:
    """[n, K] float64 from a point [K] (for every sequence) or points [n, K] of the simplex; AnalysisError otherwise."""
    a = torch.as_tensor(to, dtype=torch.float64)
    if a.shape not in ((K,), (n, K)):
        raise AnalysisError(f"a steering target is a point of the simplex over the {K} major tasks, [{K}] or [{n}, {K}]; got shape {tuple(a.shape)}")
    if (a < 0).any() or ((a.sum(-1) - 1).abs() > 1e-6).any():
        raise AnalysisError("a steering target must be non-negative and sum to one (a point of the simplex)")
    return a.expand(n, K).clone()


@dataclass(frozen=True)
class Selection:
    """The place where the task-vector description fits best (highest R^2_task of P2), its
    runner-up (None when one place was measured) and the geometry at every measured place."""

    best: Place
    runner_up: Place | None
    geometries: list[Geometry]


class StudyRun:
    """A finished run opened for study (``tg.open_run``); ``directory`` is its ``runs.Run``."""

    def __init__(self, directory: Run, model: torch.nn.Module | None = None):
        if (reason := unsupported(directory.family)) is not None:
            raise AnalysisError(reason)
        self.directory = directory
        if model is not None:
            self.model = model
        self._edits: list[Edit] = []
        self._streams: weakref.WeakKeyDictionary[Sequences, LayerStreams] = weakref.WeakKeyDictionary()

    @cached_property
    def model(self) -> torch.nn.Module:
        """The finished model, in eval mode."""
        return self.directory.load_model()

    @property
    def path(self) -> Path:
        return self.directory.path

    @property
    def config(self):
        return self.directory.config

    @property
    def family(self):
        return self.directory.family

    @property
    def pool(self):
        return self.directory.pool

    @property
    def seed(self) -> int:
        return self.config.train.seed

    def places(self, sites: Sequence[str] | None = None, layers: Sequence[int] | None = None) -> list[Place]:
        """Every (layer, site) of ``layers`` (all) and ``sites`` (those of DEFAULT_SITES the model has), in layer order."""
        n_layers = self.config.model.n_layers
        layers = range(n_layers) if layers is None else layers
        sites = [s for s in DEFAULT_SITES if s in self.directory.sites] if sites is None else list(sites)
        bad = [layer for layer in layers if not 0 <= layer < n_layers]
        if bad:
            raise AnalysisError(f"layers {bad} do not exist; the model has layers 0..{n_layers - 1}")
        unknown = [s for s in sites if s not in self.directory.sites]
        if unknown:
            raise AnalysisError(f"unknown sites {unknown}; this model has {list(self.directory.sites)}")
        return [Place(layer, site) for layer in layers for site in sites]

    @property
    def analysed_positions(self) -> slice | torch.Tensor:
        """The model positions the analysis reads and edits: all (token families), E2's separators."""
        family = self.family
        if isinstance(family, Regression):
            return family.prediction_positions(family.n_examples(self.config.task.seq_len))
        return slice(None)

    def heldout(self, kind: Kind, n: int, *, split: Split | str) -> Sequences:
        """``n`` held-out ``kind`` sequences ("major", "minor", "ood") of the named ``split``
        (``heldout.Split``); the same arguments give the same sequences."""
        split = Split.of(split)
        return Sequences(self, kind, split, sample(self.family, self.pool, kind, n, split, self.config.task.seq_len, self.seed))

    def cache(self, sequences: Sequences, places: Sequence[tuple[int, str]]) -> dict[Place, torch.Tensor]:
        """{place: [N, P, D] float32} the states at the analysed positions, from one streamed pass
        (with the edits in force)."""
        return {Place(layer, site): sequences.inputs.select(h)
                for layer, states in stream_layers(self.model, sequences.batch.tokens, list(places)) for site, h in states.items()}

    def geometries(self, sequences: Sequences, places: Sequence[tuple[int, str]], *, window: float = 0.25,
                   n_random: int = 8) -> Iterator[Geometry]:
        """The geometry at each place, in layer order, from one streamed pass over the major
        ``sequences``; ``window``: the late fraction of positions; ``n_random``: P2's random subspaces."""
        if sequences.kind != "major":
            raise AnalysisError(f"a geometry is fitted on major sequences, not {sequences.kind}")
        late = late_window(sequences.inputs.current.shape[1], window)
        for layer, states in stream_layers(self.model, sequences.batch.tokens, list(places)):
            for site, h in states.items():
                yield Geometry(self, Place(layer, site), sequences, sequences.inputs.select(h), late, n_random)

    def geometry(self, sequences: Sequences, place: tuple[int, str], *, window: float = 0.25, n_random: int = 8) -> Geometry:
        """The geometry at one place (``geometries``)."""
        return next(self.geometries(sequences, [place], window=window, n_random=n_random))

    def select_place(self, sequences: Sequences, places: Sequence[tuple[int, str]] | None = None, *, site: str | None = None,
                     window: float = 0.25, n_random: int = 8) -> Selection:
        """The place of highest R^2_task on ``sequences`` among ``places`` (every layer and
        default site), restricted to the site name ``site`` when given (PAPER.md section 7)."""
        measured = list(self.geometries(sequences, places or self.places(), window=window, n_random=n_random))
        ranked = sorted((g for g in measured if (site is None or g.place.site == site) and math.isfinite(g.p2.r2_task)),
                        key=lambda g: -g.p2.r2_task)
        if not ranked:
            raise AnalysisError("no place has a finite R^2_task to select by")
        return Selection(ranked[0].place, ranked[1].place if len(ranked) > 1 else None, measured)

    def _streams_of(self, sequences: Sequences) -> LayerStreams:
        if sequences not in self._streams:
            self._streams[sequences] = LayerStreams(self.model, sequences.batch.tokens)
        return self._streams[sequences]

    def loss(self, sequences: Sequences, *, per_position: bool = False) -> float | torch.Tensor:
        """The model's loss on ``sequences`` (nats; E2: squared error) with the edits in force:
        per prediction, averaged over the sequences ([P - 1] for tokens), or (the default) L, the
        mean over every prediction after the first. Each batch's unedited streams are kept, so an
        edit runs the model from its block on only."""
        streams = self._streams_of(sequences)
        with torch.no_grad():
            if len(self._edits) > 1:
                model = self.model
            else:
                model = streams.model_from(self._edits[0].place if self._edits else None)
            losses = self.family.position_losses(model, sequences.batch, *sequences.references)["loss"].mean(0)
        return losses if per_position else float(losses[1:].mean())

    def ablate(self, directions: torch.Tensor, place: tuple[int, str]) -> Edit:
        """The ablation h <- h - V V^T h of orthonormal directions: [D, r] at ``place`` on the analysed positions."""
        return Edit(self, Place(*place), direction_ablation(directions), self.analysed_positions)

    def _search_loss(self):
        """loss_fn(step, site) of ``orthogonal_searches``: the training loss of batch ``step`` of
        the search stream (``BATCH_SIZE`` fresh OOD sequences) run from ``site`` on; searches in
        lockstep share each step's draw and prefix."""
        family, T, seed = self.family, self.config.task.seq_len, self.seed

        @functools.lru_cache(maxsize=1)
        def search_batch(step: int) -> tuple[Batch, LayerStreams]:
            batch = family.sample_ood(BATCH_SIZE, T, seed, step, SEARCH_STREAM)
            return batch, LayerStreams(self.model, batch.tokens)

        def search_loss(step: int, site) -> torch.Tensor:
            batch, streams = search_batch(step)
            return family.training_loss(streams.model_from(site), batch)

        return search_loss

    def orthogonal_search(self, searches: Sequence[tuple[Geometry, int]], *, steps: int = 200,
                          avoid: Callable[[Geometry], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """V: [D, r] for each ``(geometry, rank r)``: directions outside ``avoid(geometry)``
        (default ``Geometry.avoided``: S and the token subspace) whose ablation at the geometry's
        place raises the loss of fresh OOD sequences most (PAPER.md section 7's protocol); the
        searches run in lockstep, each giving what it would alone."""
        avoid = avoid or (lambda geometry: geometry.avoided)
        results = orthogonal_searches(self.model, self._search_loss(), [(g.place, avoid(g), rank) for g, rank in searches],
                                      steps=steps, seed=self.seed, positions=self.analysed_positions)
        return [result.directions for result in results]

    def snapshots(self) -> dict[int, "StudyRun"]:
        """{step: this run with the weights kept at that training step}, in step order."""
        return {step: StudyRun(self.directory, model) for step, model in self.directory.snapshots().items()}


def open_run(path: Path | str, recipe: str | None = None, profile: str = "quick", overrides: Sequence[str] = (),
             out: Path | str | None = None) -> StudyRun:
    """A finished run directory for study; with ``recipe``, a Hugging Face model directory read as
    a model of that recipe's task (``hf.open_pretrained``: profile, dotted overrides, ``out`` for
    what the analyses write)."""
    if recipe is None:
        return StudyRun(Run.open(path))
    from taskgeom.hf import open_pretrained

    return StudyRun(open_pretrained(path, recipe, profile, list(overrides), out))

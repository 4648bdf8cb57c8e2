"""The researcher's objects (``import taskgeom as tg``): a run, its held-out sequences
(``analysis.reading.sequences``), a place, the geometry there (``analysis.geometry``) and the edits
made there (``analysis.reading.edits``); the verbs are their methods, the options keywords.

- ``StudyRun`` (``tg.open_run(path)``): the model, family, pool and config of a finished run;
  ``heldout`` sequences of a named ``Split`` (``heldout_tasks``: whole tasks); ``cache`` states at
  places; ``forced_cells``, the study's forced-token cells of P0 and P1, and ``cell_p2``, P2 on them; ``trajectories``, P3 as the study's figure computes it; ``geometry`` there; ``select_place``; ``loss`` (under any edit whose ``with`` block is
  open); ``ablate`` directions; ``orthogonal_search``; ``projection_r2`` as the study's Fig. 4
  measures it and its ``projection_reference`` (``analysis.reading.projection``); ``snapshots`` (the run
  at each kept training step).
- ``Sequences``: one held-out batch with what the analysis reads of it (``inputs``, the exact
  posterior ``alpha``, the Bayes ``references`` of its losses).
- ``Place``: ``(layer, site)``, a named tuple that every hook accepts.
- ``Geometry``: the M1 geometry at a place (docs/concepts.md#m1-the-geometry-of-task-retrieval): task vectors, the basis of S,
  token effects, P0-P3 and beta; ``steer`` toward a point of the simplex, ``ablate`` S,
  ``projection_r2`` of other states (docs/concepts.md#m2-the-nearly-orthogonal-subspace).
- ``Edit``: a change of the states at one place, in force while its ``with`` block runs.

The stored analyses (``m1.json``, ``dual.json``) are written with these objects
(``analysis.stored.m1``, ``analysis.stored.dual``), so a stored number is what the API returns.

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
from typing import Callable, Iterator, Sequence

import torch

from taskgeom.analysis.geometry import AdditiveR2, Geometry, ProbeInputs, cell_p2, probe_inputs
from taskgeom.analysis.measures.orthogonal import SearchResult, orthogonal_searches
from taskgeom.analysis.measures.shares import loss_window
from taskgeom.analysis.measures.subspace import direction_ablation
from taskgeom.analysis.measures.task_vectors import fraction_window, late_window
from taskgeom.analysis.protocol import Protocol, active
from taskgeom.analysis.reading import projection, trajectory
from taskgeom.analysis.reading.cells import (
    P2_STREAM,
    STREAM,
    ForcedCells,
    forced_cells,
    seen_tokens,
)
from taskgeom.analysis.reading.edits import Edit
from taskgeom.analysis.reading.heldout import Kind, Split, sample, sample_tasks, unsupported
from taskgeom.analysis.reading.heldout import stream as heldout_stream
from taskgeom.analysis.reading.projection import ProjectionR2
from taskgeom.analysis.reading.sequences import Sequences
from taskgeom.analysis.reading.states import LayerStreams, stream_layers
from taskgeom.analysis.reading.trajectory import Trajectory
from taskgeom.errors import AnalysisError, RunDirError
from taskgeom.hooks import Place
from taskgeom.runs.folders import Run
from taskgeom.settings.config import RunConfig
from taskgeom.settings.recipes import DEFAULT_PROFILE
from taskgeom.tasks import Batch, TaskFamily, TaskPool
from taskgeom.tasks.base import TaskProbe

SEARCH_STREAMS = {
    "minor": "dual-minor-search",
    "ood": "dual-ood-search",
    "eval-ood": "dual-eval-ood-search",
}  # the orthogonal search's fresh batch of each step


@dataclass(frozen=True)
class Selection:
    """The place where the task-vector description fits best (highest R^2_task of P2), its
    runner-up (None when one place was measured) and the geometry at every measured place."""

    best: Place
    runner_up: Place | None
    geometries: list[Geometry]

    def __repr__(self) -> str:
        return f"Selection(best {self.best}, runner-up {self.runner_up}, {len(self.geometries)} places measured)"


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
        self._probe_inputs: dict[tuple[int, TaskProbe], ProbeInputs] = {}

    @cached_property
    def model(self) -> torch.nn.Module:
        """The finished model, in eval mode."""
        return self.directory.load_model()

    @property
    def path(self) -> Path:
        """The run directory (where ``analysis/`` and ``figures/`` are written)."""
        return self.directory.path

    @property
    def config(self) -> RunConfig:
        """The run's validated config."""
        return self.directory.config

    @property
    def family(self) -> TaskFamily:
        """The latent-task family the model was trained on."""
        return self.directory.family

    @property
    def pool(self) -> TaskPool:
        """The task pool of training: the major tasks, then the minor ones."""
        return self.directory.pool

    @property
    def seed(self) -> int:
        """The training seed: every held-out split and every random draw of the analysis derives from it."""
        return self.config.train.seed

    def places(self, sites: Sequence[str] | None = None, layers: Sequence[int] | None = None) -> list[Place]:
        """Every (layer, site) of ``layers`` (all) and ``sites`` (those of the protocol's ``sites`` the
        model has), in layer order."""
        n_layers = self.config.model.n_layers
        layers = range(n_layers) if layers is None else layers
        sites = [s for s in active().sites if s in self.directory.sites] if sites is None else list(sites)
        bad = [layer for layer in layers if not 0 <= layer < n_layers]
        if bad:
            raise AnalysisError(f"layers {bad} do not exist; the model has layers 0..{n_layers - 1}")
        unknown = [s for s in sites if s not in self.directory.sites]
        if unknown:
            raise AnalysisError(f"unknown sites {unknown}; this model has {list(self.directory.sites)}")
        return [Place(layer, site) for layer in layers for site in sites]

    @property
    def analysed_positions(self) -> slice | torch.Tensor:
        """The model positions the analysis reads and edits (the family's ``analysed_positions``): all
        (token families), E2's x tokens."""
        return self.family.analysed_positions(self.config.task.seq_len)

    def heldout(self, kind: Kind, n: int, *, split: Split | str) -> Sequences:
        """``n`` held-out ``kind`` sequences ("major", "minor" or "ood") of the named ``split``
        (``heldout.Split``); the same arguments give the same sequences."""
        split = Split.of(split)
        return Sequences(
            self, kind, split, sample(self.family, self.pool, kind, n, split, self.config.task.seq_len, self.seed)
        )

    def heldout_tasks(
        self, kind: Kind, per_task: int, *, n_tasks: int | None = None, split: Split | str = "projection"
    ) -> Sequences:
        """Whole held-out tasks of ``split``, ``per_task`` sequences each (``analysis.reading.heldout.sample_tasks``):
        ``n_tasks`` fresh OOD tasks, or every major task; the same arguments give the same sequences."""
        batch = sample_tasks(
            self.family, self.pool, kind, per_task, split, self.config.task.seq_len, self.seed, n_tasks
        )
        return Sequences(self, kind, Split.of(split), batch)

    def projection_r2(
        self,
        ood: Sequences,
        major: Sequences,
        place: tuple[int, str] | None = None,
        *,
        protocol: Protocol | None = None,
    ) -> ProjectionR2:
        """Projection R^2 of the OOD tasks of ``ood`` on the major tasks of ``major`` as the study's
        Fig. 4 measures it (``analysis.reading.projection``; whole tasks from ``heldout_tasks``) at ``place``
        (default: the protocol's, ``analysis.reading.projection.place``); or under another ``protocol``
        (a variant's, docs/protocol.md#variants): ``projection="per-sequence"`` (each OOD state of the
        late window, centred by mu_t + nu(x_t) and regressed on theta_(k, x_t), with the geometry
        fitted on ``major`` at the place), ``read_site`` (the same block at that site) or
        ``place="selected"`` (the place of best R^2_task on the ``select`` split); None: the active one."""
        protocol = active() if protocol is None else protocol
        at = projection.place(self.family, self.config.model.n_layers) if place is None else Place(*place)
        if protocol.read_site is not None:
            at = Place(at.layer, protocol.read_site)
        if protocol.place == "selected":
            at = self.select_place(self.selection_batch(), n_random=0).best
        if protocol.projection == "per-sequence":
            values = self.geometry(major, at, n_random=0).projection_r2(ood, "token")
            return ProjectionR2(values, *projection.task_sizes(ood.batch), at, "per-sequence")
        return projection.measure(self, ood, major, [at])[at]

    def projection_reference(self, ood: Sequences, major: Sequences) -> ProjectionR2:
        """The linear-code reference beside projection R^2: the same statistic on the OOD-optimal
        learner's estimate of the task (``TaskFamily.ood_estimate``) of the same sequences;
        AnalysisError naming why for a family without one."""
        return projection.reference(self.family, ood.batch, major.batch)

    @property
    def probe_inputs(self) -> ProbeInputs:
        """The ablations' probe sequences and their regressors (``analysis.geometry.probe_inputs``),
        collected once for every place at each size the active protocol's ``probe_sequences`` asks."""
        return self._probe_inputs_of(self.family.task_probe)

    @property
    def search_probe_inputs(self) -> ProbeInputs:
        """The same for the family's search probe (``TaskFamily.search_probe``; docs/protocol.md, the V search)."""
        return self._probe_inputs_of(self.family.search_probe or self.family.task_probe)

    def _probe_inputs_of(self, spec: TaskProbe) -> ProbeInputs:
        key = (active().probe_sequences, spec)
        if key not in self._probe_inputs:
            self._probe_inputs[key] = probe_inputs(self, spec)
        return self._probe_inputs[key]

    def forced_cells(
        self,
        places: Sequence[tuple[int, str]],
        *,
        position: int | None = None,
        per_cell: int | None = None,
        stream: str = STREAM,
        tokens: torch.Tensor | None = None,
    ) -> ForcedCells:
        """The study's forced-token cells of the major tasks at ``position`` (default: the last its
        P0 and P1 read, T - 2), ``per_cell`` sequences each, their states at ``places``
        (``analysis.reading.cells``; a token family's); ``.layout(place)`` gives P0 and P1 there.
        ``stream``: the random stream of the draws; ``tokens``: the values forced (default: those seen there);
        ``per_cell``: the protocol's ``cell_sequences`` when None."""
        per_cell = active().cell_sequences if per_cell is None else per_cell
        T = self.config.task.seq_len
        position = T - 2 if position is None else position
        if not 0 <= position < T:
            raise AnalysisError(f"position {position} is not in the context (0..{T - 1})")
        return forced_cells(
            self.model,
            self.family,
            self.pool.subset("major"),
            self.seed,
            position,
            per_cell,
            [Place(*p) for p in places],
            stream,
            tokens,
        )

    def cell_p2(
        self, places: Sequence[tuple[int, str]], *, per_cell: int | None = None, n_random: int = 8
    ) -> dict[Place, AdditiveR2]:
        """{place: P2 as the study's averaging R^2 measures it} on forced-token cells of ``per_cell``
        sequences (the protocol's ``p2_cell_sequences`` when None; ``analysis.geometry.cell_p2``), drawn
        at every position of the family's ``vector_window`` and ``p2_window``; the values forced at every
        position are those seen at any of them (the study assumes each position sees them all)."""
        per_cell = active().p2_cell_sequences if per_cell is None else per_cell
        T, family, majors = self.config.task.seq_len, self.family, self.pool.subset("major")
        windows = [fraction_window(T, family.vector_window), fraction_window(T, family.p2_window)]
        positions = sorted({p for w in windows for p in range(w.start, w.stop)})
        tokens = torch.unique(
            torch.cat([seen_tokens(family, majors, self.seed, p, per_cell, P2_STREAM) for p in positions])
        )
        cells = {
            p: self.forced_cells(places, position=p, per_cell=per_cell, stream=P2_STREAM, tokens=tokens)
            for p in positions
        }
        return {Place(*place): cell_p2(self, cells, Place(*place), n_random) for place in places}

    def trajectories(
        self, places: Sequence[tuple[int, str]], *, per_task: int | None = None
    ) -> dict[Place, Trajectory]:
        """{place: P3 as the study's trajectory figure computes it} (``analysis.reading.trajectory``)
        on ``per_task`` natural sequences of each major task (the protocol's ``trajectory_per_task``
        when None; split ``trajectory``), one streamed pass."""
        per_task = active().trajectory_per_task if per_task is None else per_task
        sequences = self.heldout_tasks("major", per_task, split="trajectory")
        return {
            Place(layer, site): trajectory.trajectory(sequences.inputs.select(h), sequences.batch.task, sequences.alpha)
            for layer, states in stream_layers(self.model, sequences.batch.tokens, list(places))
            for site, h in states.items()
        }

    def cache(self, sequences: Sequences, places: Sequence[tuple[int, str]]) -> dict[Place, torch.Tensor]:
        """{place: [N, P, D] float32} the states at the analysed positions, from one streamed pass
        (with the edits in force)."""
        return {
            Place(layer, site): sequences.inputs.select(h)
            for layer, states in stream_layers(self.model, sequences.batch.tokens, list(places))
            for site, h in states.items()
        }

    def geometries(
        self, sequences: Sequences, places: Sequence[tuple[int, str]], *, window: float = 0.25, n_random: int = 8
    ) -> Iterator[Geometry]:
        """The geometry at each place, in layer order, from one streamed pass over the major
        ``sequences``; ``window``: the late fraction of positions where P0-P3 are read (the task
        vectors average the family's ``vector_window``); ``n_random``: P2's random subspaces."""
        if sequences.kind != "major":
            raise AnalysisError(f"a geometry is fitted on major sequences, not {sequences.kind}")
        late = late_window(sequences.inputs.current.shape[1], window)
        for layer, states in stream_layers(self.model, sequences.batch.tokens, list(places)):
            for site, h in states.items():
                yield Geometry(self, Place(layer, site), sequences, sequences.inputs.select(h), late, n_random)

    def geometry(
        self, sequences: Sequences, place: tuple[int, str], *, window: float = 0.25, n_random: int = 8
    ) -> Geometry:
        """The geometry at one place (``geometries``)."""
        return next(self.geometries(sequences, [place], window=window, n_random=n_random))

    def select_place(
        self,
        sequences: Sequences,
        places: Sequence[tuple[int, str]] | None = None,
        *,
        site: str | None = None,
        window: float = 0.25,
        n_random: int = 8,
    ) -> Selection:
        """The place of highest R^2_task on ``sequences`` among ``places`` (every layer and
        default site), restricted to the site name ``site`` when given (docs/protocol.md)."""
        measured = list(self.geometries(sequences, places or self.places(), window=window, n_random=n_random))
        ranked = sorted(
            (g for g in measured if (site is None or g.place.site == site) and math.isfinite(g.p2.r2_task)),
            key=lambda g: -g.p2.r2_task,
        )
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
        mean over the family's ``loss_window`` (E1 every prediction, E3 every one after the first).
        Each batch's unedited streams are kept, so an edit runs the model from its block on only."""
        streams = self._streams_of(sequences)
        with torch.no_grad():
            if len(self._edits) > 1:
                model = self.model
            else:
                model = streams.model_from(self._edits[0].place if self._edits else None)
            losses = self.family.position_losses(model, sequences.batch, *sequences.references)["loss"].mean(0)
        return losses if per_position else float(losses[loss_window(self.family)].mean())

    def ablate(self, directions: torch.Tensor, place: tuple[int, str]) -> Edit:
        """The ablation h <- h - V V^T h of orthonormal directions: [D, r] at ``place`` on the analysed positions."""
        return Edit(self, Place(*place), direction_ablation(directions), self.analysed_positions)

    def search_set(self, protocol: Protocol | None = None) -> str:
        """The sequences the orthogonal search ascends on (docs/protocol.md): ``protocol.v_search_set``'s
        (the active protocol's when None): the evaluation set's OOD tasks ("eval-ood", at every k: the
        study's); minor (pool) sequences, OOD ones when the pool has no minors (k = -1); or fresh OOD
        tasks ("ood")."""
        chosen = (active() if protocol is None else protocol).v_search_set
        return "ood" if chosen == "minor" and not self.pool.n_minor else chosen

    def selection_batch(self) -> Sequences:
        """The M1 and dual analyses' selection batch (the protocol's ``selection_sequences`` major
        sequences, split ``select``): the selected-place variant chooses where it does."""
        return self.heldout("major", active().selection_sequences, split="select")

    def _search_loss(self, kind: str, protocol: Protocol):
        """loss_fn(step, site) of ``orthogonal_searches``: the training loss of batch ``step`` of
        the search stream of ``kind`` (the protocol's ``search_batch`` fresh minor sequences, OOD ones of
        fresh tasks, or of the evaluation set's ``loss_ood_tasks`` OOD tasks, each uniform among them) run
        from ``site`` on; searches in lockstep share each step's draw and prefix."""
        family, T, seed, stream = self.family, self.config.task.seq_len, self.seed, SEARCH_STREAMS[kind]
        size = protocol.search_batch
        if kind == "eval-ood":  # the tasks the evaluation set's OOD sequences are drawn from
            evaluated = family.ood_task_params(protocol.loss_ood_tasks, seed, 0, heldout_stream("loss", "ood"))

        @functools.lru_cache(maxsize=1)
        def search_batch(step: int) -> tuple[Batch, LayerStreams]:
            if kind == "eval-ood":
                batch = family.sample_among(evaluated, size, T, seed, step, stream)
            elif kind == "ood":
                batch = family.sample_ood(size, T, seed, step, stream)
            else:
                batch = family.sample(self.pool, size, T, seed, step, stream, "minor")
            return batch, LayerStreams(self.model, batch.tokens)

        def search_loss(step: int, site) -> torch.Tensor:
            batch, streams = search_batch(step)
            return family.training_loss(streams.model_from(site), batch)

        return search_loss

    def orthogonal_search(
        self,
        searches: Sequence[tuple[Geometry, int]],
        *,
        steps: int | None = None,
        protocol: Protocol | None = None,
        avoid: Callable[[Geometry], torch.Tensor] | None = None,
    ) -> list[SearchResult]:
        """V (``SearchResult.directions``: [D, r], with the steps run and the best step) for each
        ``(geometry, rank r)``: directions outside ``geometry.avoid(protocol)``
        (the study's: the probe's S, and the token subspace for E3; or ``avoid(geometry)`` when
        given) whose ablation at the geometry's place raises the loss of fresh sequences of
        ``search_set(protocol)`` most (docs/protocol.md); the searches run in lockstep, each giving
        what it would alone; ``steps``: the protocol's ``search_steps`` when None; ``protocol``: the
        active one when None."""
        protocol = active() if protocol is None else protocol
        steps = protocol.search_steps if steps is None else steps
        avoid = avoid or (lambda geometry: geometry.avoid(protocol))
        return orthogonal_searches(
            self.model,
            self._search_loss(self.search_set(protocol), protocol),
            [(g.place, avoid(g), rank) for g, rank in searches],
            steps=steps,
            seed=self.seed,
            positions=self.analysed_positions,
        )

    def snapshots(self) -> dict[int, "StudyRun"]:
        """{step: this run with the weights kept at that training step}, in step order."""
        return {step: StudyRun(self.directory, model) for step, model in self.directory.snapshots().items()}


def open_run(
    path: Path | str,
    recipe: str | None = None,
    profile: str = DEFAULT_PROFILE,
    overrides: Sequence[str] = (),
    out: Path | str | None = None,
) -> StudyRun:
    """A finished run directory for study; or a Hugging Face model directory (a ``config.json``
    without taskgeom's ``run.json``) read as a model of ``recipe``'s task (``models.pretrained.open_pretrained``:
    profile, dotted overrides, ``out`` for what the analyses write). A run directory has its own
    config: ``recipe``, ``overrides`` or ``out`` with one is a RunDirError."""
    path = Path(path)
    if (path / "run.json").is_file() or (recipe is None and not (path / "config.json").is_file()):
        if recipe or overrides or out:
            raise RunDirError(
                f"{path} is a taskgeom run directory, which has its own config: analyse it without --recipe, --set and --out"
            )
        return StudyRun(Run.open(path))
    from taskgeom.models.pretrained import open_pretrained

    return StudyRun(open_pretrained(path, recipe, profile, list(overrides), out))

"""The M1 geometry at one place (docs/concepts.md#m1-the-geometry-of-task-retrieval), as a researcher uses it: task vectors, the
basis of the task subspace S, token effects, P0-P3 and beta, and the verbs that read or edit
the model there: ``steer`` toward a point of the simplex, ``ablate`` S (docs/concepts.md#m2-the-nearly-orthogonal-subspace), and
``projection_r2`` of other states on S.

Shapes: ``N`` sequences, ``P`` analysed positions (every position; E2: its separators), ``D``
width, ``K`` major tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Literal, Sequence

import torch

from taskgeom.analysis.measures.anova import Layout, Shares
from taskgeom.analysis.measures.orthogonal import avoid_basis, token_subspace
from taskgeom.analysis.measures.properties import (
    Fit,
    Interpolation,
    MeanAlignment,
    Shrinkage,
    additive_r2,
    alignment,
    by_position,
    cell_additive_r2,
    cell_vectors,
    fit_beta,
    interpolation,
    mean_alignment,
    pooled,
    quantiles,
    random_rotation,
    random_token_additive_r2,
    shrinkage,
    token_additive_r2,
)
from taskgeom.analysis.measures.simplex import project_simplex
from taskgeom.analysis.measures.subspace import direction_ablation, projection_r2, task_ablation
from taskgeom.analysis.measures.task_probe import (
    PROBE_CHUNK,
    ProbeData,
    ProbeFit,
    fit_probe,
    probe_basis_with_mean,
)
from taskgeom.analysis.measures.task_vectors import fraction_window
from taskgeom.analysis.protocol import Protocol, active
from taskgeom.analysis.reading.cells import ForcedCells
from taskgeom.analysis.reading.edits import Edit
from taskgeom.analysis.reading.heldout import family_inputs
from taskgeom.analysis.reading.sequences import Sequences, StudiedRun
from taskgeom.analysis.reading.steering import (
    Steering,
    SteeringForm,
    averaged_task_vectors,
    check_form,
    clip_positions,
    dirichlet_points,
    estimation_positions,
    position_task_vectors,
    span_basis,
    steer,
    study_form,
    study_positions,
    subspace_edit,
    task_edit,
)
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.rng import generator
from taskgeom.tasks.base import TaskProbe

Form = Literal["token", "plain"]


@dataclass(frozen=True)
class Alignment:
    """P3 at a place: tv, kl: [N, P] per-state distances between beta_t and the posterior alpha_t
    (total variation, KL(alpha || beta)), written as rows; mean: the claim's per-task mean curves
    (docs/protocol.md); shrinkage: P3.shrinks' parts, on the mean curves; window: the late
    positions (the last quarter)."""

    tv: torch.Tensor
    kl: torch.Tensor
    mean: MeanAlignment
    shrinkage: Shrinkage
    window: slice

    def __repr__(self) -> str:
        return f"Alignment(P3 {self.tv_mean_beta:.4g}: TV of the task-mean beta to the posterior, last quarter; {tuple(self.tv.shape)} states)"

    @classmethod
    def of(
        cls, beta: torch.Tensor, raw: torch.Tensor, alpha: torch.Tensor, task: torch.Tensor, window: slice
    ) -> "Alignment":
        """P3 of fitted coefficients beta (projected) and raw (before the projection) and the
        posterior alpha: [N, P, K], for sequences of task: [N]."""
        tv, kl = alignment(beta, alpha)
        mean = mean_alignment(raw, alpha, task, alpha.shape[-1])
        return cls(tv, kl, mean, shrinkage(mean.tv, mean.alpha), window)

    @property
    def tv_mean_beta(self) -> float:
        """What the P3 claim reads: the TV of the task-mean curves, averaged over the tasks and the
        last quarter of positions."""
        return float(self.mean.tv[:, self.window].mean())

    def quarter(self, metric: Literal["tv", "kl"], part: Literal["first", "last"]) -> tuple[float, float, float]:
        """(median, lower, upper quartile) of ``metric`` over every state of the first or last quarter of positions."""
        values = getattr(self, metric)
        span = self.window if part == "last" else slice(0, values.shape[1] - self.window.start)
        return tuple(float(q) for q in quantiles(values[:, span].reshape(-1)))

    @property
    def tv_last_quarter(self) -> float:
        """The median per-state TV over the last quarter of positions (a row; the claim reads ``tv_mean_beta``)."""
        return self.quarter("tv", "last")[0]


@dataclass(frozen=True)
class AdditiveR2:
    """P2 as the study's figure plots it (``Geometry.p2_additive``): by_position: [P] r2_additive at
    each analysed position; value: its mean over ``positions`` (the family's ``p2_window``), what the
    claim reads; random: [n_random] that mean with the task vertices rotated at random;
    post_layernorm: whether the states passed the next block's LayerNorm first."""

    by_position: torch.Tensor
    value: float
    random: torch.Tensor
    positions: slice
    post_layernorm: bool


def p2_norm(run: StudiedRun, place: Place) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How P2 reads states [..., D] at ``place`` when the family says so (E3's ``p2_post_layernorm``):
    through the next block's input LayerNorm, where one follows; None: as they are."""
    model = run.model
    if not (run.family.p2_post_layernorm and place.site == "resid_post" and place.layer + 1 < len(model.blocks)):
        return None
    norm = getattr(model.blocks[place.layer + 1], "ln_attn", None)
    if norm is None:
        raise AnalysisError(
            f"{type(model).__name__} has no input LayerNorm on block {place.layer + 1} to read P2 after"
        )
    dtype = next(model.parameters()).dtype

    def normed(states: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return norm(states.to(dtype))

    return normed


def cell_p2(run: StudiedRun, cells: dict[int, ForcedCells], place: Place, n_random: int) -> AdditiveR2:
    """P2 as the study's averaging R^2 measures it on forced-token cells (docs/protocol.md, "P2"):
    theta and nu from the cells at the family's ``vector_window`` (``cell_vectors``), r2_additive
    (``cell_additive_r2``) at each position of its ``p2_window``, whose mean the claim reads, beside
    the same on ``n_random`` randomly rotated task vertices (seeded by the run's seed); E3's states
    after the next LayerNorm (``p2_norm``). cells: {position: ForcedCells} over both windows."""
    T, norm = run.config.task.seq_len, p2_norm(run, place)
    estimation, window = fraction_window(T, run.family.vector_window), fraction_window(T, run.family.p2_window)
    states = {
        p: cells[p].states[place] for p in range(min(estimation.start, window.start), max(estimation.stop, window.stop))
    }
    if norm is not None:
        states = {p: norm(h) for p, h in states.items()}
    theta, nu = cell_vectors(
        torch.stack([states[p].double().mean(2) for p in range(estimation.start, estimation.stop)])
    )
    by_position = torch.full((T,), torch.nan, dtype=torch.float64)
    for p in range(window.start, window.stop):
        by_position[p] = cell_additive_r2(states[p], theta, nu)
    gen = torch.Generator().manual_seed(run.seed)
    rotations = [theta @ random_rotation(theta.shape[1], gen) for _ in range(n_random)]
    random = torch.tensor(
        [
            sum(cell_additive_r2(states[p], r, nu) for p in range(window.start, window.stop))
            / (window.stop - window.start)
            for r in rotations
        ],
        dtype=torch.float64,
    )
    return AdditiveR2(by_position, float(by_position[window].mean()), random, window, norm is not None)


class Geometry:
    """The M1 geometry at ``place`` fitted on the major ``sequences`` (states: [N, P, D] there):
    the two-way layout over (task, current token) pooled over the task vectors' window
    ``vectors`` (the family's ``vector_window``; E2: task and a linear map of x_t) and the task
    subspace S of its centred task effects; ``window`` is the late window (the last quarter)
    where the claims read P0-P3."""

    def __init__(
        self, run: StudiedRun, place: Place, sequences: Sequences, states: torch.Tensor, window: slice, n_random: int
    ):
        self.run, self.place, self.sequences, self.states, self.window, self.n_random = (
            run,
            place,
            sequences,
            states,
            window,
            n_random,
        )
        inputs = sequences.inputs
        self.vectors = fraction_window(states.shape[1], run.family.vector_window)
        self.fit: Fit = inputs.fit(
            states, sequences.batch.task, inputs.current, sequences.alpha.shape[-1], self.vectors
        )

    def __repr__(self) -> str:
        K, D = self.task_vectors.shape
        return (
            f"Geometry(at {self.place}, {self.states.shape[0]} {self.sequences.kind} sequences of {self.states.shape[1]} "
            f"positions, K={K} tasks, D={D}; P0-P3 in .p0, .p1, .p2, .p3)"
        )

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

    @cached_property
    def shares(self) -> Shares:
        """P0 and P1 at each position: [P] each (the layout fitted at each position separately)."""
        inputs = self.sequences.inputs
        return by_position(
            self.states, self.sequences.batch.task, inputs.current, self.sequences.alpha.shape[-1], inputs.vocab
        )

    @property
    def p0(self) -> float:
        """P0, stability: the median over the late window of the per-position cell-means R^2."""
        return float(quantiles(self.shares.cell_r2[self.window])[0])

    @property
    def p1(self) -> float:
        """P1, decoupling: the median over the late window of the per-position additive share."""
        return float(quantiles(self.shares.additive_share[self.window])[0])

    @property
    def p1_last(self) -> float:
        """P1 at the last position (the study's table)."""
        return float(self.shares.additive_share[-1])

    @cached_property
    def pooled(self) -> Layout:
        """The ``pooled-anova`` variant: the layout pooled over the late window's states (no position term)."""
        inputs = self.sequences.inputs
        return pooled(
            self.states,
            self.sequences.batch.task,
            inputs.current,
            self.sequences.alpha.shape[-1],
            inputs.vocab,
            self.window,
        )

    @cached_property
    def p2(self) -> Interpolation:
        """P2, interpolation: beta and R^2_task (beside ``n_random`` random subspaces, seeded by the run's seed)."""
        residual = self.fit.residual(self.states, self.sequences.inputs.current)
        return interpolation(residual, self.task_vectors, self.window, self.n_random, self.run.seed)

    @cached_property
    def p2_additive(self) -> AdditiveR2:
        """P2 as the study's figure plots it (docs/protocol.md, "P2"): r2_additive at each analysed
        position, its mean over the family's ``p2_window`` (what the claim reads) and the same on
        ``n_random`` randomly rotated task vertices. Token families (``token_additive_r2``): the share
        of the variance of h_t about its per-position mean that nu(x_t) and the task simplex explain,
        on the states after the next block's LayerNorm for a family that says so (E3's
        ``p2_post_layernorm``; nothing follows the last block); E2 (``additive_r2``): the task
        simplex fitted to h - mu_t (x_t's effect left in, as the study's ``task_subspace_r2_at_position``),
        then a per-position linear map of x_t fitted to what it leaves."""
        family, inputs = self.run.family, self.sequences.inputs
        geometry, norm = self, p2_norm(self.run, self.place)
        if norm is not None:
            geometry = Geometry(self.run, self.place, self.sequences, norm(self.states), self.window, self.n_random)
        positions = fraction_window(self.states.shape[1], family.p2_window)
        h, theta, gen = geometry.states, geometry.task_vectors, torch.Generator().manual_seed(self.run.seed)
        y = geometry.fit.residual(h, inputs.current)
        if inputs.vocab is not None:
            by_position = token_additive_r2(h, y, project_simplex(geometry.p2.raw) @ theta)
            random = random_token_additive_r2(h, y, theta, positions, self.n_random, self.run.seed)
        else:  # the study's order: the task simplex fitted to h - mu_t as it is, then x_t's map to what it leaves
            centred = h.double() - geometry.mu[: h.shape[1]]
            by_position = additive_r2(centred, fit_beta(centred, theta) @ theta, inputs.current, positions)[1]
            rotations = [theta @ random_rotation(theta.shape[1], gen) for _ in range(self.n_random)]
            random = torch.tensor(
                [
                    float(
                        additive_r2(centred, fit_beta(centred, r) @ r, inputs.current, positions)[1][
                            positions
                        ].nanmean()
                    )
                    for r in rotations
                ],
                dtype=torch.float64,
            )
        return AdditiveR2(by_position, float(by_position[positions].nanmean()), random, positions, norm is not None)

    @property
    def beta(self) -> torch.Tensor:
        """[N, P, K] fitted task coefficients on the simplex."""
        return self.p2.beta

    @cached_property
    def p3(self) -> Alignment:
        """P3, alignment of beta_t with the exact posterior alpha_t (per state, and per task mean)."""
        return Alignment.of(self.beta, self.p2.raw, self.sequences.alpha, self.sequences.batch.task, self.window)

    def steer(
        self,
        to: torch.Tensor | Sequence[float] | Literal["dirichlet"] = "dirichlet",
        *,
        points: int = 1,
        positions: Sequence[int] | None = None,
        form: SteeringForm | None = None,
        sequences: Sequences | None = None,
        protocol: Protocol | None = None,
    ) -> Steering:
        """Steer major sequences toward points of the simplex, one position per forward pass
        (docs/protocol.md; ``analysis.reading.steering``): ``to`` a point [K] for every sequence,
        [N, K] one per sequence, or ``"dirichlet"``: ``points`` Dirichlet(1) draws per sequence,
        independent of its true task (the stored analysis, one each); ``positions``: the analysed
        positions to edit (default the study's, E1 25-39, E2 and E3 0-39), clipped to the context;
        ``form``: the edit (default the study's for this family: ``"task"``, per-position task
        vectors, for E1; ``"subspace"`` for the others); ``sequences``: the major sequences steered
        (default these). Under the protocol the vectors are estimated, as the study's injection
        estimates them, from natural states at this place of ``steering_estimation_per_task`` sequences
        of each major task (split ``steering``), and the edit is written at ``resid_mid`` of this block
        (``protocol``: the active one when None);
        a ``protocol`` with ``steering_vectors="read-place"`` (the variant ``steer-at-read-site``): the
        earlier construction, the vectors from these sequences' two-way layout, written at this place.
        Random draws come from the run's seed."""
        protocol = active() if protocol is None else protocol
        form = study_form(self.run.family) if form is None else form
        check_form(form)
        estimated = protocol.steering_vectors == "estimated"
        steered = self.sequences if sequences is None else sequences
        if steered.kind != "major":
            raise AnalysisError(f"steering edits major sequences, not {steered.kind} ones")
        if points < 1 or (points != 1 and not (isinstance(to, str) and to == "dirichlet")):
            raise AnalysisError(
                f"points (target points per sequence) must be at least 1, and 1 for a chosen point; got {points}"
            )
        N, P, K = len(steered), self.states.shape[1], self.task_vectors.shape[0]
        gen = generator(self.run.seed, 0, "steering")
        if isinstance(to, str) and to == "dirichlet":
            a = dirichlet_points(N * points, K, gen)
        else:
            a = simplex_point(to, N, K)
        sequence = torch.arange(N).repeat_interleave(points)
        positions = clip_positions(study_positions(form, protocol) if positions is None else positions, P)
        if estimated:
            estimation = self.run.heldout_tasks("major", protocol.steering_estimation_per_task, split="steering")
            states, task, write = (
                self.run.cache(estimation, [self.place])[self.place],
                estimation.batch.task,
                Place(self.place.layer, protocol.steering_write_site),
            )
        else:
            states, task, write = self.states, self.sequences.batch.task, self.place
        if form == "task":
            theta = position_task_vectors(states[:, list(positions)], task, K)  # [K, P', D]
            edits = {p: task_edit(theta[:, i], steered.batch.task[sequence], a) for i, p in enumerate(positions)}
        elif estimated:
            theta, mu = averaged_task_vectors(states, task, K, estimation_positions(P, protocol))
            basis = span_basis(theta, protocol.rank_cut)
            edits = {p: subspace_edit(theta, basis, mu[p], a) for p in positions}
        else:
            edits = {p: subspace_edit(self.task_vectors, self.basis, self.mu[p], a) for p in positions}
        inputs = steered.inputs
        return steer(
            self.run.model,
            inputs.readout,
            steered.batch.tokens,
            write,
            sequence,
            a,
            edits,
            inputs.positions,
            gen,
            form,
            N,
        )

    @cached_property
    def probe_data(self) -> ProbeData:
        """What the ablations' probe regresses at this place (``analysis.measures.task_probe.ProbeData``):
        the states here of the run's probe sequences over the fit window, beside their regressors,
        which every place shares (``StudyRun.probe_inputs``, ``probe_inputs``)."""
        return self._data_of(self.run.probe_inputs)

    def _data_of(self, inputs: ProbeInputs) -> ProbeData:
        """``ProbeData`` of a probe's inputs: its sequences' states at this place over its fit window."""
        states = torch.cat(
            [self.run.cache(chunk, [self.place])[self.place][:, inputs.window] for chunk in inputs.chunks]
        )
        return ProbeData(states, inputs.pi, inputs.current, inputs.logits, self.sequences.inputs.vocab)

    @cached_property
    def search_probe(self) -> ProbeFit:
        """The study's search probe at this place (the family's ``search_probe``; the ablations' probe,
        ``task_probe``, where it declares none): its own fit on the same sequences, over its window and
        with its posterior (E1: every pool task), by the "gram" solver where its posterior spans the
        pool (``analysis.measures.task_probe.fit_probe``) [ours: memory], its own split."""
        spec = self.run.family.search_probe
        if spec is None:
            return self.task_probe
        solver = "gram" if spec.every_pool_task else "study"
        return fit_probe(
            self._data_of(self.run.search_probe_inputs), spec, generator(self.run.seed, 0, "search-probe-split"), solver
        )

    @cached_property
    def task_probe(self) -> ProbeFit:
        """The study's probe of this family at this place (``analysis.measures.task_probe``; the family's
        ``task_probe`` says what it regresses on), fitted as its ``_fit_ols`` fits it on ``probe_data``."""
        return fit_probe(self.probe_data, self.run.family.task_probe, generator(self.run.seed, 0, "probe-split"))

    @cached_property
    def task_probe_exact(self) -> ProbeFit:
        """The variant ``probe-exact``: the same probe by an exact double-precision least-squares fit."""
        return fit_probe(
            self.probe_data, self.run.family.task_probe, generator(self.run.seed, 0, "probe-split"), solver="exact"
        )

    @property
    def probe(self) -> torch.Tensor:
        """[D, r] orthonormal basis of the ablations' task subspace S: the row space of the study's
        probe's W_task (``task_probe``; rank K - 1 where the majors' posterior sums to one; float64)."""
        return self.task_probe.basis

    @cached_property
    def probe_with_mean(self) -> torch.Tensor:
        """[D, K] S of the variant ``s-with-mean``: the minimum-norm probe with every posterior column
        over the late window, which also holds the mean state (``analysis.measures.task_probe.probe_basis_with_mean``)."""
        inputs = self.sequences.inputs
        return probe_basis_with_mean(self.states, self.sequences.alpha, inputs.current, inputs.vocab, self.window)

    def s_basis(self, protocol: Protocol | None = None) -> torch.Tensor:
        """[D, r] the ablations' S of ``protocol.s_probe``: the study's probe (``probe``), ``with-mean``
        (``probe_with_mean``) or ``exact`` (``task_probe_exact``); ``centred`` ablates the task vectors'
        span (``ablate``) and leaves V's avoided S the study's (``protocol``: the active one when None)."""
        protocol = active() if protocol is None else protocol
        if protocol.s_probe == "with-mean":
            return self.probe_with_mean
        return self.task_probe_exact.basis if protocol.s_probe == "exact" else self.probe

    def ablate(self, protocol: Protocol | None = None) -> Edit:
        """The S ablation at this place on the analysed positions: ``h - h P_S`` with S the study's
        probe's (docs/protocol.md, "S ablation"), or that of ``protocol.s_probe`` (``s_basis``);
        ``s_probe="centred"`` (the variant ``centred-S``): ``h - P_S (h - mu_t)`` with S the span of
        the task vectors (docs/protocol.md, "Variants"); ``protocol``: the active one when None."""
        protocol = active() if protocol is None else protocol
        if protocol.s_probe == "centred":
            change = task_ablation(self.fit.subspace)
        else:
            change = direction_ablation(self.s_basis(protocol))
        return Edit(self.run, self.place, change, self.run.analysed_positions)

    def projection_r2(
        self, sequences: Sequences, form: Form = "token", states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N' * W] projection R^2 on S of the late states of other ``sequences`` (OOD ones, as a
        rule) at this place (``states``: [N', P, D] if already captured): centred by mu_t and
        regressed on the task vectors (``plain``), or centred by mu_t + nu(x_t) and regressed on
        theta_{k, x_t} (``token``; for E2, whose x_t is continuous, both forms regress on S's basis and
        differ only by the centring nu(x_t)). Its mean is the stored value."""
        if form not in ("token", "plain"):
            raise AnalysisError(f"unknown form {form!r}; choose token or plain")
        h = self.run.cache(sequences, [self.place])[self.place] if states is None else states
        subspace, window = self.fit.subspace, self.window
        late = sequences.inputs.current[:, window]
        centred = (h[:, window].double() - subspace.mu[window]).flatten(0, 1)  # [N' * W, D]
        if form == "plain":
            return projection_r2(centred, subspace.basis)
        return projection_r2(
            centred - self.fit.layout.effect(late).double().flatten(0, 1),
            subspace.conditioned_basis(late).flatten(0, 1),
        )

    @cached_property
    def token_directions(self) -> torch.Tensor:
        """[D, m] the token subspace the orthogonal search avoids (``analysis.measures.orthogonal.token_subspace``):
        the right singular directions holding 90% of the squared singular values of the probe's W_tok,
        uncentred (the study's ``svd_basis(W_tok, 0.9)``); where the probe reads x_t rather than a one-hot
        (E2), those of the token effects **[ours]**."""
        return self._token_span(self.task_probe)

    def _token_span(self, fit: ProbeFit) -> torch.Tensor:
        """[D, m] ``token_directions`` of a fitted probe: its W_tok's 90% span, or the token effects' (E2)."""
        if fit.token_weights is not None:
            return token_subspace(fit.token_weights.float(), centre=False)
        return token_subspace(self.token_effects.float(), centre=self.run.family.centred_token_effects)

    @cached_property
    def avoided(self) -> torch.Tensor:
        """[D, m] where the orthogonal search may not go under the active protocol (docs/protocol.md):
        the study's search probe's span, and its token subspace for families that say so
        (``TaskFamily.v_avoids_tokens``: E3)."""
        return self.avoid()

    def avoid(self, protocol: Protocol | None = None) -> torch.Tensor:
        """[D, m] the span V avoids under ``protocol`` (the study's: ``avoided``): the row space of the
        search probe's W_task (``search_probe``), or under ``v_span="ablation-probe"`` its S
        (``s_basis``), and the token subspace (the same probe's W_tok) for the families that say
        so, or for every family under ``v_always_avoids_tokens`` (the variant ``v-avoids-tokens``,
        docs/protocol.md#variants); ``protocol``: the active one when None."""
        protocol = active() if protocol is None else protocol
        tokens = self.run.family.v_avoids_tokens or protocol.v_always_avoids_tokens
        if protocol.v_span == "search-probe":
            fit = self.search_probe
            spans = [fit.basis.float()]
            if tokens:
                spans.append(self._token_span(fit))
            return avoid_basis(*spans)
        s = self.s_basis(protocol).float()
        return avoid_basis(s, self.token_directions) if tokens else avoid_basis(s)


@dataclass(frozen=True)
class ProbeInputs:
    """The part of the ablations' probe that no place changes (``probe_inputs``): ``chunks``, the
    probe's sequences in passes of ``PROBE_CHUNK``; ``window``, the fit positions of the analysed
    ones; and over them pi [N, P, K], current [N, P] or [N, P, d] and logits [N, P, V] or None
    (``ProbeData``'s)."""

    chunks: list[Sequences]
    window: slice
    pi: torch.Tensor
    current: torch.Tensor
    logits: torch.Tensor | None


def probe_inputs(run: StudiedRun, spec: TaskProbe | None = None) -> ProbeInputs:
    """The regressors of the ablations' probe (or of the probe ``spec`` says): the protocol's ``probe_sequences``
    major sequences of the ``probe`` split (the study's ``sample_mode="major"``, ``n_minor=-1``: no minor
    or anchoring sequences), the family's posterior ([N, 1, K] where it is the whole sequence's), current
    tokens (E2: x_t) and the model's logits where the probe takes them, over its fit window,
    ``PROBE_CHUNK`` sequences a pass (the pool's posterior over 1,000 tasks is large)."""
    family = run.family
    spec = family.task_probe if spec is None else spec
    if spec is None:
        raise AnalysisError(
            f"the {family.name!r} family declares no task_probe (TaskFamily.task_probe: the regressors of the "
            "probe whose row space is the ablations' task subspace S; see docs/adding-a-family.md)"
        )
    probe = run.heldout("major", active().probe_sequences, split="probe")
    pool = run.pool if spec.pool_posterior else run.pool.subset("major")
    chunks, pi, current, logits = [], [], [], []
    for rows in torch.arange(len(probe)).split(PROBE_CHUNK):
        chunk = Sequences(run, "major", probe.split, probe.batch.rows(rows))
        inputs = family_inputs(family, chunk.batch, pool)
        window = fraction_window(inputs.current.shape[1], spec.window)
        alpha = inputs.alpha if spec.every_pool_task else inputs.alpha[..., : run.pool.n_major]
        chunks.append(chunk)  # a copy of pi: a view would hold the whole pool's posterior of the chunk
        pi.append(alpha[:, -1:].clone() if spec.sequence_posterior else alpha[:, window].clone())
        current.append(inputs.current[:, window])
        if spec.logits:
            with torch.no_grad():
                logits.append(inputs.select(run.model(chunk.batch.tokens))[:, window])
    return ProbeInputs(chunks, window, torch.cat(pi), torch.cat(current), torch.cat(logits) if logits else None)


def simplex_point(to, n: int, K: int) -> torch.Tensor:
    """[n, K] float64 from a point [K] (for every sequence) or points [n, K] of the simplex; AnalysisError otherwise."""
    a = torch.as_tensor(to, dtype=torch.float64)
    if a.shape not in ((K,), (n, K)):
        raise AnalysisError(
            f"a steering target is a point of the simplex over the {K} major tasks, [{K}] or [{n}, {K}]; got shape {tuple(a.shape)}"
        )
    if (a < 0).any() or ((a.sum(-1) - 1).abs() > 1e-6).any():
        raise AnalysisError("a steering target must be non-negative and sum to one (a point of the simplex)")
    return a.expand(n, K).clone()

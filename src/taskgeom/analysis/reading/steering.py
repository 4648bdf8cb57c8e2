"""Causal steering (docs/protocol.md, "Steering"): edit the task component of the state at one
position per forward pass toward a target point ``a`` of the simplex, and read how close the model
comes to what the mixture ``a`` of the major tasks predicts there.

- **Target points.** ``a ~ Dirichlet(1)`` (``dirichlet_points``), drawn independently of each
  sequence's true task; ``points`` of them per sequence, all steered in one batch of
  (sequence, point) pairs.
- **Edits** at analysed position p (``SteeringForm``), as the study's ``intervene_averaging_injection``
  makes them: ``"task"`` (E1, per-position task vectors, ``task_edit``): ``h' = h - theta_k(p) +
  sum_j a_j theta_j(p)`` with k the sequence's true task and ``theta_j(p)`` the mean state of task j
  at p minus the mean over tasks (``position_task_vectors``); ``"subspace"`` (E2, E3,
  ``subspace_edit``): ``h' = h - (h - mu_p) P_S + sum_j a_j theta_j`` with theta the averaging
  estimate over the protocol's ``steering_estimation`` (``averaged_task_vectors``), P_S the projector on their span
  (``span_basis``) and mu_p the mean over the tasks of each task's mean state at p. The vectors
  come from natural states of whole major tasks at the read place (``resid_post``), the edit is
  written at the protocol's ``steering_write_site`` of the same block (the study hooks the attention sub-block, whose
  output is ``resid_mid``); the variant ``steer-at-read-site`` writes at the read place with the
  two-way layout's late-window task effects (the earlier construction).
- **Positions** (``study_positions``): E1 25-39, E2 and E3 0-39 (E2: examples, edited where y_i
  is read), clipped to the context: a position beyond the last is moved to the last, so a short
  context keeps at least its last position **[ours]** (``clip_positions``).
- **Readouts** per (sequence, point), over its edited positions: the mean KL(model || q_a) with
  ``q_a = sum_j a_j p_j(. | context)`` (E1, E3, ``TokenReadout``), or the RMSE between the
  model's y and ``y_a = sum_j a_j x.w_j`` (E2, ``PredictionReadout``); each unsteered, steered,
  for the mode task (KL(q_mode || q_a), or the RMSE of the argmax task's prediction: no model)
  and for a random direction of the same norm as each steering displacement. A ``Steering``
  holds them; the claim reads their means over the pairs (``Steering.mean``).

Each pass runs the model on the prefix up to its edited position (the model is causal, so the
outputs read there are those of the whole sequence) and from the edited block on
(``LayerStreams``), ``CHUNK`` steered pairs at a time (a pair's outputs do not depend on the
others in its batch; smaller batches stay in the caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from taskgeom.analysis.protocol import Protocol, active
from taskgeom.analysis.reading.states import LayerStreams
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, intervene
from taskgeom.tasks import Batch, TaskFamily, TokenFamily

# An edit of the states [m, 1, D] of the steered pairs ``rows`` at one position: (states, rows) -> edited
RowEdit = Callable[[torch.Tensor, slice], torch.Tensor]
CHUNK = 512  # steered pairs a forward pass (speed and memory only)
SteeringForm = Literal["task", "subspace"]
FORMS: tuple[str, ...] = ("task", "subspace")
# The protocol's choices steering reads (``active()``): steering_task_positions and
# steering_subspace_positions, the positions each form edits (``study_positions``); steering_span, the
# study edits positions below 40; steering_estimation, the positions whose natural states give the
# subspace form's task vectors; steering_estimation_per_task, the natural sequences of each major task
# they are estimated on (the study's estimation_B); steering_sequences, the sequences steered, drawn from
# the major mixture (the study's B); steering_write_site, where the study writes the edit (the output of
# the block's attention sub-block); rank_cut, the study's rank cut of the task vectors' span.
KINDS = ("unsteered", "steered", "mode", "random")


def check_form(form: str) -> None:
    """AnalysisError for an unknown edit ``form``."""
    if form not in FORMS:
        raise AnalysisError(f"unknown steering form {form!r}; choose one of {list(FORMS)}")


def study_form(family: TaskFamily) -> SteeringForm:
    """The study's edit for ``family`` (its ``steering_form``): per-position task vectors for E1
    (dice), the task subspace for E2 and E3; AnalysisError for a family that declares none."""
    return family.declared("steering_form")


def steering_place(family: TaskFamily, n_layers: int) -> Place:
    """Where steering reads its vectors (docs/protocol.md): the M1 claims' place, the family's
    ``m1_block`` (E1, E3 block 3 of 6; E2 10 of 16) at the same relative depth, ``resid_post``; the
    protocol writes the edit at its ``steering_write_site`` of the same block."""
    return Place.at_depth(*family.m1_block, n_layers)


def study_positions(form: str, protocol: Protocol | None = None) -> range:
    """The positions the study edits with ``form`` under ``protocol`` (the active one when None)."""
    protocol = active() if protocol is None else protocol
    return {"task": protocol.steering_task_positions, "subspace": protocol.steering_subspace_positions}[form]


def clip_positions(span: Sequence[int], n_positions: int) -> tuple[int, ...]:
    """The analysed positions of ``span`` in a context of ``n_positions``: each beyond the last
    moved to the last, without repeats (at least one); AnalysisError for a negative or empty span."""
    if not len(span) or min(span) < 0:
        raise AnalysisError(f"steering positions must be a non-empty set of non-negative positions, got {list(span)}")
    return tuple(sorted({min(int(p), n_positions - 1) for p in span}))


def estimation_positions(n_positions: int, protocol: Protocol | None = None) -> tuple[int, ...]:
    """The subspace form's estimation positions in a context of ``n_positions`` analysed positions:
    the ``protocol``'s (the active one's when None) ``steering_estimation`` where it fits, else the
    same fractions of the study's edited span 0-39 (E2 at 16 examples: 10-15) **[ours]**."""
    protocol = active() if protocol is None else protocol
    estimation, span = protocol.steering_estimation, protocol.steering_span
    if max(estimation) < n_positions:
        return tuple(estimation)
    return tuple(sorted({min(p * n_positions // span, n_positions - 1) for p in estimation}))


def averaged_task_vectors(
    h: torch.Tensor, task: torch.Tensor, K: int, positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The study's averaging estimate (``estimate_task_vectors_by_averaging``) from natural states
    h: [N, P, D] of sequences of task: [N]: (theta [K, D], mu [P, D]) float64, theta_k the mean of
    task k's states over its sequences and ``positions`` minus the mean over the tasks, mu the mean
    over the tasks of each task's mean state at each position (``per_position_mean``)."""
    means = position_task_vectors(h, task, K, centred=False)  # [K, P, D]
    theta = means[:, list(positions)].mean(1)
    return theta - theta.mean(0), means.mean(0)


def span_basis(theta: torch.Tensor, cut: float | None = None) -> torch.Tensor:
    """[D, r] orthonormal basis of the span of theta: [K, D] from its SVD, the directions whose
    singular value exceeds ``cut`` (the protocol's ``rank_cut`` when None) times the largest."""
    cut = active().rank_cut if cut is None else cut
    _, singular, vh = torch.linalg.svd(theta.double(), full_matrices=False)
    return vh[: int((singular > cut * singular[0]).sum())].T


def dirichlet_points(n: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """[n, K] float64 points drawn from Dirichlet(1) on the simplex (normalised unit gammas)."""
    gamma = torch._standard_gamma(torch.ones(n, K, dtype=torch.float64), gen)
    return gamma / gamma.sum(-1, keepdim=True)


def position_task_vectors(h: torch.Tensor, task: torch.Tensor, K: int, centred: bool = True) -> torch.Tensor:
    """[K, P, D] float64 theta_k(p): the mean of task k's states at each position minus the mean
    of those over the tasks (``centred`` False: the means themselves), for h: [N, P, D] of
    sequences of task: [N] (each of 0..K-1 present)."""
    onehot = torch.nn.functional.one_hot(task, K).double()  # [N, K]
    counts = onehot.sum(0)
    if (counts == 0).any():
        raise AnalysisError(
            f"no sequences of tasks {torch.nonzero(counts == 0).flatten().tolist()}: cannot form their task vectors"
        )
    means = torch.einsum("nk,npd->kpd", onehot, h.double()) / counts[:, None, None]
    return means - means.mean(0) if centred else means


def task_edit(theta: torch.Tensor, task: torch.Tensor, a: torch.Tensor) -> RowEdit:
    """h -> h - theta[task] + a @ theta at one position: theta: [K, D] the task vectors there,
    task: [M] the true tasks, a: [M, K]; h: [m, 1, D] of the pairs ``rows``."""
    shift = (a.double() @ theta.double() - theta.double()[task])[:, None]  # [M, 1, D]
    return lambda h, rows: h + shift[rows].to(h.dtype)


def subspace_edit(theta: torch.Tensor, basis: torch.Tensor, mu: torch.Tensor, a: torch.Tensor) -> RowEdit:
    """h -> h - (h - mu) P_S + a @ theta at one position: theta: [K, D], basis: [D, r] orthonormal
    (P_S = basis basis^T), mu: [D] the mean state there, a: [M, K]; h: [m, 1, D] of the pairs ``rows``."""
    target = (a.double() @ theta.double())[:, None]  # [M, 1, D]

    def edit(h: torch.Tensor, rows: slice) -> torch.Tensor:
        B = basis.to(h.dtype)
        return h - ((h - mu.to(h.dtype)) @ B) @ B.T + target[rows].to(h.dtype)

    return edit


def random_edit(edit: RowEdit, directions: torch.Tensor) -> RowEdit:
    """Move each state by its direction of directions: [M, 1, D] (Gaussian draws: uniformly random
    directions), its length that of ``edit``'s displacement."""

    def control(h: torch.Tensor, rows: slice) -> torch.Tensor:
        norm = (edit(h, rows) - h).norm(dim=-1, keepdim=True)
        direction = directions[rows].to(h.dtype)
        return h + norm * direction / direction.norm(dim=-1, keepdim=True)

    return control


def kl_rows(logp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[...] KL(model || target) for model log-probabilities logp and target probabilities: [..., V]."""
    logp = logp.double()
    return (logp.exp() * (logp - target.double().clamp_min(1e-300).log())).sum(-1)


@dataclass(frozen=True)
class TokenReadout:
    """E1, E3: KL(model || q_a) of the next-token law at each edited position, averaged over them;
    tokens: [N, T]; params: [K, ...] of the major tasks."""

    family: TokenFamily
    tokens: torch.Tensor
    params: torch.Tensor
    measure = "kl"
    label = "KL(model || q_a)"

    def mixture(self, sequence: torch.Tensor, weights: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """[M, P', V] q = sum_j weights_j p_j(. | context) at ``positions`` of the sequences
        ``sequence``: [M]; weights: [M, K]."""
        tokens = self.tokens[sequence, : max(positions) + 1]
        M, T = tokens.shape
        return self.family.mix_predictive(tokens, self.params.double(), weights.double()[:, None].expand(M, T, -1))[
            :, list(positions)
        ]

    @staticmethod
    def prediction(out: torch.Tensor) -> torch.Tensor:
        """[..., V] log-probabilities of model outputs [..., V]."""
        return torch.log_softmax(out.double(), -1)

    @staticmethod
    def of_mixture(q: torch.Tensor) -> torch.Tensor:
        """What a predictor that follows the mixture q outputs, in ``prediction``'s form."""
        return q.double().clamp_min(1e-300).log()

    @staticmethod
    def distance(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_rows(prediction, target)

    @staticmethod
    def summarise(values: torch.Tensor) -> torch.Tensor:
        """[M] the mean over the positions of values: [M, P']."""
        return values.mean(-1)


@dataclass(frozen=True)
class PredictionReadout:
    """E2: the RMSE, over the edited examples, between the model's prediction of y_i (read where
    the layout predicts it) and ``y_a = sum_j a_j x_i . w_j``; params: [K, d]; ``family``: one that
    predicts vectors (``mix_prediction``)."""

    family: TaskFamily
    batch: Batch
    params: torch.Tensor
    measure = "rmse"
    label = "RMSE(model's y, y_a)"

    def mixture(self, sequence: torch.Tensor, weights: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """[M, P'] y = sum_j weights_j x_i . w_j for the examples i = ``positions``."""
        x = self.batch.x[sequence][:, list(positions)]
        return self.family.mix_prediction(x, self.params, weights.double()[:, None].expand(*x.shape[:2], -1))

    @staticmethod
    def prediction(out: torch.Tensor) -> torch.Tensor:
        return out[..., 0].double()

    @staticmethod
    def of_mixture(y: torch.Tensor) -> torch.Tensor:
        return y.double()

    @staticmethod
    def distance(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (prediction - target) ** 2

    @staticmethod
    def summarise(values: torch.Tensor) -> torch.Tensor:
        """[M] the root of the mean over the positions of squared errors: [M, P']."""
        return values.mean(-1).sqrt()


Readout = TokenReadout | PredictionReadout


@dataclass(frozen=True)
class Steering:
    """One steering experiment (module docstring). a: [M, K] the target points; sequence: [M] the
    steered sequence of each (0..n_sequences-1); positions: the analysed positions edited, one per
    forward pass; unsteered, steered, mode, random: [M] the readout of each (sequence, point) over
    those positions (``measure`` "kl" or "rmse", ``label`` in words); form: the edit; place: where
    it writes (the vectors are read at ``resid_post`` of its block)."""

    a: torch.Tensor
    sequence: torch.Tensor
    positions: tuple[int, ...]
    unsteered: torch.Tensor
    steered: torch.Tensor
    mode: torch.Tensor
    random: torch.Tensor
    measure: str
    label: str
    form: str
    place: Place
    n_sequences: int

    def __repr__(self) -> str:
        means = ", ".join(f"{kind} {self.mean(kind):.4g}" for kind in KINDS)
        return (
            f"Steering({self.form} edit at {self.place}, {self.n_points} points on {self.n_sequences} sequences, "
            f"{len(self.positions)} positions; mean {self.measure}: {means})"
        )

    @property
    def n_points(self) -> int:
        """The number of target points (one per steered (sequence, point) pair)."""
        return self.a.shape[0]

    def mean(self, kind: str) -> float:
        """The mean of ``kind`` (one of KINDS) over the (sequence, point) pairs: what the claim reads."""
        if kind not in KINDS:
            raise AnalysisError(f"unknown steering readout {kind!r}; choose one of {list(KINDS)}")
        return float(getattr(self, kind).double().mean())


@torch.no_grad()
def steer(
    model: torch.nn.Module,
    readout: Readout,
    tokens: torch.Tensor,
    place: Place,
    sequence: torch.Tensor,
    a: torch.Tensor,
    edits: dict[int, RowEdit],
    model_positions: torch.Tensor | None,
    gen: torch.Generator,
    form: str,
    n_sequences: int,
) -> Steering:
    """Steer the sequences ``sequence``: [M] (rows of tokens: [N, T, ...]) toward a: [M, K] at
    ``place``, one forward pass per analysed position p of ``edits`` ({p: the edit of the states
    there, ``RowEdit``}), each read where the model predicts at p (model position
    ``model_positions[p]``; None: p itself), ``CHUNK`` pairs at a time; the random control's
    directions come from ``gen``."""
    model.eval()
    positions = tuple(sorted(edits))
    where = positions if model_positions is None else tuple(int(model_positions[p]) for p in positions)
    M, state = len(sequence), model.embed_inputs(tokens[sequence[:1], :1])  # [1, 1, D]: the states' width and dtype
    directions = [  # the random controls', each pass's drawn in turn
        torch.randn((M, 1, state.shape[-1]), generator=gen, dtype=state.dtype) for _ in positions
    ]
    target = readout.mixture(sequence, a, positions)  # [M, P', ...]
    mode = readout.distance(
        readout.of_mixture(readout.mixture(sequence, torch.nn.functional.one_hot(a.argmax(-1), a.shape[1]), positions)),
        target,
    )
    parts: dict[str, list[torch.Tensor]] = {"unsteered": [], "steered": [], "random": []}
    for start in range(0, M, CHUNK):
        rows = slice(start, min(start + CHUNK, M))
        prefix = tokens[sequence[rows], : max(where) + 1]
        streams = LayerStreams(model, prefix)

        def read(out: torch.Tensor, i: int) -> torch.Tensor:
            return readout.distance(readout.prediction(out[:, where[i]]), target[rows, i])

        def edited(edit: RowEdit, i: int) -> torch.Tensor:
            forward = streams.model_from(
                place, where[i] + 1
            )  # the prefix up to the edited position: later ones cannot change its output
            with intervene(model, place, lambda h: edit(h, rows), slice(where[i], where[i] + 1)):
                return read(forward(prefix), i)

        plain = streams.model_from(place)(prefix)
        parts["unsteered"].append(torch.stack([read(plain, i) for i in range(len(positions))], 1))
        parts["steered"].append(torch.stack([edited(edits[p], i) for i, p in enumerate(positions)], 1))
        parts["random"].append(
            torch.stack([edited(random_edit(edits[p], directions[i]), i) for i, p in enumerate(positions)], 1)
        )
    unsteered, steered, random = (torch.cat(parts[kind]) for kind in ("unsteered", "steered", "random"))
    values = {kind: readout.summarise(v) for kind, v in zip(KINDS, (unsteered, steered, mode, random))}
    return Steering(
        a,
        sequence,
        positions,
        **values,
        measure=readout.measure,
        label=readout.label,
        form=form,
        place=Place(*place),
        n_sequences=n_sequences,
    )

"""The task subspace (docs/concepts.md and docs/protocol.md): the one object every analysis uses.

``TaskSubspace`` holds the centred task vectors ``theta_k`` in float64, the per-position mean state
``mu_t`` over the major tasks, an orthonormal basis of S of explicit rank K - 1, and, for token
families, the token-conditioned vectors ``theta_{k,a}`` with a rank-(K - 1) basis per token.

Rank cut-off: the vectors sum to zero over k, so they span at most K - 1 dimensions; the basis is
the K - 1 leading left singular vectors of theta^T, and the subspace is refused (ValueError) when
the (K - 1)-th singular value is below the protocol's ``rank_cut`` times the first (AnalysisError). Rounding noise in the
zero-sum direction (about 1e-7 of the first singular value for float32 states) therefore never
enters the basis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.analysis.protocol import active
from taskgeom.errors import AnalysisError

MIN_MAJOR_TASKS = 2  # K - 1 >= 1: fewer major tasks span no task subspace


def check_major_tasks(n_major: int, what: str) -> None:
    """Refuse (AnalysisError) ``what`` for a config with fewer than MIN_MAJOR_TASKS major tasks,
    before any work: its task vectors span no subspace."""
    if n_major < MIN_MAJOR_TASKS:
        raise AnalysisError(
            f"{what}: the task subspace needs at least {MIN_MAJOR_TASKS} major tasks (task.n_major), got {n_major}"
        )


def rank_basis(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(basis [..., D, K-1], ok [...]) for centred vectors: [..., K, D]: the K - 1 leading left
    singular vectors of vectors^T in float64; ok is false where the (K - 1)-th singular value is
    below the protocol's ``rank_cut`` times the first (the vectors span fewer than K - 1 dimensions)."""
    u, s, _ = torch.linalg.svd(vectors.double().transpose(-1, -2), full_matrices=False)
    rank = vectors.shape[-2] - 1
    ok = s[..., rank - 1] > active().rank_cut * s[..., 0]
    return u[..., :rank], ok


@dataclass(frozen=True)
class TaskSubspace:
    """theta: [K, D] centred task vectors; mu: [T, D] mean state per position over the major tasks;
    basis: [D, K-1] orthonormal basis of S; window: the late positions the vectors average;
    theta_token: [K, V, D] token-conditioned vectors (None for continuous inputs); token_basis:
    [V, D, K-1] an orthonormal basis of span_k theta_{k,a} per token a. All float64."""

    theta: torch.Tensor
    mu: torch.Tensor
    basis: torch.Tensor
    window: slice
    theta_token: torch.Tensor | None = None
    token_basis: torch.Tensor | None = None

    def conditioned_basis(self, tokens: torch.Tensor) -> torch.Tensor:
        """[..., D, K-1] the basis of span_k theta_{k,a} for each current token a of tokens: [...]
        long; the basis of S for continuous inputs (float tokens) or when there are no
        token-conditioned vectors."""
        if tokens.is_floating_point() or self.token_basis is None:
            shape = tokens.shape[:-1] if tokens.is_floating_point() else tokens.shape
            return self.basis.expand(*shape, *self.basis.shape)
        return self.token_basis[tokens]


def task_subspace(
    theta: torch.Tensor, mu: torch.Tensor, window: slice, theta_token: torch.Tensor | None = None
) -> TaskSubspace:
    """The subspace of raw task effects theta: [K, D] (centred here), mu: [T, D] and, optionally,
    theta_token: [K, V, D] (centred over k here). Tokens whose conditioned vectors span fewer than
    K - 1 dimensions use the basis of S."""
    theta = theta.double() - theta.double().mean(0)
    basis, ok = rank_basis(theta)
    if not bool(ok):
        raise AnalysisError(
            f"the {theta.shape[0]} task vectors span fewer than {theta.shape[0] - 1} dimensions: the task subspace "
            "is degenerate here (are the major tasks distinct, and does this site carry them?)"
        )
    token_basis = None
    if theta_token is not None:
        theta_token = theta_token.double() - theta_token.double().mean(0)
        per_token, fine = rank_basis(theta_token.transpose(0, 1))  # [V, D, K-1], [V]
        token_basis = torch.where(fine[:, None, None], per_token, basis)
    return TaskSubspace(theta, mu.double(), basis, window, theta_token, token_basis)


def position_means(h: torch.Tensor, task: torch.Tensor, n_tasks: int) -> torch.Tensor:
    """[T, D] float64: the mean over tasks of each task's mean state at each position, for h: [N, T, D]
    of sequences of task: [N] in 0..n_tasks-1 (each present)."""
    onehot = torch.nn.functional.one_hot(task, n_tasks).double()  # [N, K]
    counts = onehot.sum(0)
    if (counts == 0).any():
        missing = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"no sequences of tasks {missing}: cannot form their task vectors")
    per_task = torch.einsum("nk,ntd->ktd", onehot, h.double()) / counts[:, None, None]  # [K, T, D]
    return per_task.mean(0)


def token_conditioned(
    h: torch.Tensor, task: torch.Tensor, tokens: torch.Tensor, n_tasks: int, vocab: int, theta: torch.Tensor
) -> torch.Tensor:
    """[K, V, D] theta_{k,a} = cell mean (k, a) - mean over k of the cell means (k, a), for
    late-window states h: [M, D] with task: [M] and current token tokens: [M]. A token that some
    task never shows at these positions takes the plain vectors theta: [K, D] (centred)."""
    h = h.double()
    cell = task * vocab + tokens
    counts = torch.bincount(cell, minlength=n_tasks * vocab).double().view(n_tasks, vocab)
    sums = torch.zeros(n_tasks * vocab, h.shape[1], dtype=torch.float64).index_add_(0, cell, h).view(n_tasks, vocab, -1)
    means = sums / counts.clamp_min(1)[..., None]
    conditioned = means - means.mean(0, keepdim=True)
    complete = (counts > 0).all(0)  # [V]
    plain = (theta.double() - theta.double().mean(0))[:, None].expand_as(conditioned)
    return torch.where(complete[None, :, None], conditioned, plain)


def late_window(seq_len: int, fraction: float = 0.25) -> slice:
    """The last ``fraction`` of positions (at least one)."""
    return slice(seq_len - max(1, round(fraction * seq_len)), seq_len)


def fraction_window(length: int, fractions: tuple[float, float]) -> slice:
    """The positions [round(start * length), round(stop * length)) of ``length`` (at least one) for
    fractions (start, stop) of the context (a family's ``vector_window``: E1's 100-119 of 128 at
    length 128, the same share of any other length); ValueError unless 0 <= start < stop <= 1."""
    start, stop = fractions
    if not 0 <= start < stop <= 1:
        raise ValueError(f"a window is fractions 0 <= start < stop <= 1 of the context, got {fractions}")
    first = min(round(start * length), length - 1)
    return slice(first, max(first + 1, round(stop * length)))

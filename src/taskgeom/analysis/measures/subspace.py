"""docs/concepts.md#m2-the-nearly-orthogonal-subspace: the task subspace S against the nearly orthogonal OOD subspace.

Shapes: ``N`` sequences, ``T`` positions, ``D`` width, ``K`` task vectors, ``r`` ablated directions.
Every ablation is an edit of one site (layer, name), applied at every position or at the analysed
ones (E2: its separators) by ``edits.Edit``.
"""

from __future__ import annotations

from typing import Callable

import torch

from taskgeom.analysis.measures.task_vectors import TaskSubspace

Edit = Callable[[torch.Tensor], torch.Tensor]


def projection_r2(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """[N] R^2 across hidden coordinates of the no-intercept regression of each x: [N, D] (centred
    states) on the task vectors, clipped to [0, 1]. The regression is the projection onto
    basis: [D, r] (``TaskSubspace.basis``, the plain form) or [N, D, r] per state (the
    token-conditioned form, ``TaskSubspace.conditioned_basis``), an orthonormal basis of explicit
    rank K - 1 of the vectors' span."""
    x, basis = x.double(), basis.double()
    if basis.dim() == 2:
        fitted = x @ basis @ basis.T
    else:
        fitted = torch.einsum("ndr,nr->nd", basis, torch.einsum("nd,ndr->nr", x, basis))
    total = ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)
    return (1 - ((x - fitted) ** 2).sum(-1) / total).clamp(0, 1).float()


def complement_basis(basis: torch.Tensor) -> torch.Tensor:
    """[D, D - k] orthonormal basis of the orthogonal complement of span(basis: [D, k])."""
    q, _ = torch.linalg.qr(torch.cat([basis.double(), torch.eye(basis.shape[0], dtype=torch.float64)], 1))
    return q[:, basis.shape[1] : basis.shape[0]].to(basis.dtype)


def task_ablation(subspace: TaskSubspace) -> Edit:
    """h <- h - P_S (h - mu_t), for h: [B, P, D] at exactly the P analysed positions of ``subspace.mu``."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        if h.shape[1] != subspace.mu.shape[0]:
            raise ValueError(
                f"the S ablation edits the {subspace.mu.shape[0]} analysed positions of mu_t, got {h.shape[1]}"
            )
        basis = subspace.basis.to(h.dtype)
        centred = h - subspace.mu.to(h.dtype)
        return h - centred @ basis @ basis.T

    return edit


def direction_ablation(directions: torch.Tensor) -> Edit:
    """h <- h - V V^T h for orthonormal directions: [D, r] (cast to the states' dtype)."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        v = directions.to(h.dtype)
        return h - h @ v @ v.T

    return edit


def random_directions(complement: torch.Tensor, rank: int, gen: torch.Generator) -> torch.Tensor:
    """[D, rank] orthonormal directions drawn uniformly inside span(complement: [D, m])."""
    q, _ = torch.linalg.qr(torch.randn(complement.shape[1], rank, generator=gen, dtype=torch.float64))
    return (complement.double() @ q).to(complement.dtype)

"""PAPER.md section 5: the task subspace S against the nearly orthogonal OOD subspace.

Shapes: ``N`` sequences, ``T`` positions, ``D`` width, ``K`` task vectors, ``r`` ablated directions.
Every ablation acts on one site (layer, name) through ``hooks.intervene``, at every position or at
the analysed ones (E2: its separators); the model runs from that site's layer on, on the stream a
batch's ``states.LayerStreams`` keeps.
"""

from __future__ import annotations

from typing import Callable

import torch

from taskgeom.analysis.states import LayerStreams
from taskgeom.analysis.task_vectors import TaskSubspace
from taskgeom.hooks import Site, intervene
from taskgeom.tasks import Batch, TaskFamily

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
            raise ValueError(f"the S ablation edits the {subspace.mu.shape[0]} analysed positions of mu_t, got {h.shape[1]}")
        basis = subspace.basis.to(h.dtype)
        centred = h - subspace.mu.to(h.dtype)
        return h - centred @ basis @ basis.T

    return edit


def direction_ablation(directions: torch.Tensor) -> Edit:
    """h <- h - V V^T h for orthonormal directions: [D, r]."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        return h - h @ directions @ directions.T

    return edit


def model_losses(family: TaskFamily, streams: LayerStreams, batch: Batch, references: tuple[torch.Tensor, torch.Tensor],
                 site: Site | None = None, edit: Edit | None = None, positions: slice | torch.Tensor | None = None) -> torch.Tensor:
    """[P] the model's mean loss per prediction (nats for tokens, squared error for E2) over the
    batch, with ``edit`` applied at ``site`` on ``positions`` (all by default); streams: the
    batch's ``LayerStreams``, so the model runs only from the edited block on (and a clean pass
    fills every stream); references: ``family.reference_predictions``."""
    with torch.no_grad():
        if edit is None:
            return family.position_losses(streams.model_from(None), batch, *references)["loss"].mean(0)
        with intervene(streams.model, site, edit, positions):
            return family.position_losses(streams.model_from(site), batch, *references)["loss"].mean(0)


def gain_removed(ablated: torch.Tensor, clean: torch.Tensor) -> float:
    """Share of in-context gain removed, in percent: 100 (L_ablated - L) / (L_0 - L), where L and
    L_ablated average the per-prediction losses [P] over every prediction after the first (the
    study's choice) and L_0 is the clean loss of the first prediction."""
    late, late_ablated = clean[1:].mean(), ablated[1:].mean()
    return float(100 * (late_ablated - late) / (clean[0] - late))


def random_directions(complement: torch.Tensor, rank: int, gen: torch.Generator) -> torch.Tensor:
    """[D, rank] orthonormal directions drawn uniformly inside span(complement: [D, m])."""
    q, _ = torch.linalg.qr(torch.randn(complement.shape[1], rank, generator=gen, dtype=torch.float64))
    return (complement.double() @ q).to(complement.dtype)

"""PAPER.md section 5: the task subspace S against the nearly orthogonal OOD subspace.

Shapes: ``N`` sequences, ``T`` positions, ``D`` width, ``K`` task vectors, ``r`` ablated directions.
Every ablation acts on one site (layer, name) at all positions through ``hooks.intervene``.
"""

from __future__ import annotations

from typing import Callable

import torch

from taskgeom.analysis.task_vectors import TaskVectors
from taskgeom.hooks import Site, intervene
from taskgeom.tasks import Batch, TaskFamily

Edit = Callable[[torch.Tensor], torch.Tensor]


def projection_r2(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """[N] R^2 across hidden coordinates of the no-intercept regression of each x: [N, D] (states
    centred by mu_t) on the task vectors theta: [K, D], clipped to [0, 1]."""
    x, theta = x.double(), theta.double()
    coef = torch.linalg.lstsq(theta.T.expand(x.shape[0], -1, -1), x[..., None]).solution  # [N, K, 1]
    residual = x - (theta.T @ coef).squeeze(-1)
    total = ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)
    return (1 - (residual**2).sum(-1) / total).clamp(0, 1).float()


def complement_basis(basis: torch.Tensor) -> torch.Tensor:
    """[D, D - k] orthonormal basis of the orthogonal complement of span(basis: [D, k])."""
    q, _ = torch.linalg.qr(torch.cat([basis.double(), torch.eye(basis.shape[0], dtype=torch.float64)], 1))
    return q[:, basis.shape[1] : basis.shape[0]].to(basis.dtype)


def task_ablation(vectors: TaskVectors) -> Edit:
    """h <- h - P_S (h - mu_t), for h: [B, T, D] covering positions 0..T-1."""
    basis = vectors.basis

    def edit(h: torch.Tensor) -> torch.Tensor:
        centred = h - vectors.mu[: h.shape[1]]
        return h - centred @ basis @ basis.T

    return edit


def direction_ablation(directions: torch.Tensor) -> Edit:
    """h <- h - V V^T h for orthonormal directions: [D, r]."""

    def edit(h: torch.Tensor) -> torch.Tensor:
        return h - h @ directions @ directions.T

    return edit


def model_losses(family: TaskFamily, model: torch.nn.Module, batch: Batch, references: tuple[torch.Tensor, torch.Tensor],
                 site: Site | None = None, edit: Edit | None = None) -> torch.Tensor:
    """[P] the model's mean loss per prediction (nats for tokens, squared error for E2) over the
    batch, with ``edit`` applied at ``site``; references: ``family.reference_predictions``."""
    with torch.no_grad():
        if edit is None:
            return family.position_losses(model, batch, *references)["loss"].mean(0)
        with intervene(model, site, edit):
            return family.position_losses(model, batch, *references)["loss"].mean(0)


def gain_removed(ablated: torch.Tensor, clean: torch.Tensor, window: slice) -> float:
    """Share of in-context gain removed, in percent: 100 (L_ablated - L) / (L_0 - L), where L and
    L_ablated average the per-position losses [T-1] over ``window`` and L_0 is the clean loss at
    the first predicted position."""
    late, late_ablated = clean[window].mean(), ablated[window].mean()
    return float(100 * (late_ablated - late) / (clean[0] - late))


def random_directions(complement: torch.Tensor, rank: int, gen: torch.Generator) -> torch.Tensor:
    """[D, rank] orthonormal directions drawn uniformly inside span(complement: [D, m])."""
    q, _ = torch.linalg.qr(torch.randn(complement.shape[1], rank, generator=gen, dtype=torch.float64))
    return (complement.double() @ q).to(complement.dtype)


def orthogonal_search(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    site: Site,
    task_basis: torch.Tensor,
    rank: int = 1,
    steps: int = 200,
    lr: float = 0.01,
    patience: int = 40,
    seed: int = 0,
) -> torch.Tensor:
    """[D, rank] orthonormal directions orthogonal to S = span(task_basis: [D, k]) whose ablation
    (h <- h - V V^T h at ``site``) maximises ``loss_fn(model)`` (e.g. the training loss on a few
    hundred minor or OOD sequences, ``family.training_loss(model, batch)``). V = C Q(A) with C the complement basis
    and Q(A) the QR factor of a free [D - k, rank] matrix A; Adam ascent, stopping after
    ``patience`` steps without a new best loss; returns the best V seen."""
    gen = torch.Generator().manual_seed(seed)
    complement = complement_basis(task_basis.float())
    raw = torch.randn(complement.shape[1], rank, generator=gen).requires_grad_(True)
    opt = torch.optim.Adam([raw], lr=lr)
    frozen = [p.requires_grad_(False) for p in model.parameters()]
    best, best_loss, stale = None, -float("inf"), 0
    try:
        for _ in range(steps):
            directions = complement @ torch.linalg.qr(raw)[0]
            with intervene(model, site, direction_ablation(directions)):
                loss = loss_fn(model)
            opt.zero_grad()
            (-loss).backward()
            opt.step()
            if loss.item() > best_loss:
                best, best_loss, stale = directions.detach().clone(), loss.item(), 0
            else:
                stale += 1
                if stale >= patience:
                    break
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return best

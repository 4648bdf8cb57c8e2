"""The measurable core of Theorem 2 (docs/concepts.md#m2-the-nearly-orthogonal-subspace), at the last layer's resid_post.

Predictions are compared as centred log-probabilities (CLR; for a softmax readout, the centred
logits), with the Euclidean norm, so every quantity lives in one metric:

- k*: rank of the task subspace S;
- d0: intrinsic dimension of the OOD-optimal predictions over many OOD tasks, estimated by the
  PCA participation ratio (sum lambda)^2 / sum lambda^2 of their CLR vectors;
- L: Lipschitz estimate of the readout h -> CLR(final norm + unembedding): the largest Jacobian
  spectral norm over the observed states;
- c: per sequence, the gap between the OOD-optimal prediction and the best prediction the readout
  makes from a point of mu_t + S (found by L-BFGS over the coordinates in S);
- delta: the model's own gap to the OOD-optimal prediction;
- distance: ||(I - P_S)(h - mu_t)||, the distance of the state from mu_t + S.

Per sequence, Lipschitz continuity gives distance >= (c - delta) / L whenever L bounds the
readout's slope along the segment to S; the report puts the two side by side.
"""

from __future__ import annotations

import torch
from torch.func import jacrev, vmap


def clr(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] centred log-probabilities."""
    logp = probs.clamp_min(1e-300).log()
    return logp - logp.mean(-1, keepdim=True)


def centred_logits(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.mean(-1, keepdim=True)


def participation_ratio(x: torch.Tensor) -> float:
    """PCA participation ratio of the rows of x: [N, V]."""
    eig = torch.linalg.eigvalsh(torch.cov(x.double().T)).clamp_min(0)
    return float(eig.sum() ** 2 / (eig**2).sum())


def readout_lipschitz(readout, states: torch.Tensor) -> float:
    """max over states: [N, D] of the spectral norm of d CLR(readout(h)) / dh."""
    jac = vmap(jacrev(lambda h: centred_logits(readout(h))))(states.float())  # [N, V, D]
    return float(torch.linalg.matrix_norm(jac.detach(), ord=2).max())


def best_gap_in_subspace(
    readout, target_clr: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor, steps: int = 50
) -> torch.Tensor:
    """[N] min over a of ||target_clr - CLR(readout(mu + basis a))|| for target_clr: [N, V],
    mu: [N, D] the per-position means, basis: [D, k]. The sum over sequences separates, so one
    L-BFGS run minimises every sequence's gap."""
    coords = torch.zeros(target_clr.shape[0], basis.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([coords], max_iter=steps, line_search_fn="strong_wolfe")

    def gaps() -> torch.Tensor:
        return (target_clr.float() - centred_logits(readout(mu + coords @ basis.T))).norm(dim=-1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (gaps() ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return gaps()


def theorem2(
    readout,
    h: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    model_logits: torch.Tensor,
    ood_optimal: torch.Tensor,
    prior_predictions: torch.Tensor,
) -> dict[str, torch.Tensor | float]:
    """h, mu: [N, D] last-layer states of OOD sequences and their position means; basis: [D, k];
    model_logits: [N, V]; ood_optimal: [N, V] OOD-optimal predictive; prior_predictions: [M, V]
    OOD-optimal predictives over many OOD tasks (for d0). Per-sequence tensors are [N]."""
    target = clr(ood_optimal)
    centred = h - mu
    distance = (centred - centred @ basis @ basis.T).norm(dim=-1)
    lipschitz = readout_lipschitz(readout, h)
    gap = best_gap_in_subspace(readout, target, mu, basis)
    delta = (target.float() - centred_logits(model_logits.float())).norm(dim=-1)
    return {
        "k_star": basis.shape[1],
        "d0": participation_ratio(clr(prior_predictions)),
        "lipschitz": lipschitz,
        "c": gap,
        "delta": delta,
        "bound": (gap - delta) / lipschitz,
        "distance": distance,
    }

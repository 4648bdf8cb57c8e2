"""The task subspace S of the ablations (PAPER.md section 7, "S ablation"): the row space of
``W_task`` of a linear probe fitted by least squares on major sequences over the late window,

    h ~ pi W_task + onehot(x_t) W_tok + b        (E2: x_t W_x in place of the one-hot term)

with ``pi`` the exact posterior over the K major tasks. S is **uncentred, rank K**; the ablation
is ``h' = h - h P_S`` (``subspace.direction_ablation`` of its orthonormal basis).

**[ours]** The design is collinear (pi sums to one, so does the one-hot, and there is an
intercept), so ``W_task`` is fixed only up to adding one row to all of its rows; we take the
minimum-norm least-squares solution (what ``numpy.linalg.lstsq`` returns), which fixes that
freedom without choosing a reference task.

Shapes: ``N`` sequences, ``P`` analysed positions, ``D`` width, ``K`` major tasks, ``V`` tokens
(E2: ``d`` coordinates of x_t).
"""

from __future__ import annotations

import torch

from taskgeom.errors import AnalysisError


def probe_design(alpha: torch.Tensor, current: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """[M, K + V + 1] float64 the probe's regressors [pi, onehot(x_t), 1] for alpha: [M, K] and the
    current tokens: [M] (``vocab`` of them), or [pi, x_t, 1] for x_t: [M, d] (``vocab`` None)."""
    tokens = (torch.nn.functional.one_hot(current.long(), vocab) if vocab is not None else current).double()
    return torch.cat([alpha.double(), tokens, torch.ones(len(alpha), 1, dtype=torch.float64)], 1)


def probe_weights(states: torch.Tensor, alpha: torch.Tensor, current: torch.Tensor, vocab: int | None, window: slice) -> torch.Tensor:
    """[K, D] float64 W_task of the probe fitted on states: [N, P, D] over the positions ``window``
    (alpha: [N, P, K]; current: [N, P] tokens or [N, P, d] x_t): the minimum-norm least-squares fit."""
    K, D = alpha.shape[-1], states.shape[-1]
    x = probe_design(alpha[:, window].reshape(-1, K), current[:, window].flatten(0, 1), vocab)
    h = states[:, window].reshape(-1, D).double()
    weights = torch.linalg.lstsq(x.cpu(), h.cpu(), driver="gelsd").solution  # minimum norm
    return weights[:K].to(states.device)


def probe_basis(states: torch.Tensor, alpha: torch.Tensor, current: torch.Tensor, vocab: int | None, window: slice) -> torch.Tensor:
    """[D, K] float64 orthonormal basis of the row space of the probe's W_task (``probe_weights``);
    AnalysisError when its rows span fewer than K directions."""
    w = probe_weights(states, alpha, current, vocab, window)
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    K = w.shape[0]
    if s.numel() < K or s[-1] <= s[0] * 1e-10:
        raise AnalysisError(f"the probe's task weights span fewer than {K} directions: no rank-{K} task subspace")
    return vh[:K].T

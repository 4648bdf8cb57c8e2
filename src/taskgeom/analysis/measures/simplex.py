"""Least squares on the probability simplex, batched over states.

Every fit writes states as combinations of ``K`` vertices: ``y ~ V^T beta`` for y: [N, D] and
V: [K, D]. Two fits, both vectorised over all N states at once (float64):

- ``sum_to_one_fit`` then ``project_simplex``: the study's P2 fit (sum-to-one least squares, then the
  Euclidean projection of beta onto the simplex). This is the fit that P2 and P3 report.
- ``simplex_lstsq``: the exact minimiser of ||y - V^T beta||^2 over beta >= 0, sum beta = 1, by
  enumerating the 2^K - 1 supports (fine for the small K of the study). Reported beside P2 as
  ``p2.r2_task_exact`` and checked against SciPy in tests and ``benchmarks/simplex_solver.py``.
"""

from __future__ import annotations

import torch

from taskgeom.errors import AnalysisError

MAX_EXACT_K = 12  # 2^K - 1 supports are enumerated; beyond this the enumeration is too large


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K]: the Euclidean projection of each row onto {b >= 0, sum b = 1} (sort-based)."""
    u = v.sort(dim=-1, descending=True).values
    css = u.cumsum(-1) - 1
    ind = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype, device=v.device)
    rho = ((u - css / ind) > 0).sum(-1, keepdim=True)  # number of active coordinates, >= 1
    shift = css.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - shift).clamp_min(0)


def _kkt_inverse(gram: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """[M, K+1, K+1] (pseudo-)inverses of the KKT matrices of min b^T G b - 2 b^T r, sum b = 1,
    b_i = 0 off the support; gram: [K, K]; masks: [M, K] bool supports."""
    m = masks.to(gram.dtype)
    K = gram.shape[0]
    kkt = torch.zeros(masks.shape[0], K + 1, K + 1, dtype=gram.dtype)
    kkt[:, :K, :K] = gram * m[:, :, None] * m[:, None, :] + torch.diag_embed(1 - m)
    kkt[:, :K, K] = m
    kkt[:, K, :K] = m
    return torch.linalg.pinv(kkt)  # exact for the consistent systems met here, even if singular


def sum_to_one_fit(y: torch.Tensor, vertices: torch.Tensor) -> torch.Tensor:
    """[N, K] least-squares coefficients of y: [N, D] on vertices: [K, D] with sum beta = 1
    (no sign constraint). Needs affinely independent vertices."""
    V = vertices.double()
    inv = _kkt_inverse(V @ V.T, torch.ones(1, V.shape[0], dtype=torch.bool))[0]  # [K+1, K+1]
    K = V.shape[0]
    return (y.double() @ V.T) @ inv[:K, :K].T + inv[:K, K]


def simplex_lstsq(y: torch.Tensor, vertices: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """[N, K] exact argmin of ||y - V^T beta||^2 over the simplex, for y: [N, D], vertices: [K, D].

    Every support S gives the equality-constrained minimiser on S, linear in r = V y:
    (beta, lambda) = inv_S [r_S; 1], and its objective minus ||y||^2, -beta.r - lambda, is quadratic
    in r. The optimum is the feasible (beta >= 0) candidate of least objective. One matrix product
    of the features [r, r_i r_j] gives every candidate and its objective for all states at once;
    ``chunk`` states at a time keep the work in cache.
    """
    V = vertices.double()
    K = V.shape[0]
    if K > MAX_EXACT_K:
        raise AnalysisError(f"simplex_lstsq enumerates supports and takes K <= {MAX_EXACT_K} vertices, got {K}")
    codes = torch.arange(1, 2**K)
    masks = (codes[:, None] >> torch.arange(K)) & 1 == 1  # [M, K]
    M = len(masks)
    inv = _kkt_inverse(V @ V.T, masks)  # [M, K+1, K+1]
    m = masks.to(inv.dtype)
    A = inv[:, :K, :K] * m[:, :, None] * m[:, None, :]  # beta = A r + c (off-support r unused)
    c, ell, d = inv[:, :K, K] * m, inv[:, K, :K] * m, inv[:, K, K]  # lambda = ell.r + d
    i, j = torch.triu_indices(K, K)
    sym = A + A.transpose(1, 2)
    quad = -torch.where(i == j, sym[:, i, j] / 2, sym[:, i, j])  # [M, K(K+1)/2]: cost = -r'Ar - (c + ell).r - d
    weight = torch.cat(
        [
            torch.cat([A.permute(2, 0, 1).reshape(K, M * K), -(c + ell).T], 1),
            torch.cat([torch.zeros(len(i), M * K, dtype=inv.dtype), quad.T], 1),
        ]
    )  # [K + K(K+1)/2, M*K + M]
    bias = torch.cat([c.reshape(-1), -d])
    out = []
    for start in range(0, y.shape[0], chunk):
        r = y[start : start + chunk].double() @ V.T  # [n, K]
        sol = torch.addmm(bias, torch.cat([r, r[:, i] * r[:, j]], 1), weight)  # [n, M*K + M]
        cand, cost = sol[:, : M * K].view(-1, M, K), sol[:, M * K :]
        best = cost.masked_fill(cand.amin(-1) < -1e-10, torch.inf).argmin(1)
        out.append(cand.gather(1, best[:, None, None].expand(-1, 1, K)).squeeze(1).clamp_min(0))
    return torch.cat(out)


def residual_r2(y: torch.Tensor, fitted: torch.Tensor) -> float:
    """1 - SS_res / SS_tot over all entries of y: [N, D], SS_tot about the mean state of y."""
    y, fitted = y.double(), fitted.double()
    total = ((y - y.mean(0)) ** 2).sum()
    return float(1 - ((y - fitted) ** 2).sum() / total) if total > 0 else float("nan")

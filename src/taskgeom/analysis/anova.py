"""Two-way layout of states over cells (factor a, factor b): PAPER.md's P0 and P1.

P0 (stability): within-cell share of variance SS_within / SS_total, with the cell-means R^2 as its
complement. P1 (decoupling): share of the between-cell variance the additive model
``h ~ c + effect_a + effect_b`` explains, 1 - SS_interaction / SS_between. The additive fit is a
count-weighted least squares on the cell means, which equals the fit on the observations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TwoWay:
    """within_share: SS_within / SS_total; cell_r2 = 1 - within_share; additive_share: explained
    share of the between-cell SS; effect_a: [A, D] and effect_b: [B, D] additive effects, each
    centred (count-weighted over occupied cells); intercept: [D]."""

    within_share: float
    cell_r2: float
    additive_share: float
    effect_a: torch.Tensor
    effect_b: torch.Tensor
    intercept: torch.Tensor

    def effect(self, b: torch.Tensor) -> torch.Tensor:
        """[..., D] effect_b of factor levels b: [...] long."""
        return self.effect_b[b]


def two_way(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n_a: int, n_b: int) -> TwoWay:
    """h: [N, D] states; a: [N] in 0..n_a-1; b: [N] in 0..n_b-1."""
    h = h.double()
    cell = a * n_b + b
    counts = torch.bincount(cell, minlength=n_a * n_b).double()  # [A*B]
    sums = torch.zeros(n_a * n_b, h.shape[1], dtype=torch.float64).index_add_(0, cell, h)
    occupied = counts > 0
    means = sums[occupied] / counts[occupied, None]  # [C, D]
    total = ((h - h.mean(0)) ** 2).sum()
    within = ((h - (sums / counts.clamp_min(1)[:, None])[cell]) ** 2).sum()
    between = total - within

    cells = torch.nonzero(occupied).flatten()
    design = torch.cat(
        [torch.ones(len(cells), 1, dtype=torch.float64),
         torch.nn.functional.one_hot(cells // n_b, n_a).double(),
         torch.nn.functional.one_hot(cells % n_b, n_b).double()], dim=1)  # [C, 1 + A + B]
    weight = counts[occupied].sqrt()[:, None]
    coef = torch.linalg.lstsq(design * weight, means * weight, driver="gelsd").solution  # minimum-norm
    fitted = design @ coef
    interaction = (counts[occupied, None] * (means - fitted) ** 2).sum()

    w = counts[occupied] / counts.sum()
    effect_a = coef[1 : 1 + n_a] - (w[:, None] * coef[1 + cells // n_b]).sum(0)
    effect_b = coef[1 + n_a :] - (w[:, None] * coef[1 + n_a + cells % n_b]).sum(0)
    intercept = (w[:, None] * fitted).sum(0)
    share = float(within / total) if total > 0 else 0.0
    additive = float(1 - interaction / between) if between > 0 else 1.0
    return TwoWay(share, 1 - share, additive, effect_a.float(), effect_b.float(), intercept.float())


@dataclass(frozen=True)
class TaskLinear:
    """The continuous-input counterpart of ``TwoWay`` (E2: the token effect is a linear map of x_t).

    within_share: SS_res / SS_total of the full model ``h ~ per-task intercept + per-task linear
    map of x``; cell_r2 = 1 - within_share; additive_share: share of that model's explained SS the
    additive model ``h ~ c + effect_a + x @ effect_b`` keeps, 1 - (SS_res_add - SS_res_full) /
    SS_explained_full; effect_a: [A, D] task effects of the additive fit, centred (count-weighted);
    effect_b: [d, D] the shared map A; intercept: [D] so that intercept + effect_a[k] + x @ A is
    the additive fit."""

    within_share: float
    cell_r2: float
    additive_share: float
    effect_a: torch.Tensor
    effect_b: torch.Tensor
    intercept: torch.Tensor

    def effect(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] x @ A for x: [..., d]."""
        return x.to(self.effect_b.dtype) @ self.effect_b


def task_linear(h: torch.Tensor, a: torch.Tensor, x: torch.Tensor, n_a: int) -> TaskLinear:
    """h: [N, D] states; a: [N] in 0..n_a-1; x: [N, d] continuous inputs. Least squares throughout
    (minimum norm where a task is absent)."""
    h, x = h.double(), x.double()
    onehot = torch.nn.functional.one_hot(a, n_a).double()  # [N, A]
    ones = torch.ones(len(h), 1, dtype=torch.float64)
    full = (onehot[:, :, None] * torch.cat([ones, x], dim=1)[:, None, :]).reshape(len(h), -1)  # [N, A (1 + d)]
    additive = torch.cat([onehot, x], dim=1)  # [N, A + d]

    def residual_ss(design: torch.Tensor) -> tuple[float, torch.Tensor]:
        coef = torch.linalg.lstsq(design, h, driver="gelsd").solution
        return float(((h - design @ coef) ** 2).sum()), coef

    total = float(((h - h.mean(0)) ** 2).sum())
    res_full, _ = residual_ss(full)
    res_add, coef = residual_ss(additive)
    explained = total - res_full
    w = onehot.mean(0)  # task shares
    raw = coef[:n_a]
    intercept = (w[:, None] * raw).sum(0)
    share = res_full / total if total > 0 else 0.0
    kept = 1 - (res_add - res_full) / explained if explained > 0 else 1.0
    return TaskLinear(share, 1 - share, kept, (raw - intercept).float(), coef[n_a:].float(), intercept.float())

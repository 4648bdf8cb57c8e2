"""Two-way layout of states over cells (factor a, factor b): the study's P0 and P1.

Pooled (``two_way``, ``task_linear``): one fit over all the states given (the ``pooled-anova``
variant over the late window; the task vectors over their window). Per position
(``two_way_by_position``, ``task_linear_by_position``; docs/protocol.md): the same fit at each
position separately, vectorised over positions, so that the drift of mu_t is not within-cell variance.

P0 (stability): within-cell share of variance SS_within / SS_total, with the cell-means R^2 as its
complement. P1 (decoupling): share of the between-cell variance the additive model
``h ~ c + effect_a + effect_b`` explains, 1 - SS_interaction / SS_between. The additive fit is a
count-weighted least squares on the cell means, which equals the fit on the observations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """A fit of states on (task, current input), float64: within_share: the share of SS_total the full model
    leaves; cell_r2 = 1 - within_share; additive_share: the share of the full model's explained SS
    that the additive model keeps (P1); effect_a: [A, D] centred task effects; effect_b: the
    input's effects; intercept: [D]."""

    within_share: float
    cell_r2: float
    additive_share: float
    effect_a: torch.Tensor
    effect_b: torch.Tensor
    intercept: torch.Tensor


@dataclass(frozen=True)
class TwoWay(Layout):
    """Cells (factor a, factor b): the full model is the cell means, the additive one
    ``c + effect_a + effect_b``; effect_b: [B, D], centred (count-weighted over occupied cells)."""

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
        [
            torch.ones(len(cells), 1, dtype=torch.float64),
            torch.nn.functional.one_hot(cells // n_b, n_a).double(),
            torch.nn.functional.one_hot(cells % n_b, n_b).double(),
        ],
        dim=1,
    )  # [C, 1 + A + B]
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
    return TwoWay(share, 1 - share, additive, effect_a, effect_b, intercept)


@dataclass(frozen=True)
class TaskLinear(Layout):
    """The continuous-input counterpart of ``TwoWay`` (E2: the token effect is a linear map of x_t).
    The full model is ``h ~ per-task intercept + per-task linear map of x``, the additive one
    ``c + effect_a + x @ effect_b``; effect_b: [d, D] the shared map A; intercept + effect_a[k] +
    x @ A is the additive fit."""

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
    return TaskLinear(share, 1 - share, kept, raw - intercept, coef[n_a:], intercept)


@dataclass(frozen=True)
class Shares:
    """P0 and P1 at each position: within_share, additive_share: [T] float64 (as ``Layout``'s)."""

    within_share: torch.Tensor
    additive_share: torch.Tensor

    @property
    def cell_r2(self) -> torch.Tensor:
        """[T] 1 - within_share."""
        return 1 - self.within_share


def _shares(total: torch.Tensor, within: torch.Tensor, lost: torch.Tensor) -> Shares:
    """Shares from [T] SS_total, SS_within and the SS the additive model loses (interaction)."""
    between = total - within
    return Shares(
        torch.where(total > 0, within / total.clamp_min(1e-300), 0.0),
        torch.where(between > 0, 1 - lost / between.clamp_min(1e-300), 1.0),
    )


def two_way_by_position(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n_a: int, n_b: int) -> Shares:
    """``two_way`` at each position: h: [N, T, D]; a: [N] (the task); b: [N, T] (the current token)."""
    h = h.double()
    N, T, D = h.shape
    C = n_a * n_b
    index = (torch.arange(T) * C + a[:, None] * n_b + b).reshape(-1)  # [N*T], cell of each state within its position
    counts = torch.bincount(index, minlength=T * C).double().view(T, C)
    sums = torch.zeros(T * C, D, dtype=torch.float64).index_add_(0, index, h.reshape(-1, D)).view(T, C, D)
    means = sums / counts.clamp_min(1)[..., None]  # [T, C, D]
    total = (h - h.mean(0)).pow_(2).sum((0, 2))
    within = (h.reshape(-1, D) - means.reshape(-1, D)[index]).pow_(2).view(N, T, D).sum((0, 2))
    cells = torch.arange(C)
    design = torch.cat(
        [
            torch.ones(C, 1, dtype=torch.float64),
            torch.nn.functional.one_hot(cells // n_b, n_a).double(),
            torch.nn.functional.one_hot(cells % n_b, n_b).double(),
        ],
        dim=1,
    )  # [C, 1 + A + B]
    weight = counts.sqrt()[..., None]  # [T, C, 1]: empty cells weigh nothing
    coef = torch.linalg.lstsq(design * weight, means * weight, driver="gelsd").solution  # [T, 1 + A + B, D]
    lost = (counts[..., None] * (means - design @ coef) ** 2).sum((1, 2))
    return _shares(total, within, lost)


def task_linear_by_position(h: torch.Tensor, a: torch.Tensor, x: torch.Tensor, n_a: int) -> Shares:
    """``task_linear`` (E2's ANCOVA) at each position: h: [N, T, D]; a: [N]; x: [N, T, d]."""
    H, X = h.double().transpose(0, 1), x.double().transpose(0, 1)  # [T, N, D], [T, N, d]
    T, N, d = X.shape
    onehot = torch.nn.functional.one_hot(a, n_a).double().expand(T, N, n_a)
    with_one = torch.cat([torch.ones(T, N, 1, dtype=torch.float64), X], -1)  # [T, N, 1 + d]
    full = (onehot[..., None] * with_one[:, :, None]).reshape(T, N, n_a * (1 + d))
    additive = torch.cat([onehot, X], -1)  # [T, N, A + d]

    def residual(design: torch.Tensor) -> torch.Tensor:
        return (H - design @ torch.linalg.lstsq(design, H, driver="gelsd").solution).pow_(2).sum((1, 2))

    total = (H - H.mean(1, keepdim=True)).pow_(2).sum((1, 2))
    res_full = residual(full)
    return _shares(total, res_full, residual(additive) - res_full)

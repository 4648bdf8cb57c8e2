"""The study's properties P0-P3 of the M1 geometry, from states of major-task sequences.

Shapes: ``N`` sequences, ``T`` positions, ``D`` width, ``K`` major tasks, ``V`` tokens.

- P0/P1 (``by_position``, docs/protocol.md): the two-way layout over cells (task, current token)
  fitted at each position separately; for E2 the token effect is a linear map of the current
  example's x_t (an ANCOVA): P0 fits a per-task intercept and linear map of x_t, P1 the additive
  ``c + theta_task + A x_t``. ``pooled`` is the same layout pooled over a window (the
  ``pooled-anova`` variant); ``stability`` / ``stability_linear`` pool it over the task vectors'
  window to give the task vectors and nu.
- P2 (``interpolation``): ``y_t = h_t - mu_t - nu(x_t)`` (``nu(x) = A x`` for E2) fitted as ``sum_k beta_k theta_k`` with the
  sum-to-one fit projected onto the simplex; R^2_task over the states given (the caller passes the
  late window for the claim, single positions for the per-position curve), beside the same fit on
  randomly rotated vertices (a random subspace of the same dimension and the same geometry).
  The claims read r2_additive, the share of the variance of ``h_t`` about its per-position mean that
  the token effect and the task simplex explain: ``token_additive_r2`` for token families (the
  token effect nu(x_t) counts as explained), ``additive_r2`` for E2 (the task simplex plus a
  per-position linear map of x_t).
- P3 (``alignment``): per-state distances between beta_t and the exact posterior alpha_t (a written
  row); ``mean_alignment``, what the claim reads: per task and position, the mean beta over the
  task's sequences against the mean posterior; ``shrinkage`` compares distances early and late among
  the positions where the posterior is uncertain.

**[ours]** The vertices ``theta_k`` of P2 are the task effects of the two-way layout, centred over
the tasks, rather than the raw late-window task means: the raw means also carry each task's typical
token code, which P2 already removes through ``nu(x_t)``; with near-disjoint tasks (E1) the two
differ. Both span the task subspace S when tokens and tasks are balanced (E2's paired design makes
them equal). ``Fit.subspace`` is the one ``TaskSubspace`` that P2, steering, projection R^2, the
ablations, Theorem 2 and the probes all use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.analysis.measures.anova import (
    Layout,
    Shares,
    task_linear,
    task_linear_by_position,
    two_way,
    two_way_by_position,
)
from taskgeom.analysis.measures.simplex import project_simplex, residual_r2, simplex_lstsq, sum_to_one_fit
from taskgeom.analysis.measures.task_vectors import TaskSubspace, position_means, task_subspace, token_conditioned
from taskgeom.analysis.protocol import active


@dataclass(frozen=True)
class Fit:
    """The fitted M1 description of one (layer, site), which ``study.Geometry`` holds: layout: P0/P1
    fit on the late window (``TwoWay`` over tokens, or ``TaskLinear`` over continuous x_t);
    subspace: the task subspace whose theta [K, D] are the centred task effects of the layout
    (mu [T, D] as measured)."""

    layout: Layout
    subspace: TaskSubspace

    @property
    def nu(self) -> torch.Tensor:
        """[V, D] token encodings nu(a) (for ``TaskLinear``: [d, D], the map A)."""
        return self.layout.effect_b

    def residual(self, h: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """[N, T, D] y_t = h_t - mu_t - nu(x_t) for h: [N, T, D], inputs: [N, T] tokens or [N, T, d] x_t."""
        return h.double() - self.subspace.mu[: h.shape[1]] - self.layout.effect(inputs).double()


def stability(
    h: torch.Tensor, task: torch.Tensor, tokens: torch.Tensor, n_tasks: int, vocab: int, window: slice
) -> Fit:
    """P0 and P1 of h: [N, T, D] for sequences of task: [N], tokens: [N, T], over ``window``; the
    subspace also carries the token-conditioned vectors theta_{k,a} of the same late states."""
    late, cells = _late(h, task, window)
    late_tokens = tokens[:, window].reshape(-1)
    layout = two_way(late, cells, late_tokens, n_tasks, vocab)
    conditioned = token_conditioned(late, cells, late_tokens, n_tasks, vocab, layout.effect_a)
    return Fit(layout, task_subspace(layout.effect_a, position_means(h, task, n_tasks), window, conditioned))


def stability_linear(h: torch.Tensor, task: torch.Tensor, x: torch.Tensor, n_tasks: int, window: slice) -> Fit:
    """P0 and P1 of h: [N, T, D] when the current input is continuous, x: [N, T, d] (E2's x_t)."""
    late, cells = _late(h, task, window)
    layout = task_linear(late, cells, x[:, window].reshape(-1, x.shape[-1]), n_tasks)
    return Fit(layout, task_subspace(layout.effect_a, position_means(h, task, n_tasks), window))


def pooled(
    h: torch.Tensor, task: torch.Tensor, current: torch.Tensor, n_tasks: int, vocab: int | None, window: slice
) -> Layout:
    """The layout of h: [N, T, D] pooled over the states of ``window`` (the ``pooled-anova``
    variant): cells (task, token) for current: [N, T] tokens of ``vocab``, E2's ANCOVA for
    current: [N, T, d] x_t (vocab None)."""
    late, cells = _late(h, task, window)
    if vocab is None:
        return task_linear(late, cells, current[:, window].reshape(-1, current.shape[-1]), n_tasks)
    return two_way(late, cells, current[:, window].reshape(-1), n_tasks, vocab)


def by_position(h: torch.Tensor, task: torch.Tensor, current: torch.Tensor, n_tasks: int, vocab: int | None) -> Shares:
    """P0 and P1 of h: [N, T, D] at each position (docs/protocol.md; arguments as ``pooled``)."""
    if vocab is None:
        return task_linear_by_position(h, task, current, n_tasks)
    return two_way_by_position(h, task, current, n_tasks, vocab)


def _late(h: torch.Tensor, task: torch.Tensor, window: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Late-window states [N * W, D] and their task labels [N * W]."""
    late = h[:, window]
    return late.reshape(-1, h.shape[-1]), task[:, None].expand(-1, late.shape[1]).reshape(-1)


@dataclass(frozen=True)
class Interpolation:
    """beta: [N, T, K] projected sum-to-one fit at every position; raw: [N, T, K] float64 the fit
    before the projection; r2_task: its R^2 over the window;
    r2_exact: R^2 of the exact simplex least squares there; r2_random: [n_random] R^2 of the same
    fit on rotated vertices there; r2_by_position: [T] R^2_task of the states at each position."""

    beta: torch.Tensor
    raw: torch.Tensor
    r2_task: float
    r2_exact: float
    r2_random: torch.Tensor
    r2_by_position: torch.Tensor


def fit_beta(y: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """[..., K] sum-to-one least squares of y: [..., D] on theta: [K, D], projected onto the simplex."""
    flat = y.reshape(-1, y.shape[-1])
    return project_simplex(sum_to_one_fit(flat, theta)).reshape(*y.shape[:-1], theta.shape[0])


def random_rotation(dim: int, gen: torch.Generator) -> torch.Tensor:
    """[dim, dim] Haar-random orthogonal matrix (QR of a Gaussian with the sign fix)."""
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def interpolation(
    y: torch.Tensor, theta: torch.Tensor, window: slice, n_random: int = 8, seed: int = 0
) -> Interpolation:
    """P2 for y: [N, T, D] (``Fit.residual``) and theta: [K, D]: beta at every state, R^2 over
    the states of ``window`` (and per position)."""
    theta = theta.double()
    y = y.double()
    raw = sum_to_one_fit(y.reshape(-1, y.shape[-1]), theta).reshape(*y.shape[:-1], theta.shape[0])
    beta = project_simplex(raw)  # [N, T, K]
    fitted = beta @ theta
    late, late_fit = y[:, window].reshape(-1, y.shape[-1]), fitted[:, window].reshape(-1, y.shape[-1])
    exact = simplex_lstsq(late, theta)
    gen = torch.Generator().manual_seed(seed)
    random = []
    for _ in range(n_random):  # a handful of draws, each vectorised over all states
        rotated = theta @ random_rotation(theta.shape[1], gen)
        random.append(residual_r2(late, fit_beta(late, rotated) @ rotated))
    residual, total = ((y - fitted) ** 2).sum((0, 2)), ((y - y.mean(0)) ** 2).sum((0, 2))  # [T] each
    by_position = torch.where(total > 0, 1 - residual / total, torch.nan)
    return Interpolation(
        beta.float(),
        raw,
        residual_r2(late, late_fit),
        residual_r2(late, exact @ theta),
        torch.tensor(random),
        by_position,
    )


def token_additive_r2(h: torch.Tensor, y: torch.Tensor, fitted: torch.Tensor) -> torch.Tensor:
    """[T] the study's r2_additive for token families at each position (docs/protocol.md, "P2"): of
    the variance of h: [N, T, D] about its per-position mean, the share that the token effect and
    the task simplex explain, ``1 - sum_n |y - fitted|^2 / sum_n |h - mean_n h|^2`` with y: [N, T,
    D] = h - mu_t - nu(x_t) (``Fit.residual``) and fitted: [N, T, D] = beta theta, P2's simplex fit."""
    h = h.double()
    residual = ((y.double() - fitted.double()) ** 2).sum((0, 2))
    total = ((h - h.mean(0)) ** 2).sum((0, 2))
    return torch.where(total > 0, 1 - residual / total, torch.nan)


def random_token_additive_r2(
    h: torch.Tensor, y: torch.Tensor, theta: torch.Tensor, positions: slice, n_random: int, seed: int
) -> torch.Tensor:
    """[n_random] the mean over ``positions`` of ``token_additive_r2`` with the task vertices theta:
    [K, D] rotated at random (a random subspace of the same dimension and geometry, as P2's
    R^2_task compares), seeded by ``seed``."""
    theta, late_y, late_h = theta.double(), y[:, positions].double(), h[:, positions]
    gen = torch.Generator().manual_seed(seed)
    scores = []
    for _ in range(n_random):
        rotated = theta @ random_rotation(theta.shape[1], gen)
        scores.append(float(token_additive_r2(late_h, late_y, fit_beta(late_y, rotated) @ rotated).nanmean()))
    return torch.tensor(scores, dtype=torch.float64)


def cell_vectors(means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(theta: [K, D], nu: [A, D]) from the means: [E, A, K, D] of forced-token cells (A token values,
    K tasks) at E estimation positions, as the study's averaging R^2 estimates them (docs/protocol.md,
    "P2"): each position's cell means less their mean, averaged over the positions; theta the task
    marginals and nu the token marginals of that table, each less its grand mean (float64)."""
    means = means.double()
    pooled = (means - means.mean((1, 2), keepdim=True)).mean(0)  # [A, K, D]
    grand = pooled.mean((0, 1))
    return pooled.mean(0) - grand, pooled.mean(1) - grand


def cell_additive_r2(h: torch.Tensor, theta: torch.Tensor, nu: torch.Tensor) -> float:
    """The study's r2_additive of the forced-token cells h: [A, K, N, D] at one position,
    ``1 - sum |y - beta theta|^2 / sum |h - mu|^2`` over the states, with mu their mean, y = h -
    nu(a) - mu and beta the simplex fit of y on theta: [K, D] (``fit_beta``); nu: [A, D] the token
    values' effects (``cell_vectors``)."""
    h = h.double()
    flat = h.reshape(-1, h.shape[-1])
    mu = flat.mean(0)
    total = ((flat - mu) ** 2).sum()
    y = (h - nu.double()[:, None, None, :]).reshape(-1, h.shape[-1]) - mu
    residual = ((y - fit_beta(y, theta.double()) @ theta.double()) ** 2).sum()
    return float(1 - residual / total) if total > 0 else float("nan")


def additive_r2(y: torch.Tensor, task_part: torch.Tensor, x: torch.Tensor, window: slice) -> tuple[float, torch.Tensor]:
    """E2's P2 (the study's r2_additive): (over ``window``, [T] at each position) the share of the
    variance of y: [N, T, D] (``h - mu_t``) explained by task_part: [N, T, D] (``beta @ theta``,
    the simplex fit to y itself) plus a per-position linear map of x: [N, T, d] (no intercept)
    fitted by least squares to what the task part leaves: the two in turn, as the study's
    ``task_subspace_r2_at_position``; SS_tot about the mean state."""
    rest = (y.double() - task_part.double()).transpose(0, 1)  # [T, N, D]
    X = x.double().transpose(0, 1)  # [T, N, d]
    residual = (rest - X @ torch.linalg.lstsq(X, rest, driver="gelsd").solution).pow_(2).sum((1, 2))  # [T]
    y = y.double()
    total = ((y - y.mean(0)) ** 2).sum((0, 2))
    late = y[:, window].reshape(-1, y.shape[-1])
    late_total = ((late - late.mean(0)) ** 2).sum()
    r2 = float(1 - residual[window].sum() / late_total) if late_total > 0 else float("nan")
    return r2, torch.where(total > 0, 1 - residual / total, torch.nan)


def alignment(beta: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P3: (TV, KL(alpha || beta)), each [N, T], for beta, alpha: [N, T, K] on the simplex.

    beta is mixed with the protocol's ``kl_floor`` [ours] of the uniform law first, so KL stays finite when the projected
    fit puts exactly zero on a task.
    """
    beta, alpha = beta.double(), alpha.double()
    tv = 0.5 * (beta - alpha).abs().sum(-1)
    K = beta.shape[-1]
    floor = active().kl_floor
    smooth = (beta + floor / K) / (1 + floor)
    kl = torch.special.xlogy(alpha, alpha).sum(-1) - (alpha * smooth.log()).sum(-1)
    return tv, kl


@dataclass(frozen=True)
class MeanAlignment:
    """P3 as the claim reads it (docs/protocol.md): beta, alpha: [M, T, K] per major task m and
    position, the mean sum-to-one fit over the task's sequences projected onto the simplex, and
    the mean exact posterior; tv: [M, T] their total variation."""

    beta: torch.Tensor
    alpha: torch.Tensor
    tv: torch.Tensor


def mean_alignment(raw: torch.Tensor, alpha: torch.Tensor, task: torch.Tensor, n_tasks: int) -> MeanAlignment:
    """``MeanAlignment`` of raw: [N, T, K] (``Interpolation.raw``), alpha: [N, T, K] for sequences of
    task: [N] (each of 0..n_tasks-1 present). **[ours]** The mean is taken before the projection,
    as the study averages trajectories and then projects: the projected fit of the task's mean
    residual state, since the sum-to-one fit is affine."""
    onehot = torch.nn.functional.one_hot(task, n_tasks).double()  # [N, M]
    counts = onehot.sum(0)
    if (counts == 0).any():
        raise ValueError(
            f"no sequences of tasks {torch.nonzero(counts == 0).flatten().tolist()}: cannot average their beta"
        )

    def mean(values: torch.Tensor) -> torch.Tensor:  # [M, T, K]
        return torch.einsum("nm,ntk->mtk", onehot, values.double()) / counts[:, None, None]

    beta, target = project_simplex(mean(raw)), mean(alpha)
    return MeanAlignment(beta, target, 0.5 * (beta - target).abs().sum(-1))


@dataclass(frozen=True)
class Shrinkage:
    """P3.shrinks: mean TV over the first and the last quarter of the uncertain positions
    (``positions``, sorted); ``reason`` is set (and the means NaN) when there are too few."""

    positions: list[int]
    tv_first: float
    tv_last: float
    reason: str | None = None


def too_few_uncertain(count: int) -> str | None:
    """Why P3.shrinks does not apply with ``count`` uncertain positions (None when it does): fewer
    than the protocol's ``min_uncertain_positions``."""
    protocol = active()
    if count >= protocol.min_uncertain_positions:
        return None
    return (
        f"the posterior is uncertain (median max alpha_t < {protocol.uncertain_below}) at {count} position(s) only, "
        f"fewer than {protocol.min_uncertain_positions}"
    )


def shrinkage(tv: torch.Tensor, alpha: torch.Tensor) -> Shrinkage:
    """Compare the TV [N, T] early and late among the positions at which the posterior alpha:
    [N, T, K] is still uncertain (median over the N rows of max_k alpha_t below the protocol's
    ``uncertain_below``).
    **[ours]** The median makes "uncertain" a property of the position, so both quarters average
    the same rows. The claim passes P3's mean curves (``MeanAlignment``: one row per task, the
    mean posterior's largest weight deciding), so it asks whether the task-mean beta
    approaches the task-mean posterior while that posterior is still moving."""
    return uncertain_quarters(tv, alpha.double().amax(-1))


def uncertain_quarters(tv: torch.Tensor, top: torch.Tensor) -> Shrinkage:
    """``shrinkage`` from the TV [N, T] and the posterior's largest weight top: [N, T] (max_k alpha_t):
    the positions whose median over the N rows of ``top`` is below the protocol's ``uncertain_below``,
    and the mean TV over the first and the last quarter of them."""
    below = active().uncertain_below
    uncertain = torch.nonzero(top.double().median(0).values < below).flatten().tolist()
    if (reason := too_few_uncertain(len(uncertain))) is not None:
        return Shrinkage(uncertain, float("nan"), float("nan"), reason)
    quarter = max(1, round(len(uncertain) / 4))
    first, last = uncertain[:quarter], uncertain[-quarter:]
    return Shrinkage(uncertain, float(tv[:, first].double().mean()), float(tv[:, last].double().mean()))


def quantiles(x: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(median, lower quartile, upper quartile) of x along ``dim``."""
    q = torch.quantile(x.double(), torch.tensor([0.5, 0.25, 0.75], dtype=torch.float64), dim=dim)
    return q[0], q[1], q[2]

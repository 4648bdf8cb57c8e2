"""docs/protocol.md, "Orthogonal search": directions V outside the task and token subspaces whose
ablation ``h <- h - V V^T h`` hurts minor/OOD sequences most.

Shapes: ``D`` width, ``V`` tokens, ``m`` avoided directions, ``n = D - m`` free coordinates,
``r`` the rank of the search.

The protocol (the study's; our own choices marked **[ours]**):

- **Avoided span.** V is kept orthogonal to the span the caller gives: the probe's task subspace
  S (``analysis.measures.task_probe``), and for families that say so (``TaskFamily.v_avoids_tokens``: E3) also
  the token subspace (``token_subspace``: the directions holding 90% of the variance of the token
  effects ``nu``); ``avoid_basis`` joins them into one orthonormal basis.
- **Parametrisation.** ``V = C Q(A)``: C [D, n] an orthonormal basis of the complement of the
  avoided span, Q(A) the QR factor of a free matrix A [n, r] (the study's ``QR(U_orth W)``: the same
  span, as C is orthonormal).
- **Start.** A's columns are Gaussian, normalised to unit norm (``initial_coordinates``), drawn
  from ``rng.generator(seed, 0, "orthogonal-search")``.
- **Steps.** Each of at most ``steps`` (200) steps evaluates ``loss_fn(step, site)`` -- the loss on
  a fresh batch, batch ``step`` of the caller's search stream of minor/OOD sequences -- under the
  ablation at ``site`` and takes one Adam step (lr 0.01) of gradient *ascent* on it, the gradient
  of A clipped to norm 1.0. The caller sizes the batch: the protocol's ``search_batch`` (32) sequences is the
  protocol's. Model parameters are frozen during the search and their ``requires_grad`` flags
  restored afterwards, even on error; the model's train/eval mode is left as the caller set it.
- **Kept direction.** As the study's ``optimal_orth.py`` keeps it: the exponential moving average
  (decay ``average``, 0.995) of the raw parameter A, started at A_0 and updated after each Adam step
  (no bias correction), **taken at the step of the best smoothed loss** (A_0 until a first best),
  then orthonormalised by QR and mapped through C, so it is orthonormal and inside the complement.
  The average is taken in the complement's coordinates, which C maps isometrically, so it is the
  study's average of ``U_orth W``; orthogonality to the avoided span is exact up to the precision
  of C (float64).
- **Early stopping.** The loss is smoothed by an exponential moving average with weight
  ``smoothing`` (0.1) on the newest loss, started at the first loss; the search stops once that
  smoothed loss has not exceeded its best value for ``patience`` (30) consecutive steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from taskgeom.analysis.measures.subspace import complement_basis, direction_ablation
from taskgeom.analysis.protocol import active
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, intervene
from taskgeom.rng import generator


def token_subspace(nu: torch.Tensor, share: float | None = None, centre: bool = True) -> torch.Tensor:
    """[D, m] orthonormal directions holding ``share`` (the protocol's ``token_share`` when None) of the variance of the token effects
    nu: [V, D], rows centred first; m is the fewest principal directions whose variance reaches the
    share. For E2, nu is the linear map A: [d, D] and the effect of x_t is ``x_t A``: pass
    ``centre=False`` **[ours]**, so that its row space is used uncentred (the covariance of x A for
    isotropic x is A^T A; centring the rows would drop the direction of their mean)."""
    share = active().token_share if share is None else share
    if not 0 < share <= 1:
        raise AnalysisError(f"share must lie in (0, 1], got {share}")
    x = nu.double()
    if centre:
        x = x - x.mean(0)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    variance = s**2
    if variance.sum() <= 0:
        return nu.new_zeros(nu.shape[1], 0)
    cumulative = variance.cumsum(0) / variance.sum()
    m = int((cumulative < share - 1e-12).sum()) + 1
    return vh[:m].T.to(nu.dtype)


def avoid_basis(*bases: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """[D, m] orthonormal basis of the span of the given bases [D, k_i] (e.g. the task subspace S
    and the token subspace). The rank cut is explicit: directions whose singular value in the
    concatenation is below ``rtol`` (the protocol's ``rank_cut`` when None) times the largest are dropped, so
    overlapping bases count once."""
    if not bases:
        raise AnalysisError("avoid_basis needs at least one basis [D, k]")
    widths = {b.shape[0] for b in bases}
    if len(widths) != 1 or any(b.ndim != 2 for b in bases):
        raise AnalysisError(
            f"avoid_basis takes [D, k] bases of one width D, got shapes {[tuple(b.shape) for b in bases]}"
        )
    joined = torch.cat([b.double() for b in bases], 1)
    if joined.shape[1] == 0:
        return bases[0].new_zeros(bases[0].shape[0], 0)
    u, s, _ = torch.linalg.svd(joined, full_matrices=False)
    rtol = active().rank_cut if rtol is None else rtol
    rank = int((s > s.max() * rtol).sum()) if s.max() > 0 else 0
    return u[:, :rank].to(bases[0].dtype)


@dataclass(frozen=True)
class SearchResult:
    """directions: [D, rank] orthonormal, orthogonal to the avoided span; losses: the loss at each
    step run; steps: the number of steps run (fewer than asked when early stopping fired);
    best_step: the step (0-based) of the best smoothed loss, whose average of A was kept; start_weight:
    the random start's weight in that average (``average ** (best_step + 1)``)."""

    directions: torch.Tensor
    losses: list[float]
    steps: int
    best_step: int
    start_weight: float


def initial_coordinates(n: int, rank: int, seed: int) -> torch.Tensor:
    """[n, rank] the search's starting A (float64): Gaussian columns normalised to unit norm."""
    a = torch.randn(n, rank, generator=generator(seed, 0, "orthogonal-search"), dtype=torch.float64)
    return a / a.norm(dim=0, keepdim=True)


class _Ascent:
    """One search between steps: A and its Adam state, the moving averages and the early-stopping
    count (the protocol in this module's docstring)."""

    def __init__(self, site: Place, avoid: torch.Tensor, rank: int, seed: int, lr: float):
        D, m = avoid.shape
        n = D - m
        if not 1 <= rank <= n:
            raise AnalysisError(f"rank must lie in 1..{n} (width {D} minus {m} avoided directions), got {rank}")
        self.site, self.dtype = site, avoid.dtype
        self.complement = complement_basis(avoid.double().cpu()).to(avoid.device)  # [D, n] float64 (built on the CPU)
        work = torch.promote_types(avoid.dtype, torch.float32)
        self.coords = initial_coordinates(n, rank, seed).to(device=avoid.device, dtype=work).requires_grad_(True)
        self.c_work = self.complement.to(work)
        self.opt = torch.optim.Adam([self.coords], lr=lr)
        self.mean_a = self.coords.detach().double().clone()  # the moving average of the raw A, from A_0
        self.kept, self.best_step = self.mean_a, 0  # the average at the step of the best smoothed loss
        self.start_weight = self.kept_start_weight = 1.0  # A_0's weight in the average, now and in the kept one
        self.smoothed, self.best, self.stale, self.losses, self.stopped = None, -float("inf"), 0, [], False

    def step(
        self,
        model: nn.Module,
        loss_fn: Callable[[int, Place], torch.Tensor],
        step: int,
        positions: slice | torch.Tensor | None,
        clip: float,
        average: float,
        smoothing: float,
        patience: int,
    ) -> None:
        """Evaluate the loss of batch ``step`` under the ablation of the current iterate, take one
        Adam step of ascent and update the averages; ``stopped`` once early stopping fires."""
        q = torch.linalg.qr(self.coords)[0]
        with intervene(model, self.site, direction_ablation((self.c_work @ q).to(self.dtype)), positions):
            loss = loss_fn(step, self.site)
        self.opt.zero_grad()
        (-loss).backward()
        torch.nn.utils.clip_grad_norm_([self.coords], clip)
        self.opt.step()

        value = float(loss.detach())
        self.losses.append(value)
        self.mean_a = average * self.mean_a + (1 - average) * self.coords.detach().double()
        self.start_weight *= average
        self.smoothed = value if self.smoothed is None else smoothing * value + (1 - smoothing) * self.smoothed
        if self.smoothed > self.best:
            self.best, self.stale = self.smoothed, 0
            self.kept, self.best_step, self.kept_start_weight = self.mean_a, step, self.start_weight
        else:
            self.stale += 1
            self.stopped = self.stale >= patience

    def result(self) -> SearchResult:
        """The kept direction: the average of A at the best smoothed loss, orthonormalised, in the width's coordinates."""
        kept = self.complement @ torch.linalg.qr(self.kept)[0]
        return SearchResult(kept.to(self.dtype), self.losses, len(self.losses), self.best_step, self.kept_start_weight)


def orthogonal_searches(
    model: nn.Module,
    loss_fn: Callable[[int, Place], torch.Tensor],
    searches: Sequence[tuple[Place, torch.Tensor, int]],
    steps: int = 200,
    lr: float = 0.01,
    clip: float = 1.0,
    average: float = 0.995,
    smoothing: float = 0.1,
    patience: int = 30,
    seed: int = 0,
    positions: slice | torch.Tensor | None = None,
) -> list[SearchResult]:
    """For each search ``(site, avoid: [D, m], rank)``: directions orthogonal to span(avoid) whose
    ablation ``h <- h - V V^T h`` at ``site`` maximises the loss, by the protocol in this module's
    docstring; ``positions``: where the ablation acts (all positions by default; E2's separators in
    the dual analysis). One result per search, in order.

    loss_fn(step, site) -> scalar tensor: the model's loss on a fresh batch, batch ``step`` of the
    caller's search stream (the protocol's ``search_batch`` minor/OOD sequences), with the search's ablation in
    place at ``site``. The searches run in lockstep: at each step every search still running
    evaluates batch ``step`` in turn, so a caller can draw each batch, and run the unedited blocks
    before each site's layer (``states.LayerStreams``), once for all of them. A search's result is
    the one it would have alone. The ablated directions are cast to ``avoid``'s dtype and device,
    which should be those of the states at ``site``.
    """
    if steps < 1 or patience < 1 or not 0 < average < 1 or not 0 < smoothing <= 1:
        raise AnalysisError(
            f"need steps >= 1, patience >= 1, 0 < average < 1 and 0 < smoothing <= 1; got steps={steps}, "
            f"patience={patience}, average={average}, smoothing={smoothing}"
        )
    ascents = [_Ascent(site, avoid, rank, seed, lr) for site, avoid, rank in searches]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for step in range(steps):
            running = [ascent for ascent in ascents if not ascent.stopped]
            if not running:
                break
            for ascent in running:
                ascent.step(model, loss_fn, step, positions, clip, average, smoothing, patience)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return [ascent.result() for ascent in ascents]

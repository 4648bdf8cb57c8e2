"""E4's P0 as the study measures it (``compute_p1_variance_dyck`` and ``_compute_dyck_r2`` of its
``dyck/analysis/variance.py``, called by ``fig_dyck_combined.py``; docs/protocol.md, "E4").

Thirty bracket masks are drawn once and shared by the tasks: a mask says where the brackets stand
(a coin of ``p_bracket`` per position, the first 2n successes kept: the family's own placement).
For each (major task, mask) 2,048 sequences plant the task's string at the mask's places, noise
elsewhere. The state read is each block's ``resid_mid`` (the study hooks ``attn_block``) at the
position of bracket j itself, for the brackets every mask places before the last position. Per
bracket index j, a cell is the set of tasks whose last three planted brackets up to j agree; the
residual variance ratio is 1 - R^2 of those cells, R^2 = 1 - SS_within / SS_total summed over the
width, the within-cell sum holding each task's own variance and its mean's spread around the
cell's. The study plots the ratio per layer against j; the claim reads its median over j [ours].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading.states import collect
from taskgeom.rng import generator
from taskgeom.runs.folders import Run
from taskgeom.tasks.dyck import Dyck

# The protocol's (``active()``): dyck_p0_masks, fig_dyck_combined.py's --n-masks; dyck_p0_per_mask, its
# --batch-size, sequences per (task, mask); dyck_p0_prefix_k, its --prefix-k; dyck_p0_site, where
# variance.py hooks model.layers[l].attn_block
STREAM = "p0-masks"


def bracket_masks(family: Dyck, n_masks: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[M, T] bool: where each mask plants a bracket (a coin of p_bracket per position, the first
    2 * n_pairs successes kept), as the study's ``sample_binary_mask``."""
    coin = torch.rand(n_masks, seq_len, generator=gen, dtype=torch.float64) < family.p_bracket
    return coin & (coin.long().cumsum(dim=1) <= family.length)


def bracket_positions(masks: torch.Tensor) -> torch.Tensor:
    """[M, J] long: the positions of each mask's brackets before the last position, the first J,
    J the fewest any mask places there (the study's ``min_n_pos``)."""
    before_last = masks[:, :-1]
    n = int(before_last.sum(dim=1).min())
    order = torch.where(before_last, torch.arange(before_last.shape[1]), before_last.shape[1]).sort(dim=1).values
    return order[:, :n]


@dataclass(frozen=True)
class BracketMoments:
    """Sums over a task's sequences of the states at bracket j's own position, per layer:
    ``sums`` [L, K, J, D] and ``squares`` [L, K, J] (squared norms), float64; ``count`` sequences
    per task (masks x sequences per mask)."""

    sums: torch.Tensor
    squares: torch.Tensor
    count: int

    @property
    def means(self) -> torch.Tensor:
        """[L, K, J, D] each task's mean state."""
        return self.sums / self.count

    @property
    def variances(self) -> torch.Tensor:
        """[L, K, J] each task's variance summed over the width, clamped at 0 as the study does."""
        return (self.squares / self.count - self.means.pow(2).sum(-1)).clamp_min(0.0)


def bracket_moments(
    family: Dyck, model: torch.nn.Module, words: torch.Tensor, masks: torch.Tensor, per_mask: int, gen: torch.Generator
) -> BracketMoments:
    """The states' moments over ``per_mask`` sequences per (task, mask) for words: [K, 2n] and
    masks: [M, T] (``bracket_masks``), at every layer's protocol site (``dyck_p0_site``)."""
    positions = bracket_positions(masks)
    n_layers, K, (M, T), J = model.cfg.n_layers, words.shape[0], masks.shape, positions.shape[1]
    sites = [(layer, active().dyck_p0_site) for layer in range(n_layers)]
    sums = torch.zeros(n_layers, K, J, model.cfg.d_model, dtype=torch.float64)
    squares = torch.zeros(n_layers, K, J, dtype=torch.float64)
    for k in range(K):
        for m in range(M):
            noise = torch.randint(0, family.n_noise, (per_mask, T), generator=gen)
            tokens = family.plant(words[k].expand(per_mask, -1), masks[m].expand(per_mask, -1), noise)
            for layer, h in enumerate(collect(model, tokens, sites).values()):
                at = h[:, positions[m]].double()  # [B, J, D]
                sums[layer, k] += at.sum(dim=0)
                squares[layer, k] += at.pow(2).sum(dim=-1).sum(dim=0)
    return BracketMoments(sums, squares, M * per_mask)


def prefix_cells(words: torch.Tensor, j: int, prefix_k: int) -> list[list[int]]:
    """The tasks of words: [K, 2n] grouped by their brackets max(0, j + 1 - prefix_k)..j, in order of
    first appearance."""
    cells: dict[tuple[int, ...], list[int]] = {}
    for k, word in enumerate(words.tolist()):
        cells.setdefault(tuple(word[max(0, j + 1 - prefix_k) : j + 1]), []).append(k)
    return list(cells.values())


def residual_ratio(moments: BracketMoments, words: torch.Tensor, prefix_k: int | None = None) -> torch.Tensor:
    """[L, J] float64: 1 - R^2 of the prefix cells (of ``prefix_k`` brackets, the protocol's
    ``dyck_p0_prefix_k`` when None) at each layer and bracket index j, the study's
    ``_compute_dyck_r2`` (eps 1e-10 in the denominator)."""
    prefix_k = active().dyck_p0_prefix_k if prefix_k is None else prefix_k
    means, variances, n = moments.means, moments.variances, moments.count
    ratio = torch.empty(means.shape[0], means.shape[2], dtype=torch.float64)
    for j in range(means.shape[2]):
        at, var = means[:, :, j], variances[:, :, j]  # [L, K, D], [L, K]
        grand = at.mean(dim=1, keepdim=True)
        between = torch.zeros(means.shape[0], dtype=torch.float64)
        within = torch.zeros(means.shape[0], dtype=torch.float64)
        for tasks in prefix_cells(words, j, prefix_k):
            cell = at[:, tasks].mean(dim=1, keepdim=True)  # [L, 1, D]
            between += len(tasks) * n * (cell - grand).pow(2).sum(dim=(1, 2))
            within += n * var[:, tasks].sum(dim=1) + n * (at[:, tasks] - cell).pow(2).sum(dim=(1, 2))
        ratio[:, j] = within / (between + within + 1e-10)
    return ratio


def study_p0(run: Run, n_masks: int | None = None, per_mask: int | None = None) -> torch.Tensor:
    """[L, J] the residual variance ratio of ``run``'s major tasks (``residual_ratio``) at every
    layer's protocol site, on ``n_masks`` masks x ``per_mask`` sequences (the protocol's when None),
    the masks and the noise drawn from the run's seed."""
    protocol = active()
    n_masks = protocol.dyck_p0_masks if n_masks is None else n_masks
    per_mask = protocol.dyck_p0_per_mask if per_mask is None else per_mask
    family, cfg = run.family, run.config
    gen = generator(cfg.train.seed, 0, STREAM)
    masks = bracket_masks(family, n_masks, cfg.task.seq_len, gen)
    words = run.pool.params[: run.pool.n_major]
    return residual_ratio(bracket_moments(family, run.load_model(), words, masks, per_mask, gen), words)

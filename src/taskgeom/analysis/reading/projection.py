"""Projection R^2 of OOD states on the task subspace as the study's Fig. 4 measures it (docs/protocol.md), and its linear-code reference.

For every OOD task and every major task, the states of its sequences are averaged at each position;
each averaged state is centred by the per-position mean of the major means and regressed (no
intercept) on the K centred major means averaged over a block of positions (their span, rank K - 1);
R^2 = 1 - SS_res / SS_tot with SS_tot about the mean over coordinates, clipped to [0, 1], is averaged
over the block; the claims read its mean over the OOD tasks, with its standard error over tasks and
the interquartile range. No token
conditioning. The block: E1 every position but the last, E2 every x token (its analysed positions)
but the last, E3 the second half but the last (the study's blocks ``(0, -1)`` and ``(96, 191)`` of
192); a family of another kind reads E1's. The place: resid_post of the study's block 4 of 6 (E1,
E3, any other family), block 10 of 16 (E2), at the same relative depth (``Place.at_depth``).

The **linear-code reference** is the same statistic on the OOD-optimal learner's estimate
(``TaskFamily.ood_estimate``) in place of the states, from the same sequences: what a
representation that codes that estimate linearly would score.

Sequences belong to one task when they share their task parameters (``task_groups``), so the
sequences of ``heldout.sample_tasks`` (whole tasks) give task means, and any other batch one task
per sequence. Shapes: ``N`` sequences, ``G`` tasks, ``P`` analysed positions, ``D`` width, ``m`` the
estimate's size, ``J`` OOD tasks, ``K`` major tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from taskgeom.analysis.measures.properties import quantiles
from taskgeom.analysis.reading.sequences import Sequences, StudiedRun
from taskgeom.analysis.reading.states import stream_layers
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.tasks import Batch, TaskFamily

CHUNK = 512  # sequences per forward pass or estimate while the task means are summed


@dataclass(frozen=True)
class ProjectionR2:
    """One projection R^2 measurement: ``values`` [J] the block-averaged R^2 of each OOD task's mean
    state (the protocol, or the linear-code reference) or [N * W] of each OOD state of the late window
    (the ``per-sequence-r2`` variant); ``n_tasks`` OOD tasks of ``per_task`` sequences; ``place``
    (None for the reference); ``statistic``: "task-means" (the study's Fig. 4), "reference" (the
    linear-code reference) or "per-sequence" (the variant's)."""

    values: torch.Tensor
    n_tasks: int
    per_task: int
    place: Place | None
    statistic: str

    def __repr__(self) -> str:
        low, high = self.quartiles[0], self.quartiles[-1]
        where = "" if self.place is None else f" at {self.place}"
        return (
            f"ProjectionR2({self.statistic}{where}: mean {self.mean:.4g} (SE {self.standard_error:.2g}), quartiles {low:.4g}-{high:.4g} over "
            f"{self.values.numel()} values; {self.n_tasks} OOD tasks x {self.per_task} sequences)"
        )

    @property
    def mean(self) -> float:
        """The mean over OOD tasks (states): what the claims read."""
        return float(self.values.double().mean())

    @property
    def standard_error(self) -> float:
        """The standard error of ``mean`` over the OOD tasks (states): their standard deviation
        over the square root of their count (NaN for a single value)."""
        values = self.values.double().flatten()
        return float(values.std() / values.numel() ** 0.5) if values.numel() > 1 else float("nan")

    @property
    def quartiles(self) -> list[float]:
        """[lower, upper] quartile of the values: the band."""
        _, low, high = quantiles(self.values.flatten())
        return [float(low), float(high)]


def task_groups(batch: Batch) -> tuple[torch.Tensor, int]:
    """([N] long task index of each sequence, G): sequences sharing their params are one task, the
    tasks numbered in the order they first appear."""
    _, inverse = torch.unique(batch.params.reshape(batch.params.shape[0], -1), dim=0, return_inverse=True)
    n = len(inverse)
    first = torch.full((int(inverse.max()) + 1,), n).scatter_reduce(0, inverse, torch.arange(n), "amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(len(first))
    return rank[inverse], len(first)


def block(family: TaskFamily, n_positions: int) -> slice:
    """The analysed positions the R^2 is averaged over (the family's ``projection_window``)."""
    start, dropped = family.declared("projection_window")
    positions = slice(int(n_positions * start), n_positions - dropped)
    if positions.stop <= positions.start:
        raise AnalysisError(
            f"projection R^2 averages over a block of positions; {n_positions} analysed positions leave none"
        )
    return positions


def place(family: TaskFamily, n_layers: int) -> Place:
    """Where the claims read projection R^2 (module docstring)."""
    return Place.at_depth(*family.projection_block, n_layers)


def fig4_r2(ood: torch.Tensor, major: torch.Tensor, positions: slice) -> torch.Tensor:
    """[J] projection R^2 of the OOD task means ood: [J, P, D] on the major task means major: [K, P, D]
    (module docstring, in float64), averaged over ``positions``; a position where a centred mean is constant
    over coordinates (E2's reference before any example: the ridge weights are 0) has no R^2 and is
    left out of the average."""
    ood, major = ood.double(), major.double()
    mu = major.mean(0)  # [P, D] the per-position mean of the major means
    x = (ood - mu)[:, positions]  # [J, W, D]
    centred = (major - mu)[:, positions].mean(1)  # [K, D], summing to zero
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    basis = vh[: major.shape[0] - 1].T  # [D, K-1] their span, of explicit rank K - 1
    residual = x - x @ basis @ basis.T
    total = ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)  # about the mean over coordinates
    return (1 - (residual**2).sum(-1) / total).clamp(0, 1).nanmean(1)


def group_means(chunks: Iterator[tuple[slice, dict]], groups: torch.Tensor, n_groups: int) -> dict:
    """{key: [G, P, m] float64} the mean per task of each value of ``chunks``, pairs (rows, {key:
    [rows, P, m]}) that cover the sequences once."""
    total: dict = {}
    counts = torch.zeros(n_groups, dtype=torch.float64)
    for rows, values in chunks:
        index = groups[rows]
        counts.index_add_(0, index, torch.ones(len(index), dtype=torch.float64))
        for key, x in values.items():
            if key not in total:
                total[key] = torch.zeros(n_groups, *x.shape[1:], dtype=torch.float64)
            total[key].index_add_(0, index, x.to("cpu", torch.float64))
    return {key: value / counts[:, None, None] for key, value in total.items()}


def _chunks(n: int) -> Iterator[slice]:
    """The rows of ``n`` sequences, ``CHUNK`` at a time."""
    return (slice(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK))


def mean_states(run: StudiedRun, sequences: Sequences, places: Sequence[Place]) -> dict[Place, torch.Tensor]:
    """{place: [G, P, D]} the task means of the states at the analysed positions, a chunk of
    sequences at a time (with the run's edits in force)."""
    tokens, positions = sequences.batch.tokens, run.analysed_positions

    def states(rows: slice) -> dict[Place, torch.Tensor]:
        return {
            Place(layer, site): h[:, positions]
            for layer, found in stream_layers(run.model, tokens[rows], list(places))
            for site, h in found.items()
        }

    return group_means(((rows, states(rows)) for rows in _chunks(len(tokens))), *task_groups(sequences.batch))


def measure(run: StudiedRun, ood: Sequences, major: Sequences, places: Sequence[Place]) -> dict[Place, ProjectionR2]:
    """{place: the protocol's projection R^2} of the OOD tasks of ``ood`` on the major tasks of ``major``."""
    if ood.kind != "ood" or major.kind != "major":
        raise AnalysisError(
            f"projection R^2 reads OOD tasks against the major tasks, not {ood.kind} against {major.kind}"
        )
    if not places:
        raise AnalysisError("projection R^2 needs at least one place")
    n_tasks, per_task = task_sizes(ood.batch)
    ood_means, major_means = mean_states(run, ood, places), mean_states(run, major, places)
    positions = block(run.family, next(iter(ood_means.values())).shape[1])
    return {
        Place(*at): ProjectionR2(
            fig4_r2(ood_means[Place(*at)], major_means[Place(*at)], positions),
            n_tasks,
            per_task,
            Place(*at),
            "task-means",
        )
        for at in places
    }


def reference_unavailable(family: TaskFamily) -> str | None:
    """Why the linear-code reference cannot be computed for ``family`` (None when it can)."""
    if type(family).ood_estimate is TaskFamily.ood_estimate:
        return (
            f"the {family.name!r} family does not define ood_estimate (the OOD-optimal learner's estimate of the task)"
        )
    return None


def reference(family: TaskFamily, ood: Batch, major: Batch) -> ProjectionR2:
    """The linear-code reference: the protocol's statistic on ``family.ood_estimate`` of the same sequences."""
    if (reason := reference_unavailable(family)) is not None:
        raise AnalysisError(f"no linear-code reference: {reason}")
    means = [
        group_means(
            ((rows, {"estimate": family.ood_estimate(_rows(b, rows))}) for rows in _chunks(len(b.task))),
            *task_groups(b),
        )["estimate"]
        for b in (ood, major)
    ]
    return ProjectionR2(fig4_r2(*means, block(family, means[0].shape[1])), *task_sizes(ood), None, "reference")


def _rows(batch: Batch, rows: slice) -> Batch:
    """The sequences ``rows`` of a batch."""
    return Batch(*(None if x is None else x[rows] for x in (batch.tokens, batch.task, batch.params, batch.x, batch.y)))


def task_sizes(batch: Batch) -> tuple[int, int]:
    """(tasks, sequences per task) of a batch of whole tasks (the smallest group's size if they differ)."""
    groups, n_groups = task_groups(batch)
    return n_groups, int(torch.bincount(groups).min())

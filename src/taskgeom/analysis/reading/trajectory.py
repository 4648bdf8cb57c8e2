"""P3 as the study's trajectory figure computes it (docs/protocol.md, "P3";
``scripts/fig_beta_alpha_traj_combined.py`` -> ``traj_averaging_projection_plot``): the task vectors
are the averaging estimate (``averaged_task_vectors``: each major task's mean natural state over
its sequences and the estimation positions 40-59, less the mean over the tasks; the token effect is
not removed); at each plotted position 0-59, each sequence of the shown task (task 0) is centred by
the per-position mean over the majors and fitted on them with sum-to-one coefficients; the mean of
those coefficients, projected onto the simplex, is set against the mean exact posterior. Positions
that do not fit in the context are the same fractions of the study's span **[ours]**.

Shapes: ``N`` sequences, ``P`` analysed positions, ``D`` width, ``K`` major tasks, ``P'`` plotted positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from taskgeom.analysis.measures.simplex import project_simplex, sum_to_one_fit
from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading.steering import averaged_task_vectors


@dataclass(frozen=True)
class Trajectory:
    """positions: the plotted positions; estimation: the task vectors' positions; tasks: the shown
    tasks; beta, alpha: [len(tasks), P', K] the projected mean coefficients and the mean posterior;
    tv: [len(tasks), P'] their total variation; value: the mean of tv over the shown tasks and the
    last quarter of the plotted positions (the claim's reading **[ours]**)."""

    positions: tuple[int, ...]
    estimation: tuple[int, ...]
    tasks: tuple[int, ...]
    beta: torch.Tensor
    alpha: torch.Tensor
    tv: torch.Tensor

    def __repr__(self) -> str:
        return (
            f"Trajectory(P3 {self.value:.4g}: TV of task {list(self.tasks)}'s mean beta to its mean posterior, positions "
            f"{self.positions[self.late.start]}-{self.positions[-1]}; vectors from {self.estimation[0]}-{self.estimation[-1]})"
        )

    @property
    def late(self) -> slice:
        """The last quarter of the plotted positions (indices into ``positions``)."""
        n = len(self.positions)
        return slice(n - max(1, n // 4), n)

    @property
    def value(self) -> float:
        return float(self.tv[:, self.late].mean())


def study_positions(span: range, n_positions: int) -> tuple[int, ...]:
    """The positions of ``span`` (of the protocol's plotted span, the study's 0-59) in a context of
    ``n_positions``: as they are where the plotted span fits, else the same fractions of it."""
    plotted = active().trajectory_plotted
    if max(plotted) < n_positions:
        return tuple(span)
    return tuple(sorted({p * n_positions // len(plotted) for p in span}))


def trajectory(
    h: torch.Tensor, task: torch.Tensor, alpha: torch.Tensor, tasks: Sequence[int] | None = None
) -> Trajectory:
    """P3's trajectory (module docstring) of natural major states h: [N, P, D] of sequences of
    task: [N] with exact posterior alpha: [N, P, K]; ``tasks``: the protocol's ``trajectory_tasks``
    (the study's _TASK_IDS, task 0) when None; its positions the protocol's ``trajectory_estimation``
    and ``trajectory_plotted`` (the study's _ESTIM_POSITIONS 40-59 and _PLOT_POSITIONS 0-59)."""
    protocol = active()
    tasks = protocol.trajectory_tasks if tasks is None else tasks
    K, P = alpha.shape[-1], h.shape[1]
    estimation = study_positions(protocol.trajectory_estimation, P)
    plotted = study_positions(protocol.trajectory_plotted, P)
    theta, mu = averaged_task_vectors(h, task, K, estimation)
    betas, alphas = [], []
    for k in tasks:
        rows = task == k
        y = h[rows][:, list(plotted)].double() - mu[list(plotted)]  # [n, P', D]
        raw = sum_to_one_fit(y.reshape(-1, y.shape[-1]), theta).reshape(*y.shape[:2], K)
        betas.append(project_simplex(raw.mean(0)))
        alphas.append(alpha[rows][:, list(plotted)].double().mean(0))
    beta, mean_alpha = torch.stack(betas), torch.stack(alphas)
    return Trajectory(plotted, estimation, tuple(tasks), beta, mean_alpha, 0.5 * (beta - mean_alpha).abs().sum(-1))

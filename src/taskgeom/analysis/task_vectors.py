"""Task vectors (PAPER.md section 4): late-window means per task, centred to sum to zero, and the
per-position mean state ``mu_t`` over the major tasks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TaskVectors:
    """theta: [K, D], sums to zero over K; mu: [T, D] mean over tasks of each task's mean state at t;
    window: the late positions the task means are taken over."""

    theta: torch.Tensor
    mu: torch.Tensor
    window: slice

    @property
    def basis(self) -> torch.Tensor:
        """[D, r] orthonormal basis of the task subspace S = span(theta), r = rank (K - 1 generically)."""
        u, s, _ = torch.linalg.svd(self.theta.T.double(), full_matrices=False)
        rank = int((s > s.max() * 1e-6).sum())
        return u[:, :rank].to(self.theta.dtype)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """P_S h for h: [..., D]."""
        basis = self.basis
        return h @ basis @ basis.T


def late_window(seq_len: int, fraction: float = 0.25) -> slice:
    """The last ``fraction`` of positions (at least one)."""
    return slice(seq_len - max(1, round(fraction * seq_len)), seq_len)


def task_vectors(h: torch.Tensor, task: torch.Tensor, n_tasks: int, window: slice) -> TaskVectors:
    """h: [N, T, D] states of sequences whose task index is task: [N] in 0..n_tasks-1 (each present)."""
    onehot = torch.nn.functional.one_hot(task, n_tasks).to(h.dtype)  # [N, K]
    counts = onehot.sum(0)
    if (counts == 0).any():
        missing = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"no sequences of tasks {missing}: cannot form their task vectors")
    per_task = torch.einsum("nk,ntd->ktd", onehot, h) / counts[:, None, None]  # [K, T, D]
    mu = per_task.mean(0)  # [T, D]
    late = per_task[:, window].mean(1)  # [K, D]
    return TaskVectors(late - late.mean(0, keepdim=True), mu, window)

"""The shared protocol of latent-task sequence families.

A family has a prior over tasks, a sampler of sequences given a task, and exact Bayesian
quantities over any finite task pool. Shapes: ``B`` sequences, ``T`` positions, ``K`` pool tasks,
``V`` tokens. Everything at position ``t`` conditions on ``tokens[:, :t+1]``; a predictive at ``t``
is the distribution of ``tokens[:, t+1]``. Bayes computations run in float64.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from taskgeom.rng import generator

Subset = Literal["all", "major", "minor"]


@dataclass(frozen=True)
class TaskPool:
    """A finite pool of training tasks: ``n_major`` majors first, then the minors.

    params: [K, ...] task parameters; weights: [K] prior over the pool (sums to one).
    """

    params: torch.Tensor
    weights: torch.Tensor
    n_major: int

    @property
    def size(self) -> int:
        return self.params.shape[0]

    @property
    def n_minor(self) -> int:
        return self.size - self.n_major

    def subset(self, which: Subset) -> "TaskPool":
        """The majors or minors alone, with their prior renormalised."""
        if which == "all":
            return self
        index = slice(0, self.n_major) if which == "major" else slice(self.n_major, None)
        weights = self.weights[index]
        return TaskPool(self.params[index], weights / weights.sum(), self.n_major if which == "major" else 0)


@dataclass(frozen=True)
class Batch:
    """tokens: [B, T] long; task: [B] long index into the pool (-1 for OOD); params: [B, ...]."""

    tokens: torch.Tensor
    task: torch.Tensor
    params: torch.Tensor


def pool_weights(n_major: int, n_minor: int, p_minor: float) -> torch.Tensor:
    """[n_major + n_minor] prior: (1 - p_minor)/K per major and p_minor/N per minor."""
    if n_major < 1:
        raise ValueError(f"n_major must be >= 1, got {n_major}")
    if n_minor < 0:
        raise ValueError(f"n_minor must be >= 0, got {n_minor}")
    if not 0.0 <= p_minor < 1.0:
        raise ValueError(f"p_minor must lie in [0, 1), got {p_minor}")
    if n_minor == 0:
        return torch.full((n_major,), 1.0 / n_major, dtype=torch.float64)
    major = torch.full((n_major,), (1.0 - p_minor) / n_major, dtype=torch.float64)
    minor = torch.full((n_minor,), p_minor / n_minor, dtype=torch.float64)
    return torch.cat([major, minor])


def n_minor_for_diversity(k: int) -> int:
    """The study's diversity index: N_minor = 2**k, and k = -1 means majors only."""
    if k < -1:
        raise ValueError(f"diversity k must be >= -1, got {k}")
    return 0 if k == -1 else 2**k


class TaskFamily(ABC):
    """A latent-task family over a token vocabulary of size ``vocab_size``."""

    name: str
    vocab_size: int

    # ---- family-specific pieces -------------------------------------------------------------
    @abstractmethod
    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, ...] tasks drawn from the continuous prior."""

    @abstractmethod
    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """[B, T] long sequences, one per task in params: [B, ...]."""

    @abstractmethod
    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """[B, T, K] log p_k(tokens[:, t] | tokens[:, :t]) for each pool task k."""

    @abstractmethod
    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[B, T, V] sum_k weights[b, t, k] p_k(next | tokens[:, :t+1]); weights: [B, T, K]."""

    @abstractmethod
    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, V] posterior predictive under the continuous prior (the OOD-optimal learner)."""

    def major_params(self, n_major: int, gen: torch.Generator) -> torch.Tensor:
        """[n_major, ...] major tasks; by default draws from the prior."""
        return self.sample_params(n_major, gen)

    def initial_log_prob(self) -> float:
        """log p(tokens[:, 0]) under the prior, the same for every first token."""
        return -math.log(self.vocab_size)

    # ---- shared machinery -------------------------------------------------------------------
    def sample_pool(self, n_major: int, n_minor: int, p_minor: float = 0.1, seed: int = 0) -> TaskPool:
        """K majors then N minors (minors from the prior), with the study's mixture weights."""
        weights = pool_weights(n_major, n_minor, p_minor)
        gen = generator(seed, 0, "pool")
        majors = self.major_params(n_major, gen)
        params = torch.cat([majors, self.sample_params(n_minor, gen)]) if n_minor else majors
        return TaskPool(params, weights, n_major)

    def sample(
        self,
        pool: TaskPool,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        step: int = 0,
        stream: str = "train",
        subset: Subset = "all",
    ) -> Batch:
        """Sequences whose tasks are drawn from the pool prior (or uniformly within a subset)."""
        _check_sizes(batch_size, seq_len)
        gen = generator(seed, step, f"{stream}/{subset}")
        if subset == "all":
            task = torch.multinomial(pool.weights, batch_size, replacement=True, generator=gen)
        else:
            low, high = (0, pool.n_major) if subset == "major" else (pool.n_major, pool.size)
            if high <= low:
                raise ValueError(f"the pool has no {subset} tasks")
            task = torch.randint(low, high, (batch_size,), generator=gen)
        params = pool.params[task]
        return Batch(self.sample_tokens(params, seq_len, gen), task, params)

    def sample_ood(self, batch_size: int, seq_len: int, seed: int = 0, step: int = 0, stream: str = "ood") -> Batch:
        """Sequences of fresh tasks drawn from the prior, one per sequence (task = -1)."""
        _check_sizes(batch_size, seq_len)
        gen = generator(seed, step, stream)
        params = self.sample_params(batch_size, gen)
        tokens = self.sample_tokens(params, seq_len, gen)
        return Batch(tokens, torch.full((batch_size,), -1, dtype=torch.long), params)

    def log_posterior(self, tokens: torch.Tensor, pool: TaskPool) -> torch.Tensor:
        """[B, T, K] log posterior over the pool after tokens[:, :t+1]."""
        loglik = self.step_log_likelihood(tokens, pool.params.double()).cumsum(dim=1)
        return torch.log_softmax(loglik + pool.weights.double().log(), dim=-1)

    def predict_id(self, tokens: torch.Tensor, pool: TaskPool) -> torch.Tensor:
        """[B, T, V] Bayes next-token distribution: the posterior mixture over the pool."""
        return self.mix_predictive(tokens, pool.params.double(), self.log_posterior(tokens, pool).exp())

    def predict_task(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """[B, T, V] next-token distribution of each sequence's own task; params: [B, ...]."""
        batch = tokens.shape[0]
        onehot = torch.eye(batch, dtype=torch.float64).unsqueeze(1).expand(batch, tokens.shape[1], batch)
        return self.mix_predictive(tokens, params.double(), onehot)

    def log_marginal_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log p(tokens[:, :t+1]) under the continuous prior (sequential evidence)."""
        logp = self.predict_ood(tokens).log()
        step = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        first = torch.full_like(step[:, :1], self.initial_log_prob())
        return torch.cat([first, step], dim=1).cumsum(dim=1)


def _check_sizes(batch_size: int, seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")

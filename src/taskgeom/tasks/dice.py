"""E1, biased dice: a task is a face distribution z ~ Dirichlet(alpha); tokens are iid from z."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from taskgeom.rng import generator
from taskgeom.settings.fields import Int, PositiveFloat, Real, TokenTaskSettings
from taskgeom.tasks.base import TaskProbe, TokenFamily

Majors = Literal["dirichlet", "prior", "disjoint"]


class DiceSettings(TokenTaskSettings):
    vocab_size: Int = Field(6, ge=2)
    alpha: PositiveFloat = 1.0
    majors: Majors = "disjoint"
    floor: Real = Field(
        0.02, ge=0.0, description="majors disjoint: the weight of a major's other faces before normalising"
    )
    major_seed: Int = Field(42, description="majors dirichlet: the seed of the majors, the same in every run")

    @model_validator(mode="after")
    def _disjoint_majors_have_faces(self) -> "DiceSettings":
        if self.majors == "disjoint" and self.n_major > self.vocab_size:
            raise ValueError(
                f"task.majors disjoint gives each major task faces of its own: task.n_major ({self.n_major}) "
                f"must not exceed task.vocab_size ({self.vocab_size}); raise task.vocab_size or set task.majors=prior"
            )
        return self


class Dice(TokenFamily):
    """E1. params: [K, V] face probabilities.

    How the majors are made (the minors and OOD tasks always come from the prior, drawn per run):

    - ``"dirichlet"`` (the study's figures, ``major_pool_type="dirichlet"``): prior draws from the
      fixed ``major_seed``, so every run, seed and diversity has the same majors;
    - ``"prior"``: prior draws from the run's own pool seed;
    - ``"disjoint"`` (near-disjoint, in the study's code but none of its figures): the faces are split
      into ``n_major`` groups, each major is uniform on its own group with ``floor`` on every other
      face (then normalised).
    """

    name = "dice"
    Settings = DiceSettings
    vector_window = (100 / 128, 120 / 128)  # the study's positions 100-119 of 128
    p2_window = (110 / 128, 120 / 128)  # the last ten of the study's evaluation positions 0-119
    # the study's dice probe (coin/analysis/probes/_internals.py): no logit block, the position one-hot,
    # the posterior after the whole sequence at every position; fit from position 100 of the study's 128 on
    task_probe = TaskProbe(window=(100 / 128, 1.0), logits=False, positions=True, sequence_posterior=True)
    # the study's search probe (optimal_orth.py: _fit_coin_probe without n_major): the same regressors with
    # the whole-sequence posterior over every pool task, minors too
    search_probe = TaskProbe(
        window=(100 / 128, 1.0), logits=False, positions=True, sequence_posterior=True, every_pool_task=True
    )
    loss_from = 0  # the study's coin code averages L and every ablation's change over every prediction, the first too
    steering_form = "task"  # the study swaps per-position task vectors (positions 25-39)
    projection_window = (0.0, 2)  # positions 0 to T - 3: the T - 1 predicting positions less the last

    def __init__(self, vocab_size: int, alpha: float, majors: Majors, floor: float, major_seed: int = 42):
        self.vocab_size, self.alpha, self.majors, self.floor, self.major_seed = (
            vocab_size,
            alpha,
            majors,
            floor,
            major_seed,
        )

    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        gamma = torch._standard_gamma(torch.full((n, self.vocab_size), self.alpha, dtype=torch.float64), gen)
        return gamma / gamma.sum(-1, keepdim=True)

    def major_params(self, n_major: int, gen: torch.Generator) -> torch.Tensor:
        """[n_major, V]; ``gen`` (the run's pool generator) is drawn from by ``majors="prior"`` only."""
        if self.majors == "dirichlet":
            return self.sample_params(n_major, generator(self.major_seed, 0, "majors"))
        if self.majors == "prior":
            return self.sample_params(n_major, gen)
        if n_major > self.vocab_size:
            raise ValueError(f"disjoint majors need n_major <= vocab_size ({self.vocab_size}), got {n_major}")
        params = torch.full((n_major, self.vocab_size), self.floor, dtype=torch.float64)
        for k, faces in enumerate(np.array_split(np.arange(self.vocab_size), n_major)):
            params[k, torch.as_tensor(faces)] = 1.0
        return params / params.sum(-1, keepdim=True)

    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        return torch.multinomial(params.double(), seq_len, replacement=True, generator=gen)

    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return params.double().log().T[tokens]

    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return weights @ params.double()

    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        counts = F.one_hot(tokens, self.vocab_size).double().cumsum(dim=1) + self.alpha
        return counts / counts.sum(-1, keepdim=True)

    def ood_estimate(self, batch) -> torch.Tensor:
        """[B, T, V] the posterior-mean face probabilities after tokens[:, :t+1] (add-alpha counts)."""
        return self.predict_ood(batch.tokens)

"""E3, mixture of Markov chains: a task is a V x V transition matrix with Dirichlet(alpha) rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from taskgeom.settings.fields import Int, PositiveFloat, TokenTaskSettings
from taskgeom.tasks.base import TaskProbe, TokenFamily


class MarkovSettings(TokenTaskSettings):
    vocab_size: Int = Field(8, ge=2)
    alpha: PositiveFloat = 1.0


class Markov(TokenFamily):
    """E3. params: [K, V, V] transition rows P[k, from, to]; the first state is uniform [ours]."""

    name = "markov"
    Settings = MarkovSettings
    vector_window = (170 / 192, 190 / 192)  # the study's positions 170-189 of 192
    p2_window = (180 / 192, 190 / 192)  # the last ten of the study's evaluation positions 0-189
    p2_post_layernorm = True  # the study's P2 script reads E3's states after the next block's LayerNorm
    v_avoids_tokens = True  # the study's V for E3 avoids the token directions too (docs/protocol.md)
    # the study's latent-Markov probe (latent_markov/analysis/probes/_internals.py _fit_probe): the model's
    # logits and the position one-hot as nuisance blocks; fitted on positions 100-191 of 192
    task_probe = TaskProbe(window=(100 / 192, 1.0), logits=True, positions=True)
    # the study's search probe (optimal_orth.py: its own _fit_probe): the same, on positions 100-190 of 192
    search_probe = TaskProbe(window=(100 / 192, 191 / 192), logits=True, positions=True)
    steering_form = "subspace"
    projection_window = (0.5, 1)  # the second half less the last position (the study's block (96, 191) of 192)

    def __init__(self, vocab_size: int, alpha: float):
        self.vocab_size, self.alpha = vocab_size, alpha

    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        V = self.vocab_size
        gamma = torch._standard_gamma(torch.full((n, V, V), self.alpha, dtype=torch.float64), gen)
        return gamma / gamma.sum(-1, keepdim=True)

    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """Inverse-CDF sampling; the loop over positions is the chain's own recursion."""
        B, V = params.shape[0], self.vocab_size
        cdf = params.double().cumsum(-1)  # [B, V, V]
        u = torch.rand(B, seq_len, generator=gen, dtype=torch.float64)
        tokens = torch.empty(B, seq_len, dtype=torch.long)
        tokens[:, 0] = (u[:, 0] * V).long().clamp_max(V - 1)
        rows = torch.arange(B)
        for t in range(1, seq_len):
            row = cdf[rows, tokens[:, t - 1]]  # [B, V]
            tokens[:, t] = (u[:, t, None] > row).sum(-1).clamp_max(V - 1)
        return tokens

    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        logp = params.double().log()  # [K, V, V]
        trans = logp[:, tokens[:, :-1], tokens[:, 1:]].permute(1, 2, 0)  # [B, T-1, K]
        first = torch.full((tokens.shape[0], 1, params.shape[0]), self.initial_log_prob(), dtype=torch.float64)
        return torch.cat([first, trans], dim=1)

    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        mixed = (weights @ params.double().reshape(-1, V * V)).view(*tokens.shape, V, V)  # [B, T, V, V]
        return mixed.gather(2, tokens[..., None, None].expand(*tokens.shape, 1, V)).squeeze(2)

    def posterior_transitions(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, V, V] the posterior-mean transition matrix after tokens[:, :t+1]: add-alpha counts
        of the transitions so far, each row normalised."""
        V = self.vocab_size
        pairs = F.one_hot(tokens[:, :-1] * V + tokens[:, 1:], V * V).double()  # [B, T-1, V*V]
        counts = (
            torch.cat([torch.zeros_like(pairs[:, :1]), pairs], dim=1).cumsum(dim=1).view(*tokens.shape, V, V)
            + self.alpha
        )
        return counts / counts.sum(-1, keepdim=True)

    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        return (
            self.posterior_transitions(tokens).gather(2, tokens[..., None, None].expand(*tokens.shape, 1, V)).squeeze(2)
        )

    def ood_estimate(self, batch) -> torch.Tensor:
        """[B, T, V * V] the posterior-mean transition matrix (``posterior_transitions``), flattened row by row."""
        return self.posterior_transitions(batch.tokens).flatten(-2)

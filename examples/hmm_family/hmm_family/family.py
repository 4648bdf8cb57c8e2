"""A mixture of hidden Markov models: a task is an H x H transition matrix and an H x V emission
matrix, every row from a symmetric Dirichlet prior; the first hidden state is uniform.

params: [K, H, H + V] per task, the transition rows A[k, from, to] then the emission rows
E[k, state, token]. Exact likelihoods and predictives over a pool come from the forward algorithm
with normalised messages (float64). The OOD predictor is the Bayes predictive over a fixed bank of
``ood_bank`` prior draws (see ``HMM.predict_ood``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pydantic import Field

from taskgeom.rng import generator
from taskgeom.settings.fields import Int, PositiveFloat, PositiveInt, TokenTaskSettings
from taskgeom.tasks import TokenFamily
from taskgeom.tasks.base import TaskProbe

BANK_STREAM = "hmm/ood-bank"  # the bank is generator(0, 0, BANK_STREAM)'s draws: one bank for every run
BANK_CHUNK = 256  # bank draws per forward pass of the OOD predictor: its memory is [B, BANK_CHUNK, H]


class HMMSettings(TokenTaskSettings):
    """The ``task`` section of family ``hmm``: the constructor's arguments, with their defaults."""

    vocab_size: Int = Field(8, ge=2, description="V: emitted tokens")
    n_hidden: Int = Field(3, ge=2, description="H: hidden states")
    alpha_transition: PositiveFloat = 1.0
    alpha_emission: PositiveFloat = 1.0
    ood_bank: PositiveInt = Field(2048, description="M: prior draws of the OOD predictor's Monte Carlo bank")


class HMM(TokenFamily):
    """Mixture of HMMs. params: [K, H, H + V] = transition rows, then emission rows."""

    name = "hmm"
    Settings = HMMSettings
    plot_labels = (
        "ID-Bayes (pool posterior)",
        "OOD (Bayes over a prior bank)",
        "loss (nats / token)",
        "context position t",
    )
    # the ablations' probe: E3's construction (a token family whose tasks are inferred from transitions),
    # over the late half of the analysed positions
    task_probe = TaskProbe(window=(0.5, 1.0), logits=True, positions=True)
    steering_form = "subspace"  # E3's edit
    projection_window = (0.5, 1)  # E3's block: the second half, less the last position

    def __init__(self, vocab_size: int, n_hidden: int, alpha_transition: float, alpha_emission: float, ood_bank: int):
        self.vocab_size, self.n_hidden = vocab_size, n_hidden
        self.alpha_transition, self.alpha_emission = alpha_transition, alpha_emission
        self.bank = self.sample_params(ood_bank, generator(0, 0, BANK_STREAM))  # [M, H, H + V]

    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        H, V = self.n_hidden, self.vocab_size
        alpha = torch.cat(
            [
                torch.full((n, H, H), self.alpha_transition, dtype=torch.float64),
                torch.full((n, H, V), self.alpha_emission, dtype=torch.float64),
            ],
            dim=-1,
        )
        gamma = torch._standard_gamma(alpha, gen)
        return torch.cat([_rows(gamma[..., :H]), _rows(gamma[..., H:])], dim=-1)

    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """Inverse-CDF sampling of hidden states and tokens; the loop over positions is the chain's
        own recursion. u[:, t, 0] draws the hidden state at t, u[:, t, 1] its token."""
        B, H, V = params.shape[0], self.n_hidden, self.vocab_size
        trans_cdf, emit_cdf = (
            params[..., :H].double().cumsum(-1),
            params[..., H:].double().cumsum(-1),
        )  # [B, H, H], [B, H, V]
        u = torch.rand(B, seq_len, 2, generator=gen, dtype=torch.float64)
        rows = torch.arange(B)
        state = (u[:, 0, 0] * H).long().clamp_max(H - 1)
        tokens = torch.empty(B, seq_len, dtype=torch.long)
        for t in range(seq_len):
            if t:
                state = (u[:, t, 0, None] > trans_cdf[rows, state]).sum(-1).clamp_max(H - 1)
            tokens[:, t] = (u[:, t, 1, None] > emit_cdf[rows, state]).sum(-1).clamp_max(V - 1)
        return tokens

    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return torch.stack([log_step for log_step, _ in forward(tokens, params, self.n_hidden)], dim=1)

    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        emission = params.double()[..., self.n_hidden :]  # [K, H, V]
        steps = forward(tokens, params, self.n_hidden)
        return torch.stack(
            [_mix(next_state, weights[:, t].double(), emission) for t, (_, next_state) in enumerate(steps)], dim=1
        )

    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, V] Bayes predictive over the bank of M prior draws, each 1/M a priori [ours].

        The continuous-prior predictive p(x_{t+1} | x_<=t) = E[p_z(x_<=t) p_z(x_{t+1} | x_<=t)] /
        E[p_z(x_<=t)] (expectations over the prior) has no closed form for an HMM. Averages over M
        prior draws in place of both expectations make it self-normalised importance sampling
        with the prior as proposal: consistent as M grows, with an error that grows with t as the
        posterior narrows (fewer draws carry the weight). The bank is fixed, so the predictor is
        a deterministic function of the tokens. It runs over chunks of BANK_CHUNK draws, each
        chunk's posterior mixture weighted by its share of the evidence.
        """
        B, T = tokens.shape
        log_evidence = torch.full(
            (B, T), -torch.inf, dtype=torch.float64
        )  # log sum_k p_k(x_<=t) over the chunks so far
        mixture = torch.zeros(B, T, self.vocab_size, dtype=torch.float64)  # their posterior mixture
        for chunk in self.bank.split(BANK_CHUNK):
            chunk_evidence, chunk_mixture = _posterior_mixture(tokens, chunk, self.n_hidden)
            total = torch.logaddexp(log_evidence, chunk_evidence)
            mixture = (
                mixture * (log_evidence - total).exp()[..., None]
                + chunk_mixture * (chunk_evidence - total).exp()[..., None]
            )
            log_evidence = total
        return mixture

    def bayes_memory(self, seq_len: int, pool_size: int) -> int:
        """Bytes per sequence (float64): the pool's log-likelihoods, their cumulative sums and its
        posterior (3 per task and position); per pool task and per draw of a bank chunk, what the
        forward pass and the mixing hold at once (10 [H] vectors: messages, joints, the batched
        matmul's layout copies, weighted messages; 4 numbers: steps, log-weights, weights); per
        position, the ID predictive and the bank's chunk and running mixtures, each held twice
        while stacked or combined (7 [V] vectors and 4 evidence values). README: against RSS."""
        H, V, chunk = self.n_hidden, self.vocab_size, min(BANK_CHUNK, self.bank.shape[0])
        per_task = 10 * H + 4
        return 8 * (3 * seq_len * pool_size + per_task * (pool_size + chunk) + seq_len * (7 * V + 4))


def forward(tokens: torch.Tensor, params: torch.Tensor, n_hidden: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The forward algorithm with normalised messages, one position at a time (float64).

    tokens: [B, T]; params: [K, H, H + V]. Yields for each t: (log p_k(x_t | x_<t) [B, K],
    p_k(z_{t+1} | x_<=t) [B, K, H]); the first hidden state is uniform.
    """
    params = params.double()
    transition, by_token = (
        params[..., :n_hidden],
        params[..., n_hidden:].permute(2, 0, 1).contiguous(),
    )  # [K, H, H], [V, K, H]
    state = torch.full(
        (tokens.shape[0], params.shape[0], n_hidden), 1.0 / n_hidden, dtype=torch.float64
    )  # p_k(z_t | x_<t)
    for t in range(tokens.shape[1]):
        joint = by_token[tokens[:, t]].mul_(state)  # [B, K, H]: p_k(z_t, x_t | x_<t)
        step = joint.sum(-1)  # [B, K]
        state = torch.einsum("bkh,khj->bkj", joint.div_(step[..., None]), transition)
        yield step.log(), state


def _posterior_mixture(tokens: torch.Tensor, params: torch.Tensor, n_hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log sum_k p_k(x_<=t) [B, T], sum_k w_k(t) p_k(x_{t+1} | x_<=t) [B, T, V]) for the tasks params:
    [K, H, H + V] with weights w_k(t) proportional to p_k(x_<=t), in one forward pass. The outputs
    are allocated before the pass (small tensors kept between the pass's large transient ones would
    fragment the heap: several times the memory, measured)."""
    emission = params[..., n_hidden:]  # [K, H, V]
    log_weight = torch.zeros(tokens.shape[0], params.shape[0], dtype=torch.float64)  # [B, K]
    evidence = torch.empty(tokens.shape, dtype=torch.float64)
    mixture = torch.empty(*tokens.shape, emission.shape[-1], dtype=torch.float64)
    for t, (log_step, next_state) in enumerate(forward(tokens, params, n_hidden)):
        log_weight += log_step
        evidence[:, t] = log_weight.logsumexp(-1)
        mixture[:, t] = _mix(next_state, torch.softmax(log_weight, dim=-1), emission)
    return evidence, mixture


def _mix(next_state: torch.Tensor, weights: torch.Tensor, emission: torch.Tensor) -> torch.Tensor:
    """[B, V] sum_k weights[b, k] p_k(next token): next_state [B, K, H], weights [B, K], emission [K, H, V]."""
    B, K, H = next_state.shape
    return (next_state * weights[..., None]).reshape(B, K * H) @ emission.reshape(K * H, -1)


def _rows(gamma: torch.Tensor) -> torch.Tensor:
    """Gamma draws [..., n] normalised to Dirichlet rows."""
    return gamma / gamma.sum(-1, keepdim=True)

"""E4, planted Dyck language: a task is one balanced bracket string, planted in order among noise.

Tokens: ``0 .. n_noise-1`` noise, ``n_noise`` = "(", ``n_noise + 1`` = ")". A task's params are its
bracket string, ``[2 * n_pairs]`` long with 0 = "(" and 1 = ")". At every position the task's next
bracket is emitted with probability ``p_bracket`` until all ``2 * n_pairs`` are placed, otherwise a
uniform noise token. Brackets and noise are told apart by the token, so the number of brackets
placed so far is observed; what is hidden is which string is being planted.

There is no compact sufficient statistic: the ID-Bayes predictor needs the whole bracket prefix
(which pool strings agree with it) and the OOD-optimal one (a fresh uniform Dyck word) needs the
depth and the count, through the number of Dyck completions of the prefix.
"""

from __future__ import annotations

import torch
from pydantic import Field

from taskgeom.settings.fields import Int, PositiveInt, Real, TokenTaskSettings
from taskgeom.tasks.base import TaskPool, TokenFamily

OPEN, CLOSE = 0, 1


def completion_counts(n_pairs: int) -> torch.Tensor:
    """[2n + 1, 2n + 2] float64 table N[r, d]: the number of bracket strings of length r that take
    depth d back to 0 without going below 0 (ballot numbers; N[2n, 0] is the Catalan number).
    A reference for tests: from n_pairs = 518 the counts overflow float64 (Catalan(600) is about
    1e357); the family uses only their ratios, through ``open_probability``."""
    length = 2 * n_pairs
    table = torch.zeros(length + 1, length + 2, dtype=torch.float64)
    table[0, 0] = 1.0
    for r in range(1, length + 1):
        table[r, :-1] = table[r - 1, 1:]  # open one more: d -> d + 1
        table[r, 1:] += table[r - 1, :-1]  # close one: d -> d - 1
    return table


def open_probability(remaining: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """float64, shape of the inputs: N[r - 1, d + 1] / N[r, d], the chance that a uniform
    completion of ``remaining`` = r brackets from ``depth`` = d opens next; 0.5 where no
    completion exists (d < 0, d > r, or r - d odd) [ours].

    The ballot number N[r, d] = C(r, o) (d + 1) / (o + d + 1) with o = (r - d) / 2 opens left, so
    the ratio is o (d + 2) / (r (d + 1)): exact and finite for every size, where the counts
    themselves overflow float64 (n_pairs = 600 made them inf and the OOD-Bayes loss NaN)."""
    r, d = remaining.double(), depth.double()
    exists = (depth >= 0) & (depth <= remaining) & ((remaining - depth) % 2 == 0) & (remaining >= 1)
    opens = (r - d) / 2
    ratio = opens * (d + 2) / (r.clamp_min(1) * (d + 1).clamp_min(1))
    return torch.where(exists, ratio, 0.5)


class DyckSettings(TokenTaskSettings):
    n_noise: Int = Field(7, ge=1)
    n_pairs: PositiveInt = 10
    p_bracket: Real = Field(0.25, gt=0.0, lt=1.0)


class Dyck(TokenFamily):
    """E4. params: [K, 2 * n_pairs] long bracket strings (0 = "(", 1 = ")")."""

    name = "dyck"
    Settings = DyckSettings

    def __init__(self, n_noise: int, n_pairs: int, p_bracket: float):
        self.n_noise, self.n_pairs, self.p_bracket = n_noise, n_pairs, p_bracket
        self.vocab_size = n_noise + 2

    @property
    def length(self) -> int:
        """Brackets per task: 2 * n_pairs."""
        return 2 * self.n_pairs

    # ---- the prior: uniform Dyck words ------------------------------------------------------
    def sample_params(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, 2 * n_pairs] uniform Dyck words: each bracket is "(" with probability
        N[r - 1, d + 1] / N[r, d] (r brackets left, depth d; ``open_probability``), which makes
        every word equally likely."""
        words = torch.empty(n, self.length, dtype=torch.long)
        depth = torch.zeros(n, dtype=torch.long)
        u = torch.rand(n, self.length, generator=gen, dtype=torch.float64)
        for i in range(self.length):  # the loop is over bracket slots, vectorised over words
            p_open = open_probability(torch.full_like(depth, self.length - i), depth)
            bracket = (u[:, i] >= p_open).long()
            words[:, i] = bracket
            depth = depth + 1 - 2 * bracket
        return words

    # ---- sequences ----------------------------------------------------------------------------
    def sample_tokens(self, params: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """[B, T]: one emit/noise coin per position; the i-th emitted slot carries bracket i."""
        B = params.shape[0]
        coin = torch.rand(B, seq_len, generator=gen, dtype=torch.float64) < self.p_bracket
        noise = torch.randint(0, self.n_noise, (B, seq_len), generator=gen)
        return self.plant(params, coin, noise)

    def plant(self, params: torch.Tensor, coin: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """[B, T] tokens: the i-th success of coin: [B, T] bool carries bracket i of params: [B, 2n]
        while any is left, noise: [B, T] stands everywhere else."""
        index = coin.long().cumsum(dim=1) - 1  # [B, T] which bracket a coin success would carry
        emit = coin & (index < self.length)
        bracket = params.long().gather(1, index.clamp(0, self.length - 1))
        return torch.where(emit, self.n_noise + bracket, noise)

    def bracket_count(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] number of brackets among tokens[:, :t+1]."""
        return (tokens >= self.n_noise).long().cumsum(dim=1)

    def planted(self, tokens: torch.Tensor, back: int) -> torch.Tensor:
        """[B, T] the ``back``-th most recent bracket among tokens[:, :t+1] (1 = the latest),
        0 = "(", 1 = ")", -1 where fewer than ``back`` brackets have been placed."""
        B, T = tokens.shape
        is_bracket = tokens >= self.n_noise
        count = is_bracket.long().cumsum(dim=1)
        # order[b, i]: the position of the i-th bracket of sequence b (T where there is none)
        position = torch.arange(T).expand(B, T)
        order = torch.where(is_bracket, position, T).sort(dim=1).values
        slot = count - back  # [B, T] index of the wanted bracket in order
        where = order.gather(1, slot.clamp_min(0)).clamp_max(T - 1)
        value = tokens.gather(1, where) - self.n_noise
        return torch.where(slot >= 0, value, -1)

    def depth(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] bracket depth (opens minus closes) after tokens[:, :t+1]."""
        step = (tokens == self.n_noise + OPEN).long() - (tokens == self.n_noise + CLOSE).long()
        return step.cumsum(dim=1)

    # ---- exact Bayes quantities ---------------------------------------------------------------
    def _next_bracket(self, params: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """[B, T, K] the bracket each task plants next when ``before``: [B, T] are already placed."""
        return params.long()[:, before.clamp_max(self.length - 1)].permute(1, 2, 0)

    def step_log_likelihood(self, tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """-inf where a task would not plant the observed bracket (wrong type, or none left)."""
        count = self.bracket_count(tokens)
        before = count - (tokens >= self.n_noise).long()  # [B, T] brackets before position t
        pending = (before < self.length)[..., None]  # [B, T, 1]
        log = lambda x: torch.tensor(x, dtype=torch.float64).log()  # noqa: E731
        noise_ll = torch.where(pending, log((1 - self.p_bracket) / self.n_noise), log(1 / self.n_noise))
        agrees = self._next_bracket(params, before) == (tokens - self.n_noise)[..., None]
        bracket_ll = torch.where(agrees & pending, log(self.p_bracket), log(0.0))
        return torch.where((tokens < self.n_noise)[..., None], noise_ll, bracket_ll)

    def log_posterior(self, tokens: torch.Tensor, pool: TaskPool) -> torch.Tensor:
        """[B, T, K] log posterior over the pool. Where no pool task can have produced the context
        (an OOD bracket string), the posterior is undefined; we keep the last defined one (the
        prior if there is none) [ours], so the result never holds NaN."""
        loglik = self.step_log_likelihood(tokens, pool.params).cumsum(dim=1)
        logprior = pool.weights.double().log()
        joint = loglik + logprior
        defined = torch.isfinite(joint).any(-1)  # [B, T], true on a prefix of positions
        post = torch.log_softmax(torch.where(defined[..., None], joint, 0.0), dim=-1)
        prior = logprior.expand(tokens.shape[0], 1, -1)
        last = torch.where(defined, torch.arange(tokens.shape[1]), -1).cummax(dim=1).values + 1  # [B, T]
        padded = torch.cat([prior, post], dim=1)  # [B, T + 1, K]
        return padded.gather(1, last[..., None].expand(-1, -1, pool.size))

    def _predictive(self, tokens: torch.Tensor, p_open: torch.Tensor) -> torch.Tensor:
        """[B, T, V] from p_open: [B, T], the chance that the next bracket is "(" given one is due."""
        pending = self.bracket_count(tokens) < self.length  # [B, T]
        p = torch.where(pending, torch.tensor(self.p_bracket, dtype=torch.float64), 0.0)  # not float32
        noise = ((1 - p) / self.n_noise)[..., None].expand(*tokens.shape, self.n_noise)
        return torch.cat([noise, (p * p_open)[..., None], (p * (1 - p_open))[..., None]], dim=-1)

    def mix_predictive(self, tokens: torch.Tensor, params: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        opens = (params.long() == OPEN).double()  # [K, 2n]
        by_slot = weights.double() @ opens  # [B, T, 2n] weight of tasks with "(" at each slot
        slot = self.bracket_count(tokens).clamp_max(self.length - 1)
        return self._predictive(tokens, by_slot.gather(-1, slot[..., None]).squeeze(-1))

    def predict_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """Predictive under a fresh uniform Dyck word: the next bracket is "(" with probability
        N[r - 1, d + 1] / N[r, d] (``open_probability``, finite for every n_pairs). A bracket
        prefix that no Dyck word extends (never produced by the family) gets an even split [ours]."""
        depth = self.depth(tokens)
        remaining = self.length - self.bracket_count(tokens)
        valid = depth.cummin(dim=1).values >= 0  # a prefix that once went below 0 stays invalid
        p_open = torch.where(valid, open_probability(remaining, depth), 0.5)
        return self._predictive(tokens, p_open)

    def initial_log_prob(self) -> float:
        raise NotImplementedError("in E4 the first token's probability depends on the token: see first_token_probs")

    def first_token_probs(self) -> torch.Tensor:
        """[V] distribution of tokens[:, 0]: every Dyck word opens with "("."""
        probs = torch.full((self.vocab_size,), (1 - self.p_bracket) / self.n_noise, dtype=torch.float64)
        probs[self.n_noise + OPEN], probs[self.n_noise + CLOSE] = self.p_bracket, 0.0
        return probs

    def log_marginal_ood(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log p(tokens[:, :t+1]) under a fresh uniform Dyck word."""
        first = self.first_token_probs().log()[tokens[:, :1]]  # [B, 1]
        step = self.predict_ood(tokens).log()[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([first, step], dim=1).cumsum(dim=1)

"""Causal steering (PAPER.md section 4): replace the task component of the states at one site by a
chosen point ``a`` of the simplex and compare the model's next-token law with the target mixture
``sum_k a_k p_k(. | context)``.

The edit is ``h' = h - P_S h + P_S (sum_k a_k W_k + U(x_t))``: the part of h in the task subspace S
is replaced by what an additive code ``W, U`` predicts for task mixture ``a`` and the current token.
**[ours]** The token term restores the footprint of the current token in S, which the paper's
``h - P_S h + sum_k a_k W_k`` would erase; the codes come from the two-way layout
(``code_from_layout``, task vectors, the default) or a joint regression of h on
[posterior, one-hot token] (``code_from_regression``). The control moves each state by a random
direction of the same norm as its steering displacement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from taskgeom.analysis.anova import TwoWay
from taskgeom.hooks import Site, intervene
from taskgeom.tasks import TaskFamily

Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AdditiveCode:
    """state ~ sum_k a_k centre[k] + token[x]; centre: [K, D], token: [V, D]."""

    centre: torch.Tensor
    token: torch.Tensor

    def state(self, a: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, D] for mixtures a: [B, K] and tokens: [B, T]."""
        return (a.to(self.centre.dtype) @ self.centre)[:, None] + self.token[tokens]


def code_from_layout(layout: TwoWay) -> AdditiveCode:
    """The additive fit of the two-way layout: centre_k = intercept + theta_k, token = nu."""
    return AdditiveCode(layout.intercept + layout.effect_a, layout.effect_b)


def code_from_regression(h: torch.Tensor, alpha: torch.Tensor, tokens: torch.Tensor, vocab: int) -> AdditiveCode:
    """Least squares h ~ alpha @ W + onehot(x) @ U (minimum norm; the split of a shared constant
    between W and U does not change any edit). h: [M, D]; alpha: [M, K]; tokens: [M]."""
    design = torch.cat([alpha.double(), torch.nn.functional.one_hot(tokens, vocab).double()], dim=1)
    coef = torch.linalg.lstsq(design, h.double(), driver="gelsd").solution  # [K + V, D]
    K = alpha.shape[1]
    return AdditiveCode(coef[:K].float(), coef[K:].float())


def steer_edit(basis: torch.Tensor, code: AdditiveCode, a: torch.Tensor, tokens: torch.Tensor) -> Edit:
    """The edit h -> h - P_S h + P_S code.state(a, tokens); basis: [D, r] orthonormal; a: [B, K];
    tokens: [B, T'] at the edited positions."""
    target = code.state(a, tokens) @ basis  # [B, T', r]

    def edit(h: torch.Tensor) -> torch.Tensor:
        return h + (target - h @ basis) @ basis.T

    return edit


def random_edit(edit: Edit, gen: torch.Generator) -> Edit:
    """Move each state by a uniformly random direction, its length that of ``edit``'s displacement."""

    def control(h: torch.Tensor) -> torch.Tensor:
        norm = (edit(h) - h).norm(dim=-1, keepdim=True)
        direction = torch.randn(h.shape, generator=gen, dtype=h.dtype)
        return h + norm * direction / direction.norm(dim=-1, keepdim=True)

    return control


def kl_rows(logp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[...] KL(model || target) for model log-probabilities logp and target probabilities: [..., V]."""
    logp = logp.double()
    return (logp.exp() * (logp - target.double().clamp_min(1e-300).log())).sum(-1)


@dataclass(frozen=True)
class Steering:
    """a: [B, K] target mixtures; kl_*: [B, T'] KL(model || target mixture) at the edited positions."""

    a: torch.Tensor
    kl_unsteered: torch.Tensor
    kl_steered: torch.Tensor
    kl_random: torch.Tensor


@torch.no_grad()
def steer(
    model: torch.nn.Module, family: TaskFamily, tokens: torch.Tensor, params: torch.Tensor, site: Site, positions: slice,
    basis: torch.Tensor, code: AdditiveCode, gen: torch.Generator,
) -> Steering:
    """Steer tokens: [B, T] at ``site`` on ``positions`` toward a ~ Dirichlet(1) over the K tasks of
    params: [K, ...]; basis: [D, r] of the task subspace."""
    model.eval()
    B, K = tokens.shape[0], params.shape[0]
    gamma = torch._standard_gamma(torch.ones(B, K, dtype=torch.float64), gen)
    a = gamma / gamma.sum(-1, keepdim=True)
    target = family.mix_predictive(tokens, params.double(), a[:, None].expand(B, tokens.shape[1], K))[:, positions]
    edit = steer_edit(basis.float(), code, a, tokens[:, positions])

    def run(change: Edit | None) -> torch.Tensor:
        if change is None:
            logits = model(tokens)
        else:
            with intervene(model, site, change, positions):
                logits = model(tokens)
        return kl_rows(torch.log_softmax(logits[:, positions].double(), -1), target)

    return Steering(a, run(None), run(edit), run(random_edit(edit, gen)))

"""Causal steering (PAPER.md section 4): replace the task component of the states at one site by a
chosen point ``a`` of the simplex and compare the model's next-token law with the target mixture
``sum_k a_k p_k(. | context)`` (KL, ``TokenReadout``), or for E2 the model's prediction of y_i with
the prediction of the mixture of task weights ``sum_k a_k w_k . x_i`` (squared error,
``PredictionReadout``).

The edit is ``h' = h - P_S h + P_S (sum_k a_k W_k + U(x_t))``: the part of h in the task subspace S
is replaced by what an additive code ``W, U`` predicts for task mixture ``a`` and the current token
(``U[x_t]``), or for E2 the current example's x (``x_t @ U``).
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

from taskgeom.analysis.anova import Layout
from taskgeom.analysis.properties import quantiles
from taskgeom.hooks import Site, intervene
from taskgeom.tasks import Batch, TokenFamily
from taskgeom.tasks.regression import Regression

Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AdditiveCode:
    """state ~ sum_k a_k centre[k] + token[x] (tokens x, token: [V, D]) or + x @ token (continuous
    x: [..., d], token: [d, D]); centre: [K, D]."""

    centre: torch.Tensor
    token: torch.Tensor

    def state(self, a: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """[B, T, D] for mixtures a: [B, K] and inputs: [B, T] tokens or [B, T, d] x_t."""
        effect = inputs.to(self.token.dtype) @ self.token if inputs.is_floating_point() else self.token[inputs]
        return (a.to(self.centre.dtype) @ self.centre)[:, None] + effect


def code_from_layout(layout: Layout) -> AdditiveCode:
    """The additive fit of the layout: centre_k = intercept + theta_k, token = nu (or the map A)."""
    return AdditiveCode((layout.intercept + layout.effect_a).float(), layout.effect_b.float())


def code_from_regression(h: torch.Tensor, alpha: torch.Tensor, inputs: torch.Tensor, vocab: int | None) -> AdditiveCode:
    """Least squares h ~ alpha @ W + onehot(x) @ U (minimum norm; the split of a shared constant
    between W and U does not change any edit). h: [M, D]; alpha: [M, K]; inputs: [M] tokens, or
    [M, d] continuous x (then h ~ alpha @ W + x @ U and vocab is unused)."""
    effect = inputs.double() if inputs.is_floating_point() else torch.nn.functional.one_hot(inputs, vocab).double()
    design = torch.cat([alpha.double(), effect], dim=1)
    coef = torch.linalg.lstsq(design, h.double(), driver="gelsd").solution  # [K + V, D]
    K = alpha.shape[1]
    return AdditiveCode(coef[:K].float(), coef[K:].float())


def steer_edit(basis: torch.Tensor, code: AdditiveCode, a: torch.Tensor, inputs: torch.Tensor) -> Edit:
    """The edit h -> h - P_S h + P_S code.state(a, inputs); basis: [D, r] orthonormal (any float
    dtype: ``TaskSubspace.basis`` is float64; it is cast to the code's dtype); a: [B, K];
    inputs: [B, T'] tokens or [B, T', d] x_t at the edited positions."""
    basis = basis.to(code.centre.dtype)
    target = code.state(a, inputs) @ basis  # [B, T', r]

    def edit(h: torch.Tensor) -> torch.Tensor:
        return h + (target.to(h.dtype) - h @ basis.to(h.dtype)) @ basis.T.to(h.dtype)

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
class TokenReadout:
    """KL(model || target mixture) of the next-token law at each edited position; tokens: [B, T];
    params: [K, ...] of the pool."""

    family: TokenFamily
    tokens: torch.Tensor
    params: torch.Tensor
    measure = "kl"
    label = "KL(model || target mixture)"

    def distance(self, a: torch.Tensor, late: slice) -> Callable[[torch.Tensor], torch.Tensor]:
        """For mixtures a: [B, K], a function of the model's output [B, T, V] -> [B, T'] at the
        positions ``late``."""
        B, T = self.tokens.shape
        target = self.family.mix_predictive(self.tokens, self.params.double(), a[:, None].expand(B, T, a.shape[1]))[:, late]
        return lambda out: kl_rows(torch.log_softmax(out[:, late].double(), -1), target)


@dataclass(frozen=True)
class PredictionReadout:
    """E2: squared error between the model's prediction of y_i and the target mixture's
    ``sum_k a_k w_k . x_i``, for the examples i of the analysed (separator) positions."""

    family: Regression
    batch: Batch
    params: torch.Tensor
    measure = "sq"
    label = "squared error to the target mixture's prediction"

    def distance(self, a: torch.Tensor, late: slice) -> Callable[[torch.Tensor], torch.Tensor]:
        """For mixtures a: [B, K], a function of the model's output [B, T, 1] -> [B, n'] over the
        examples ``late``, each read at its separator."""
        B, n = self.batch.x.shape[:2]
        where = self.family.prediction_positions(n)[late]
        target = self.family.mix_prediction(self.batch.x, self.params, a[:, None].expand(B, n, a.shape[1]))[:, late]
        return lambda out: (out[..., 0].double()[:, where] - target) ** 2


Readout = TokenReadout | PredictionReadout


@dataclass(frozen=True)
class Steering:
    """a: [B, K] target mixtures; unsteered, steered, random: [B, P] the readout's distance between
    the model and the target mixture (``measure``: "kl" or "sq"; ``label`` in words)."""

    a: torch.Tensor
    unsteered: torch.Tensor
    steered: torch.Tensor
    random: torch.Tensor
    measure: str = "kl"
    label: str = TokenReadout.label

    def median(self, kind: str) -> float:
        """The median of ``kind`` (unsteered, steered, random) over every sequence and position, as
        the stored rows give it (``torch.quantile``: the mean of the two middle values when even)."""
        return float(quantiles(getattr(self, kind).reshape(-1))[0])

    @property
    def ratio(self) -> float:
        """median(unsteered) / median(steered): what the steering claim reads."""
        return self.median("unsteered") / self.median("steered")


def dirichlet_points(n: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """[n, K] float64 points drawn from Dirichlet(1) on the simplex (normalised unit gammas)."""
    gamma = torch._standard_gamma(torch.ones(n, K, dtype=torch.float64), gen)
    return gamma / gamma.sum(-1, keepdim=True)


@torch.no_grad()
def steer(
    model: torch.nn.Module, readout: Readout, tokens: torch.Tensor, inputs: torch.Tensor, site: Site, positions: slice | torch.Tensor,
    late: slice, basis: torch.Tensor, code: AdditiveCode, a: torch.Tensor, gen: torch.Generator,
) -> Steering:
    """Steer the model input tokens: [B, T, ...] at ``site`` on the model ``positions`` (the
    analysed positions ``late``) toward the mixtures a: [B, K] of the K tasks of ``readout.params``;
    inputs: [B, T'] tokens or [B, T', d] x_t at those positions (what the code's token term reads);
    basis: [D, r] of the task subspace; gen: the random control's directions."""
    model.eval()
    distance = readout.distance(a, late)
    edit = steer_edit(basis, code, a, inputs)

    def run(change: Edit | None) -> torch.Tensor:
        if change is None:
            out = model(tokens)
        else:
            with intervene(model, site, change, positions):
                out = model(tokens)
        return distance(out)

    return Steering(a, run(None), run(edit), run(random_edit(edit, gen)), readout.measure, readout.label)

"""Which Bayes predictor does the model follow? docs/concepts.md#m2-the-nearly-orthogonal-subspace.

memorising: exact Bayes over the training pool (``family.predict_id``). generalising: the K majors
plus one "new task" component with the continuous prior, whose evidence is the prior-predictive
chain (``family.log_marginal_ood``) and whose prediction is the OOD-optimal learner. The new task
takes prior weight ``p_new`` (the pool's minor mass, the study's p_minor) and each major
(1 - p_new) / K. As the study's ``_kl_model_to_ref`` (``coin_kl.py``, ``kl_divergence.py``): KL from
the model's next-token distribution to each predictor's, both clamped below at the protocol's ``transition_eps`` (the study's clamp), averaged
over the predictions 0..T-2 of each sequence and then over sequences (of the training mixture:
``heldout`` split ``transition``); the statistic is the natural log of their ratio.
"""

from __future__ import annotations

import math

import torch

from taskgeom.analysis.protocol import active
from taskgeom.tasks import TaskFamily, TaskPool


def predict_generalising(family: TaskFamily, tokens: torch.Tensor, pool: TaskPool, p_new: float) -> torch.Tensor:
    """[B, T, V] posterior mixture over {majors, new task ~ prior} after tokens[:, :t+1]."""
    majors = pool.params[: pool.n_major].double()
    loglik = family.step_log_likelihood(tokens, majors).cumsum(dim=1)  # [B, T, K]
    log_major, log_new = (
        math.log((1 - p_new) / pool.n_major),
        (math.log(p_new) if p_new > 0 else -math.inf),
    )  # p_new = 0: majors only
    joint = torch.cat([loglik + log_major, (family.log_marginal_ood(tokens) + log_new)[..., None]], dim=-1)
    weights = torch.softmax(joint, dim=-1)
    return family.mix_predictive(tokens, majors, weights[..., :-1]) + weights[..., -1:] * family.predict_ood(tokens)


def kl_to_model(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(model || reference) over sequences and positions 0..T-2 (the study's direction); reference:
    [B, T, V] probs, logits: [B, T, V] the model's."""
    eps = active().transition_eps
    p = torch.softmax(logits.double(), dim=-1)[:, :-1].clamp_min(eps)
    q = reference[:, :-1].clamp_min(eps)
    return (p * (p.log() - q.log())).sum(-1).mean()


def reference_predictors(
    family: TaskFamily, tokens: torch.Tensor, pool: TaskPool, p_new: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, V], [B, T, V]) the memorising and generalising predictors on tokens: [B, T], computed
    once for every checkpoint read on these tokens."""
    return family.predict_id(tokens, pool), predict_generalising(family, tokens, pool, p_new)


def transition_statistic(
    logits: torch.Tensor, memorising: torch.Tensor, generalising: torch.Tensor
) -> dict[str, float]:
    """log(KL_to_memorising / KL_to_generalising) of a model's logits: [B, T, V] on the tokens of
    ``reference_predictors``; positive means the model is closer to the generalising predictor."""
    to_mem, to_gen = kl_to_model(memorising, logits), kl_to_model(generalising, logits)
    return {
        "kl_to_memorising": float(to_mem),
        "kl_to_generalising": float(to_gen),
        "log_ratio": float(torch.log(to_mem / to_gen)),
    }

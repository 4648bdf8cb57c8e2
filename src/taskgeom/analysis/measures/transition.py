"""Which Bayes predictor does the model follow? docs/concepts.md#m2-the-nearly-orthogonal-subspace.

memorising: exact Bayes over the training pool (``family.predict_id``). generalising: the K majors
plus one "new task" component with the continuous prior, whose evidence is the prior-predictive
chain (``family.log_marginal_ood``) and whose prediction is the OOD-optimal learner. The new task
takes prior weight ``p_new`` (the pool's minor mass, the study's p_minor) and each major
(1 - p_new) / K. **[ours]** The statistic is read on fresh OOD sequences, where the two differ.
"""

from __future__ import annotations

import math

import torch

from taskgeom.tasks import TaskFamily, TaskPool


def predict_generalising(family: TaskFamily, tokens: torch.Tensor, pool: TaskPool, p_new: float) -> torch.Tensor:
    """[B, T, V] posterior mixture over {majors, new task ~ prior} after tokens[:, :t+1]."""
    majors = pool.params[: pool.n_major].double()
    loglik = family.step_log_likelihood(tokens, majors).cumsum(dim=1)  # [B, T, K]
    log_major, log_new = math.log((1 - p_new) / pool.n_major), (math.log(p_new) if p_new > 0 else -math.inf)  # p_new = 0: majors only
    joint = torch.cat([loglik + log_major, (family.log_marginal_ood(tokens) + log_new)[..., None]], dim=-1)
    weights = torch.softmax(joint, dim=-1)
    return family.mix_predictive(tokens, majors, weights[..., :-1]) + weights[..., -1:] * family.predict_ood(tokens)


def kl_to_model(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(reference || model) over sequences and positions 0..T-2; reference: [B, T, V] probs."""
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    ref = reference[:, :-1]
    return (ref * (ref.clamp_min(1e-300).log() - logp)).sum(-1).mean()


def reference_predictors(family: TaskFamily, tokens: torch.Tensor, pool: TaskPool, p_new: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, V], [B, T, V]) the memorising and generalising predictors on tokens: [B, T], computed
    once for every checkpoint read on these tokens."""
    return family.predict_id(tokens, pool), predict_generalising(family, tokens, pool, p_new)


def transition_statistic(logits: torch.Tensor, memorising: torch.Tensor, generalising: torch.Tensor) -> dict[str, float]:
    """log(KL_to_memorising / KL_to_generalising) of a model's logits: [B, T, V] on the tokens of
    ``reference_predictors``; positive means the model is closer to the generalising predictor."""
    to_mem, to_gen = kl_to_model(memorising, logits), kl_to_model(generalising, logits)
    return {"kl_to_memorising": float(to_mem), "kl_to_generalising": float(to_gen), "log_ratio": float(torch.log(to_mem / to_gen))}

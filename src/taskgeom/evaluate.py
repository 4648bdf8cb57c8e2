"""Held-out evaluation of a model against the exact Bayes predictors, per position.

Position ``t`` (0..T-2) scores the prediction of ``tokens[:, t+1]`` from ``tokens[:, :t+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taskgeom.runs import Run
from taskgeom.tasks import Batch


@dataclass(frozen=True)
class EvalSet:
    """name: major | minor | ood; bayes_id, bayes_ood: [B, T, V] float64 predictives."""

    name: str
    batch: Batch
    bayes_id: torch.Tensor
    bayes_ood: torch.Tensor


def eval_sets(run: Run, batch_size: int | None = None) -> list[EvalSet]:
    """Fixed held-out sequences of the major tasks, the minor tasks (if any) and fresh OOD tasks."""
    family, pool, cfg = run.family, run.pool, run.config
    size, seq_len, seed = batch_size or cfg.train.eval_batch, cfg.task.seq_len, cfg.train.seed
    batches = {"major": family.sample(pool, size, seq_len, seed, 0, "eval", "major")}
    if pool.n_minor:
        batches["minor"] = family.sample(pool, size, seq_len, seed, 0, "eval", "minor")
    batches["ood"] = family.sample_ood(size, seq_len, seed, 0, "eval-ood")
    return [EvalSet(name, b, family.predict_id(b.tokens, pool), family.predict_ood(b.tokens)) for name, b in batches.items()]


def _nll(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T-1] -log probs[:, t, tokens[:, t+1]]."""
    return -probs[:, :-1].clamp_min(1e-300).log().gather(-1, tokens[:, 1:, None]).squeeze(-1)


@torch.no_grad()
def per_position(model: torch.nn.Module, evalset: EvalSet) -> dict[str, torch.Tensor]:
    """Per-position means over sequences, each [T-1]: the model's loss, the Bayes predictors'
    losses, the excess over ID-Bayes and KL(ID-Bayes || model)."""
    tokens = evalset.batch.tokens
    logp_model = torch.log_softmax(model(tokens).double(), dim=-1)
    loss = -logp_model[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    bayes = evalset.bayes_id[:, :-1]
    kl = (bayes * (bayes.clamp_min(1e-300).log() - logp_model[:, :-1])).sum(-1)
    rows = {
        "loss": loss,
        "bayes_id_loss": _nll(evalset.bayes_id, tokens),
        "bayes_ood_loss": _nll(evalset.bayes_ood, tokens),
        "kl_bayes_model": kl,
    }
    rows["excess"] = rows["loss"] - rows["bayes_id_loss"]
    return {name: value.mean(0) for name, value in rows.items()}


def summary(model: torch.nn.Module, sets: list[EvalSet]) -> dict[str, dict[str, float]]:
    """{set name: {metric: mean over positions}}."""
    was_training = model.training
    model.eval()
    out = {s.name: {k: float(v.mean()) for k, v in per_position(model, s).items()} for s in sets}
    model.train(was_training)
    return out


def evaluate_run(run: Run) -> list[dict]:
    """Per-position evaluation of the finished model, saved to ``analysis/eval.json`` as tidy rows
    ``{set, position, metric, value}`` (pandas.DataFrame(rows) reads it) and returned."""
    from taskgeom.storage import atomic_write_json

    model = run.load_model()
    rows = []
    for evalset in eval_sets(run):
        for metric, values in per_position(model, evalset).items():
            rows += [{"set": evalset.name, "position": t, "metric": metric, "value": float(v)} for t, v in enumerate(values)]
    atomic_write_json(run.path / "analysis" / "eval.json", rows)
    return rows

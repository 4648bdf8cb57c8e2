"""Held-out evaluation of a model against the exact Bayes predictors, per prediction.

Token families: position ``t`` (0..T-2) scores the prediction of ``tokens[:, t+1]`` from
``tokens[:, :t+1]`` (nats). Vector families (E2): entry ``i`` scores the prediction of y_i
(squared error). The family computes the losses (``TaskFamily.position_losses``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from taskgeom.runs.folders import Run
from taskgeom.tasks import Batch, TaskFamily


@dataclass(frozen=True)
class EvalSet:
    """name: major | minor | ood; bayes_id, bayes_ood: the family's float64 reference predictions
    ([B, T, V] predictives for token families, [B, n] predictions of y for E2)."""

    name: str
    batch: Batch
    bayes_id: torch.Tensor
    bayes_ood: torch.Tensor
    family: TaskFamily

    def to(self, device: torch.device) -> "EvalSet":
        """The same set with its sequences and reference predictions on ``device``."""
        return replace(
            self, batch=self.batch.to(device), bayes_id=self.bayes_id.to(device), bayes_ood=self.bayes_ood.to(device)
        )


def eval_sets(run: Run, batch_size: int | None = None) -> list[EvalSet]:
    """Fixed held-out sequences of the major tasks, the minor tasks (if any) and fresh OOD tasks."""
    family, pool, cfg = run.family, run.pool, run.config
    size, seq_len, seed = batch_size or cfg.train.eval_batch, cfg.task.seq_len, cfg.train.seed
    batches = {"major": family.sample(pool, size, seq_len, seed, 0, "eval", "major")}
    if pool.n_minor:
        batches["minor"] = family.sample(pool, size, seq_len, seed, 0, "eval", "minor")
    batches["ood"] = family.sample_ood(size, seq_len, seed, 0, "eval-ood")
    return [EvalSet(name, b, *family.reference_predictions(b, pool), family) for name, b in batches.items()]


@torch.no_grad()
def per_position(model: torch.nn.Module, evalset: EvalSet) -> dict[str, torch.Tensor]:
    """Per-prediction means over sequences, each [P]: the model's loss, the Bayes predictors'
    losses, the excess over ID-Bayes and the family's gap to ID-Bayes (KL or squared distance)."""
    rows = evalset.family.position_losses(model, evalset.batch, evalset.bayes_id, evalset.bayes_ood)
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
    ``{set, position, metric, value}`` (pandas.DataFrame(rows) reads it) and returned; a value that
    is not finite is written as null (standard JSON). A diverged run has no model: RunDirError."""
    from taskgeom.runs.storage import atomic_write_json, standard_json

    model = run.load_model()
    rows = []
    for evalset in eval_sets(run):
        for metric, values in per_position(model, evalset).items():
            rows += [
                {"set": evalset.name, "position": t, "metric": metric, "value": float(v)} for t, v in enumerate(values)
            ]
    rows = standard_json(rows)
    atomic_write_json(run.path / "analysis" / "eval.json", rows)
    return rows

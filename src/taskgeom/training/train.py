"""The training loop: AdamW, a triangular or cosine schedule, optional clipping, fresh batches each step, periodic
evaluation against the Bayes predictors, atomic checkpoints and exact resume.

Every batch is a pure function of (seed, step), and the checkpoint holds model, optimiser and the
running loss sums, so a resumed run ends bitwise equal to one never interrupted on the CPU (on
CUDA, some kernels are not deterministic: equal within float tolerance). Batches are made on the
CPU and copied to the training device; ``train.precision: bf16`` runs the forward pass under
bfloat16 autocast (weights, optimiser and evaluation stay float32).

One process trains a run at a time: ``train`` holds the run's lock (``Run.writer``) from before it
reads the checkpoint until the model is written. Divergence is an outcome, not a crash: a
non-finite training loss, or a non-finite held-out loss at an evaluation, stops training before
anything of that step is written, marks the run diverged in run.json (``Run.status``), records it
in the run index again and raises TrainingDiverged; a diverged run is not trained again.
metrics.jsonl holds standard JSON only (a non-finite value of a reference metric is written as
null).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from taskgeom.errors import CheckpointError, TrainingDiverged
from taskgeom.runs import index as runindex
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import (
    atomic_write_text,
    load_module_state,
    load_tensors,
    meta_float,
    meta_int,
    save_tensors,
    standard_json,
)
from taskgeom.settings.config import RunConfig
from taskgeom.settings.devices import autocast, resolve_device, torch_threads
from taskgeom.tasks import Batch, TaskFamily
from taskgeom.training.evaluate import eval_sets, summary
from taskgeom.training.trackers import Tracker, check_tracker, open_tracker

ProgressFn = Callable[[int, int, float], None]


def learning_rate(
    step: int, steps: int, peak: float, warmup_frac: float, floor: float = 0.0, kind: str = "triangular"
) -> float:
    """The rate of ``step`` (0-based): linear warm-up from ``floor`` to ``peak`` over ``warmup_frac``
    of the steps, then a decay to ``floor`` at ``steps``, linear (``triangular``) or half a cosine
    (``cosine``)."""
    if kind not in ("triangular", "cosine"):
        raise ValueError(f"unknown schedule {kind!r}; choose triangular or cosine")
    warmup = max(1, round(warmup_frac * steps))
    if step < warmup:
        return floor + (peak - floor) * (step + 1) / warmup
    left = max(0.0, (steps - step) / max(1, steps - warmup))  # 1 at the peak, 0 at the end
    if kind == "cosine":
        left = 0.5 * (1.0 - math.cos(math.pi * left))
    return floor + (peak - floor) * left


def snapshot_steps(steps: int, count: int, first: int = 10) -> list[int]:
    """``count`` log-spaced steps from ``first`` to ``steps`` (fewer if they collide), last included."""
    if count == 0:
        return []
    grid = np.geomspace(min(first, steps), steps, count)
    return sorted({int(round(x)) for x in grid} | {steps})


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _optimizer_tensors(opt: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    state = opt.state_dict()["state"]
    return {f"optim.{idx}.{name}": value for idx, slots in state.items() for name, value in slots.items()}


def _load_optimizer(opt: torch.optim.AdamW, tensors: dict[str, torch.Tensor]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".")
            state.setdefault(int(idx), {})[name] = value
    full = opt.state_dict()
    full["state"] = state
    opt.load_state_dict(full)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    family: TaskFamily,
    batch: Batch,
    where: torch.device,
    precision: str,
    grad_clip: float | None,
) -> float:
    """One optimiser step on a CPU-made batch, copied to ``where`` (gradients clipped to norm
    ``grad_clip``, or not at all for None); returns the training loss."""
    batch = batch.to(where)
    with autocast(where, precision):
        loss = family.training_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


def train(run: Run, progress: ProgressFn | None = None, device: str = "auto", tracker: str = "none") -> dict:
    """Train ``run`` to its configured steps (resuming from its checkpoint) on ``device`` (auto,
    cpu, cuda, cuda:N), sending each evaluation record also to ``tracker`` (none, tensorboard,
    wandb); returns the last evaluation record. Finished runs return at once."""
    if run.finished:
        return run.metrics()[-1]
    where = resolve_device(device)
    check_tracker(tracker)
    with torch_threads(run.config.train.threads), run.writer():  # RunLockedError if another process trains this run
        if run.finished:  # it finished while we waited to look
            return run.metrics()[-1]
        diverged = run.diverged
        if diverged is not None:  # the same config would meet the same loss again
            raise TrainingDiverged(_diverged_message(run, **diverged, again=True))
        model, opt, start, loss_sum, loss_count = _restore(run, where)
        _truncate_metrics(run, start)
        runindex.record(run)
        sink = open_tracker(tracker, run, start)
        failed = True
        try:
            record = _steps(run, model, opt, where, start, loss_sum, loss_count, progress, sink)
            failed = False
        except _Diverged as stop:
            run.mark_diverged(stop.step, stop.metric, stop.value)
            runindex.record(run)
            raise TrainingDiverged(_diverged_message(run, stop.step, stop.metric, stop.value)) from None
        finally:
            if sink is not None:
                sink.close(failed)
        save_tensors(
            run.model_path,
            model.state_dict(),
            {"config_digest": run.config.digest(), "step": str(run.config.train.steps)},
        )
        runindex.record(run)
    return record or run.metrics()[-1]


class _Diverged(Exception):
    """Raised inside the loop at the first non-finite loss; ``train`` turns it into TrainingDiverged."""

    def __init__(self, step: int, metric: str, value: float):
        super().__init__(step, metric, value)
        self.step, self.metric, self.value = step, metric, value


def train_settings(
    settings: RunConfig, out: Path, run_dir: Path | None = None, device: str = "auto", tracker: str = "none"
) -> tuple[Run, list[str]]:
    """``taskgeom train``: the run of ``settings`` (its directory under ``out``, or ``run_dir``)
    trained, or resumed, with a progress bar, after checking that it fits ``device``; returns the
    run and one line per held-out set (loss, ID-Bayes loss, excess), none when it was already trained."""
    from taskgeom.progress import step_bar
    from taskgeom.training.memory import check_training_fits

    if settings.model.arch != "taskgeom":
        from taskgeom.models.hf import require_transformers

        require_transformers()  # before the run directory is made
    check_training_fits(settings, device)
    run = Run.create(settings, out, run_dir)
    if run.finished:
        return run, []
    with step_bar(f"train {run.path.name}", run.config.train.steps) as update:
        record = train(run, update, device, tracker)
    return run, [
        f"{name:>6}: loss {values['loss']:.4f}  ID-Bayes {values['bayes_id_loss']:.4f}  excess {values['excess']:+.4f}"
        for name, values in record["eval"].items()
    ]


def _diverged_message(run: Run, step: Any, metric: str, value: Any, again: bool = False) -> str:
    cfg = run.config.train
    head = f"run {run.path} diverged at step {step} of {cfg.steps}: {metric} is {value}"
    if again:
        return f"{head} (recorded in run.json), so it is not trained again: lower train.lr (now {cfg.lr:g}) for a new run, or delete the run directory to retry"
    return f"{head}; stopped and marked diverged in run.json: lower train.lr (now {cfg.lr:g}) or lengthen train.warmup_frac"


def _first_nonfinite(evaluation: dict[str, dict[str, float]]) -> tuple[str, float] | None:
    """(metric, value) of the first held-out model loss that is not finite (metric named by its
    place in a metrics.jsonl record, e.g. ``eval.major.loss``), else None."""
    for name, values in evaluation.items():
        if not math.isfinite(values["loss"]):
            return f"eval.{name}.loss", values["loss"]
    return None


def _restore(run: Run, where: torch.device) -> tuple[torch.nn.Module, torch.optim.AdamW, int, float, int]:
    """(model on ``where``, optimiser, step, running loss sum, count): fresh, or from the checkpoint."""
    cfg = run.config.train
    model = run.new_model().to(where).train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    if not run.checkpoint_path.exists():
        return model, opt, 0, 0.0, 0
    path = run.checkpoint_path
    restart = f"delete {path} to train the run from scratch"
    try:
        tensors, meta = load_tensors(path, run.config.digest())
    except CheckpointError as err:
        raise CheckpointError(f"{err}; {restart}") from None
    step = meta_int(meta, "step", path, 0, cfg.steps, restart)
    loss_count = meta_int(meta, "loss_count", path, 0, cfg.steps, restart)
    loss_sum = meta_float(meta, "loss_sum", path, restart)
    load_module_state(model, tensors, path, prefix="model.")
    _load_optimizer(opt, tensors)
    return model, opt, step, loss_sum, loss_count


def _steps(
    run: Run,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    where: torch.device,
    start: int,
    loss_sum: float,
    loss_count: int,
    progress: ProgressFn | None,
    tracker: Tracker | None,
) -> dict:
    """Steps ``start`` to the end: evaluation records, checkpoints and snapshots on their schedule;
    returns the last evaluation record."""
    cfg, family, pool = run.config.train, run.family, run.pool
    sets = [evalset.to(where) for evalset in eval_sets(run)]
    record: dict = {}
    keep = set(snapshot_steps(cfg.steps, cfg.snapshots))
    for step in range(start, cfg.steps):
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_frac, cfg.lr_floor, cfg.schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = family.sample(pool, cfg.batch_size, run.config.task.seq_len, cfg.seed, step, "train")
        loss_value = train_step(model, opt, family, batch, where, cfg.precision, cfg.grad_clip)
        done = step + 1
        if not math.isfinite(loss_value):
            raise _Diverged(done, "train_loss", loss_value)
        loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            record = {
                "step": done,
                "lr": lr,
                "train_loss": loss_sum / loss_count,
                "eval": summary(model, sets),
                "device": str(where),
            }
            bad = _first_nonfinite(record["eval"])
            if bad is not None:
                raise _Diverged(done, *bad)
            with run.metrics_path.open("a") as handle:
                handle.write(json.dumps(standard_json(record), sort_keys=True, allow_nan=False) + "\n")
            if tracker is not None:
                tracker.log(record)
            loss_sum, loss_count = 0.0, 0
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            tensors = {f"model.{k}": v for k, v in model.state_dict().items()} | _optimizer_tensors(opt)
            meta = {
                "config_digest": run.config.digest(),
                "step": str(done),
                "loss_sum": repr(loss_sum),
                "loss_count": str(loss_count),
            }
            save_tensors(run.checkpoint_path, tensors, meta)
        if done in keep:
            save_tensors(
                run.snapshot_path(done), model.state_dict(), {"config_digest": run.config.digest(), "step": str(done)}
            )
        if progress:
            progress(done, cfg.steps, loss_value)
    return record


def _truncate_metrics(run: Run, step: int) -> None:
    """Drop records past ``step`` (written after the checkpoint we resume from)."""
    if not run.metrics_path.exists():
        return
    keep = []
    for line in run.metrics_path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
            continue
    atomic_write_text(run.metrics_path, "".join(line + "\n" for line in keep))

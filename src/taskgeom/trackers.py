"""Optional experiment trackers fed by the trainer: TensorBoard event files or a Weights & Biases
run (offline unless ``WANDB_MODE`` says otherwise). ``metrics.jsonl`` is written whatever the
tracker; the tracker's packages are imported only when one is asked for.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Protocol

from taskgeom.errors import TaskgeomError
from taskgeom.runs import Run

TRACKERS = ("none", "tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the package it imports


class Tracker(Protocol):
    def log(self, record: dict) -> None:
        """Record one evaluation record of metrics.jsonl (``step``, ``lr``, ``train_loss``, ``eval``)."""

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as flat scalars: ``train/loss``, ``train/lr``, ``{set}/{metric}``."""
    flat = {"train/loss": record["train_loss"], "train/lr": record["lr"]}
    for set_name, metrics in record["eval"].items():
        flat |= {f"{set_name}/{metric}": value for metric, value in metrics.items()}
    return flat


class TensorBoardTracker:
    """Event files in ``{run}/tensorboard`` (view with ``tensorboard --logdir RUN_ROOT``)."""

    def __init__(self, run: Run):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(run.path / "tensorboard"))

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory, resumed with it, kept in ``{run}/wandb``; offline by
    default (``wandb sync`` uploads it later), ``WANDB_MODE=online`` to stream."""

    def __init__(self, run: Run):
        import wandb
        self.session = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "taskgeom"),
            id=run.path.name,
            name=run.path.name,
            dir=str(run.path),
            config=run.config.model_dump(mode="json"),
            mode=os.environ.get("WANDB_MODE", "offline"),
            resume="allow",
        )

    def log(self, record: dict) -> None:
        self.session.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.session.finish()


def check_tracker(kind: str) -> None:
    """TaskgeomError unless ``kind`` is a known tracker whose package is installed."""
    if kind not in TRACKERS:
        raise TaskgeomError(f"unknown tracker {kind!r}; choose one of {', '.join(TRACKERS)}")
    if kind in _PACKAGES and importlib.util.find_spec(_PACKAGES[kind]) is None:
        raise TaskgeomError(f"the {kind} tracker needs `pip install taskgeom[{kind}]`")


def open_tracker(kind: str, run: Run) -> Tracker | None:
    """The tracker named ``kind`` (none, tensorboard, wandb) for ``run``; None for ``none``."""
    check_tracker(kind)
    if kind == "none":
        return None
    return TensorBoardTracker(run) if kind == "tensorboard" else WandbTracker(run)

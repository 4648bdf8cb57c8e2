"""Optional experiment trackers fed by the trainer: TensorBoard event files or a Weights & Biases
run (offline unless ``WANDB_MODE`` says otherwise). ``metrics.jsonl`` is written whatever the
tracker; the tracker's packages are imported only when one is asked for.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Protocol

from taskgeom.errors import TaskgeomError
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import atomic_write_text

TRACKERS = ("none", "tensorboard", "wandb")  # each but none imports the package of its name


class Tracker(Protocol):
    def log(self, record: dict) -> None:
        """Record one evaluation record of metrics.jsonl (``step``, ``lr``, ``train_loss``, ``eval``)."""

    def close(self, failed: bool = False) -> None:
        """Flush and end; ``failed`` when training stopped on an error."""


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as flat scalars: ``train/loss``, ``train/lr``, ``{set}/{metric}``."""
    flat = {"train/loss": record["train_loss"], "train/lr": record["lr"]}
    for set_name, metrics in record["eval"].items():
        flat |= {f"{set_name}/{metric}": value for metric, value in metrics.items()}
    return flat


class TensorBoardTracker:
    """Event files in ``{run}/tensorboard`` (view with ``tensorboard --logdir RUN_ROOT``). A run
    resumed from step ``start`` purges the events logged after it, as metrics.jsonl is cut back."""

    def __init__(self, run: Run, start: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.path / "tensorboard"), purge_step=start + 1 if start else None)

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory and kept in ``{run}/wandb``; offline by default
    (``wandb sync`` uploads it later), ``WANDB_MODE=online`` to stream. Its id is drawn when
    training starts from step 0 and kept in ``{run}/wandb/taskgeom-id``, so a resumed run continues
    the same W&B run (whose steps after the checkpoint come again, with the same values)."""

    def __init__(self, run: Run, start: int):
        import wandb

        id_path = run.path / "wandb" / "taskgeom-id"
        if start == 0 or not id_path.is_file():
            id_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(id_path, uuid.uuid4().hex[:12])
        self.session = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "taskgeom"),
            id=id_path.read_text().strip(),
            name=run.path.name,
            dir=str(run.path),
            config=run.config.model_dump(mode="json"),
            mode=os.environ.get("WANDB_MODE", "offline"),
            resume="allow",
        )

    def log(self, record: dict) -> None:
        self.session.log(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.session.finish(exit_code=1 if failed else 0)


def check_tracker(kind: str) -> None:
    """TaskgeomError unless ``kind`` is a known tracker whose package is installed."""
    if kind not in TRACKERS:
        raise TaskgeomError(f"unknown tracker {kind!r}; choose one of {', '.join(TRACKERS)}")
    if kind != "none" and importlib.util.find_spec(kind) is None:
        raise TaskgeomError(f"the {kind} tracker needs `pip install taskgeom[{kind}]`")


def open_tracker(kind: str, run: Run, start: int = 0) -> Tracker | None:
    """The tracker named ``kind`` (none, tensorboard, wandb) for ``run`` training on from step
    ``start``; None for ``none``."""
    check_tracker(kind)
    if kind == "none":
        return None
    return (TensorBoardTracker if kind == "tensorboard" else WandbTracker)(run, start)

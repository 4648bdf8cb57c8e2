"""Run directories: one per resolved config, named ``{name}-{digest}``.

Layout: ``run.json`` (format, version, digest; ``status: diverged`` and ``diverged: {step,
metric, value}`` once training met a non-finite loss), ``config.yaml``, ``metrics.jsonl``,
``checkpoint.safetensors`` (model + optimiser, for resuming), ``model.safetensors`` (final
weights), ``analysis/*.json``, ``figures/*.png``, and ``.lock``, the lock file of the one process
allowed to write the run (``Run.writer``).

The run.json fields after ``digest`` are optional, so run.json files written before them still
open (the format number changes only when a reader of this version could misread a file).
"""

from __future__ import annotations

import json
import math
from contextlib import AbstractContextManager
from functools import cached_property
from pathlib import Path

import torch
import yaml

from taskgeom import tasks
from taskgeom.errors import CheckpointError, RunDirError
from taskgeom.models import build_model, model_class
from taskgeom.runs.storage import (
    atomic_write_json,
    atomic_write_text,
    exclusive_lock,
    load_module_state,
    load_tensors,
    meta_int,
)
from taskgeom.settings.config import ConfigError, RunConfig
from taskgeom.settings.recipes import build_config
from taskgeom.version import __version__

RUN_FORMAT = 1
LOCK_NAME = ".lock"


class Run:
    """A run directory bound to its validated config."""

    def __init__(self, path: Path, config: RunConfig):
        self.path, self.config = Path(path), config

    # ---- opening and creating ---------------------------------------------------------------
    @classmethod
    def create(cls, config: RunConfig, root: Path | str = "runs", path: Path | str | None = None) -> "Run":
        """The run directory for ``config`` (under ``root`` unless ``path`` is given), made if new.

        An existing directory must hold the same config and format, else RunDirError.
        """
        path = Path(path) if path is not None else Path(root) / f"{config.name}-{config.digest()}"
        if path.exists() and not path.is_dir():
            raise RunDirError(f"{path} is a file, not a run directory; choose another path")
        if not (path / "run.json").exists():  # run.json is written last: without it the directory is still being made
            if path.exists() and any(
                not _ours(entry.name) and entry.name not in ("config.yaml", "run.json") for entry in path.iterdir()
            ):
                raise RunDirError(f"{path} exists and is not a taskgeom run directory; choose another path")
            path.mkdir(parents=True, exist_ok=True)
            with exclusive_lock(path / LOCK_NAME, f"run directory {path}"):
                if not (path / "run.json").exists():  # else another process made it while we looked
                    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
                    if (path / "config.yaml").exists() and (path / "config.yaml").read_text(
                        encoding="utf-8", errors="replace"
                    ) != text:
                        raise RunDirError(
                            f"{path} holds the config.yaml of another config and no run.json (its making was cut "
                            "short?); choose another path or delete the directory"
                        )
                    atomic_write_text(path / "config.yaml", text)
                    atomic_write_json(
                        path / "run.json", {"format": RUN_FORMAT, "taskgeom": __version__, "digest": config.digest()}
                    )
                    return cls(path, config)
        existing = cls.open(path)
        if existing.config.digest() != config.digest():
            raise RunDirError(
                f"run directory {path} was made by a different config ({existing.config.digest()}, this one is {config.digest()})"
            )
        return existing

    @classmethod
    def open(cls, path: Path | str) -> "Run":
        """An existing run directory; checks its format version and config."""
        path = Path(path)
        if not (path / "run.json").is_file() or not (path / "config.yaml").is_file():
            raise RunDirError(f"{path} is not a taskgeom run directory (no run.json / config.yaml)")
        meta = _read_meta(path)
        try:
            raw = yaml.safe_load((path / "config.yaml").read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise RunDirError(f"{path}/config.yaml is unreadable ({err})") from None
        if meta.get("format") != RUN_FORMAT:
            raise RunDirError(
                f"{path} was written by taskgeom {meta.get('taskgeom')} (run format {meta.get('format')}); this version reads format {RUN_FORMAT}"
            )
        try:
            config = build_config(raw)
        except ConfigError as err:
            raise RunDirError(f"{path}/config.yaml is not valid for this version: {err}") from None
        if meta.get("digest") != config.digest():
            raise RunDirError(f"{path}: config.yaml does not match the digest in run.json (edited by hand?)")
        return cls(path, config)

    # ---- what the run is made of ------------------------------------------------------------
    @cached_property
    def family(self) -> tasks.TaskFamily:
        return self.config.family

    @cached_property
    def pool(self) -> tasks.TaskPool:
        task = self.config.task
        return self.family.sample_pool(
            task.n_major, tasks.n_minor_for_diversity(task.diversity), task.p_minor, seed=self.config.train.seed
        )

    def new_model(self) -> torch.nn.Module:
        """A freshly initialised model of the run's config (``models.build_model``); its weights
        depend on the seed alone."""
        return build_model(self.config, self.family)

    @property
    def sites(self) -> tuple[str, ...]:
        """The hook sites of this run's model (``new_model().sites``), known without building it."""
        return model_class(self.config.model).sites

    def load_model(self) -> torch.nn.Module:
        """The finished model; RunDirError if training diverged or has not finished, or if the
        weights are not finite (a run trained before divergence was checked)."""
        diverged = self.diverged
        if diverged is not None:
            raise RunDirError(
                f"run {self.path} diverged at step {diverged['step']} ({diverged['metric']} was {diverged['value']}) and has no "
                "model to evaluate or analyse; train it again with a lower train.lr (a new run directory)"
            )
        if not self.finished:
            raise RunDirError(f"{self.path} has no finished model (model.safetensors); train it first")
        remedy = f"delete it and run `taskgeom train` on this run again to rewrite it from {self.checkpoint_path.name}"
        try:
            tensors, _ = load_tensors(self.model_path, self.config.digest())
        except CheckpointError as err:
            raise CheckpointError(f"{err}; {remedy}") from None
        bad = sorted(
            name for name, value in tensors.items() if value.is_floating_point() and not torch.isfinite(value).all()
        )
        if bad:
            raise RunDirError(
                f"run {self.path} diverged: model.safetensors holds non-finite weights ({', '.join(bad[:3])}); "
                "train it again with a lower train.lr (a new run directory)"
            )
        model = self.new_model()
        load_module_state(model, tensors, self.model_path)
        return model.eval()

    # ---- files ------------------------------------------------------------------------------
    @property
    def model_path(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.safetensors"

    def snapshot_path(self, step: int) -> Path:
        return self.path / "snapshots" / f"step_{step:07d}.safetensors"

    def snapshots(self) -> dict[int, torch.nn.Module]:
        """{step: model} for every weight snapshot kept during training, in step order."""
        models = {}
        for path in sorted((self.path / "snapshots").glob("step_*.safetensors")):
            tensors, meta = load_tensors(path, self.config.digest())
            step = meta_int(
                meta, "step", path, 0, self.config.train.steps, "delete this snapshot (the others are kept)"
            )
            model = self.new_model()
            load_module_state(model, tensors, path)
            models[step] = model.eval()
        return models

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def finished(self) -> bool:
        return self.model_path.is_file()

    @property
    def diverged(self) -> dict | None:
        """``{step, metric, value}`` if training stopped on a non-finite loss, else None."""
        try:
            meta = _read_meta(self.path)
        except RunDirError:
            return None
        if meta.get("status") != "diverged":
            return None
        info = meta.get("diverged") if isinstance(meta.get("diverged"), dict) else {}
        return {
            "step": info.get("step", "unknown"),
            "metric": info.get("metric", "loss"),
            "value": info.get("value", "non-finite"),
        }

    @property
    def status(self) -> str:
        """finished, diverged or unfinished."""
        return "finished" if self.finished else "diverged" if self.diverged is not None else "unfinished"

    def mark_diverged(self, step: int, metric: str, value: float) -> None:
        """Record in run.json that training stopped at ``step`` because ``metric`` (train_loss, or
        eval.SET.loss) was ``value`` (non-finite: stored as the string nan, inf or -inf, so that
        run.json stays standard JSON)."""
        meta = _read_meta(self.path)
        meta |= {"status": "diverged", "diverged": {"step": step, "metric": metric, "value": _number_text(value)}}
        atomic_write_json(self.path / "run.json", meta)

    def writer(self) -> AbstractContextManager[None]:
        """Hold the run's lock for the ``with`` block: RunLockedError, naming the lock file and the
        holder's process id, if another process is writing this run."""
        return exclusive_lock(self.path / LOCK_NAME, f"run directory {self.path}")

    def metrics(self) -> list[dict]:
        """The evaluation records of metrics.jsonl, in order; RunDirError naming the file and line
        if a line is not a JSON record (training drops such a line when it resumes)."""
        if not self.metrics_path.exists():
            return []
        records = []
        for number, line in enumerate(self.metrics_path.read_bytes().splitlines(), 1):
            try:
                record = json.loads(line) if line.strip() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = "unreadable"
            if record is None:
                continue
            if not isinstance(record, dict):
                raise RunDirError(
                    f"{self.metrics_path} line {number} is not a JSON record (cut short?); delete that line"
                )
            records.append(record)
        return records


def _read_meta(path: Path) -> dict:
    """run.json of the run directory ``path`` as a dict; RunDirError if it is not one."""
    try:
        meta = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path}/run.json is unreadable ({err})") from None
    except OSError as err:
        raise RunDirError(f"{path}/run.json cannot be read ({err.strerror})") from None
    if not isinstance(meta, dict):
        raise RunDirError(f"{path}/run.json is not a JSON object (found {type(meta).__name__})")
    return meta


def _ours(name: str) -> bool:
    """A name a run directory being made may already hold: the lock file or a temporary file."""
    return name == LOCK_NAME or (name.startswith(".") and name.endswith(".tmp"))


def _number_text(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)

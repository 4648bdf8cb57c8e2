"""Run directories: one per resolved config, named ``{name}-{digest}``.

Layout: ``run.json`` (format, version, digest), ``config.yaml``, ``metrics.jsonl``,
``checkpoint.safetensors`` (model + optimiser, for resuming), ``model.safetensors`` (final
weights), ``analysis/*.json``, ``figures/*.png``.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import torch
import yaml

from taskgeom import __version__, tasks
from taskgeom.config import ConfigError, RunConfig, build_config
from taskgeom.errors import RunDirError
from taskgeom.model import Transformer
from taskgeom.rng import fold_seed
from taskgeom.storage import atomic_write_json, atomic_write_text, load_module_state, load_tensors

RUN_FORMAT = 1
_FAMILY_SETTINGS = {"family", "n_major", "diversity", "p_minor", "seq_len", "n_examples"}


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
        if (path / "config.yaml").exists() or (path / "run.json").exists():
            existing = cls.open(path)
            if existing.config.digest() != config.digest():
                raise RunDirError(f"run directory {path} was made by a different config ({existing.config.digest()}, this one is {config.digest()})")
            return existing
        if path.exists() and any(path.iterdir()):
            raise RunDirError(f"{path} exists and is not a taskgeom run directory; choose another path")
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        atomic_write_json(path / "run.json", {"format": RUN_FORMAT, "taskgeom": __version__, "digest": config.digest()})
        return cls(path, config)

    @classmethod
    def open(cls, path: Path | str) -> "Run":
        """An existing run directory; checks its format version and config."""
        path = Path(path)
        if not (path / "run.json").is_file() or not (path / "config.yaml").is_file():
            raise RunDirError(f"{path} is not a taskgeom run directory (no run.json / config.yaml)")
        try:
            meta = json.loads((path / "run.json").read_text())
            raw = yaml.safe_load((path / "config.yaml").read_text())
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise RunDirError(f"{path}: run.json or config.yaml is unreadable ({err})") from None
        if meta.get("format") != RUN_FORMAT:
            raise RunDirError(f"{path} was written by taskgeom {meta.get('taskgeom')} (run format {meta.get('format')}); this version reads format {RUN_FORMAT}")
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
        settings = self.config.task.model_dump()
        return tasks.make(settings["family"], **{k: v for k, v in settings.items() if k not in _FAMILY_SETTINGS})

    @cached_property
    def pool(self) -> tasks.TaskPool:
        task = self.config.task
        return self.family.sample_pool(task.n_major, tasks.n_minor_for_diversity(task.diversity), task.p_minor, seed=self.config.train.seed)

    def new_model(self) -> torch.nn.Module:
        """A freshly initialised model (ours, or for model.arch gpt2 / llama the Hugging Face one
        behind ``hf.HFCausalLM``); its weights depend on the seed alone."""
        torch.manual_seed(fold_seed(self.config.train.seed, 0, "init"))
        if self.config.model.arch != "taskgeom":
            from taskgeom import hf

            return hf.build(self.config.model, **self.family.model_io())
        return Transformer(self.config.model, **self.family.model_io())

    @property
    def sites(self) -> tuple[str, ...]:
        """The hook sites of this run's model (``new_model().sites``), known without building it."""
        if self.config.model.arch != "taskgeom":
            from taskgeom import hf

            return hf.SITES
        return Transformer.sites

    def load_model(self) -> torch.nn.Module:
        """The finished model; RunDirError if training has not finished."""
        if not self.finished:
            raise RunDirError(f"{self.path} has no finished model (model.safetensors); train it first")
        tensors, _ = load_tensors(self.model_path, self.config.digest())
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
            model = self.new_model()
            load_module_state(model, tensors, path)
            models[int(meta["step"])] = model.eval()
        return models

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def finished(self) -> bool:
        return self.model_path.is_file()

    def metrics(self) -> list[dict]:
        """The evaluation records of metrics.jsonl, in order."""
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

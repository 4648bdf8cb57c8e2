"""Atomic file writes and safetensors checkpoints that refuse foreign or damaged files."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from taskgeom.errors import CheckpointError

CHECKPOINT_FORMAT = "taskgeom-checkpoint-1"


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Atomic safetensors write with string metadata (``format`` added)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": CHECKPOINT_FORMAT, **meta})
    os.replace(tmp, path)


def load_tensors(path: Path, digest: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a checkpoint written by ``save_tensors``; check its format and config digest."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a taskgeom checkpoint (format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
    if digest is not None and meta.get("config_digest") != digest:
        raise CheckpointError(f"checkpoint {path} was written for config {meta.get('config_digest')}, not this run's config {digest}")
    return tensors, meta


def load_module_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path, prefix: str = "") -> None:
    """Load ``tensors`` (keys under ``prefix``) into ``module``, naming any key or shape mismatch."""
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model expects {tuple(expected[key].shape)}")
    module.load_state_dict(state)

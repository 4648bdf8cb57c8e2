"""Shared fixtures: tiny configs that train in seconds."""

from __future__ import annotations

import pytest
import torch

from taskgeom.config import RunConfig, build_config

torch.set_num_threads(1)


def tiny_config(family: str = "dice", **train) -> RunConfig:
    """A 1-layer, 16-wide model on short sequences; ``train`` overrides train settings."""
    raw = {
        "name": f"tiny-{family}",
        "task": {"family": family, "seq_len": 16},
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 16},
        "train": {"steps": 40, "batch_size": 8, "eval_every": 10, "checkpoint_every": 10, "eval_batch": 16, "lr": 3e-3, "threads": 1} | train,
    }
    return build_config(raw)


@pytest.fixture
def tiny():
    return tiny_config

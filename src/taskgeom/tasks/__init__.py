"""Latent-task data families: ``tasks.make(name, **settings)`` builds one by name."""

from __future__ import annotations

from taskgeom.tasks.base import Batch, TaskFamily, TaskPool, TokenFamily, n_minor_for_diversity, pool_weights
from taskgeom.tasks.dice import Dice
from taskgeom.tasks.dyck import Dyck
from taskgeom.tasks.markov import Markov
from taskgeom.tasks.regression import Regression

FAMILIES: dict[str, type[TaskFamily]] = {"dice": Dice, "markov": Markov, "regression": Regression, "dyck": Dyck}


def make(name: str, **settings) -> TaskFamily:
    """The family called ``name`` (one of FAMILIES) with its settings (vocab_size, alpha, d, noise, ...)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name](**settings)


__all__ = ["Batch", "FAMILIES", "TaskFamily", "TaskPool", "TokenFamily", "make", "n_minor_for_diversity", "pool_weights"]

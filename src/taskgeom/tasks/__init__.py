"""Latent-task data families: ``tasks.make(name, **settings)`` builds one by name, from the
registry (``tasks.registry``) that the shipped families join here and other packages' families
through the entry-point group ``taskgeom.families``."""

from __future__ import annotations

from taskgeom.tasks.base import Batch, TaskFamily, TaskPool, TaskProbe, TokenFamily, n_minor_for_diversity, pool_weights
from taskgeom.tasks.dice import Dice
from taskgeom.tasks.dyck import Dyck
from taskgeom.tasks.markov import Markov
from taskgeom.tasks.registry import (
    FAMILIES,
    FamilyError,
    build_family,
    families,
    family_class,
    register,
    settings_model,
)
from taskgeom.tasks.regression import Regression

for _family in (Dice, Markov, Regression, Dyck):
    register(_family)


def make(name: str, **settings) -> TaskFamily:
    """The family called ``name`` with its settings (vocab_size, alpha, d, noise, ...; the rest take
    the defaults of the family's settings model, which also checks them)."""
    return build_family(settings_model(name).model_validate(settings))


__all__ = [
    "Batch",
    "FAMILIES",
    "FamilyError",
    "TaskFamily",
    "TaskPool",
    "TaskProbe",
    "TokenFamily",
    "build_family",
    "families",
    "family_class",
    "make",
    "n_minor_for_diversity",
    "pool_weights",
    "register",
    "settings_model",
]

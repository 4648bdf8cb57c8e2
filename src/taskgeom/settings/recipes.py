"""Recipes: the shipped YAML files (``e1`` ... ``e4``) or any other, found by name or by path. A
recipe's ``base`` and ``profiles`` make its run configs (``config.load_config``); its ``study``
section declares what ``taskgeom reproduce`` measures on it:

```yaml
study:
  section: "E4: planted Dyck"            # its section of the report
  experiments:                           # in order; a generic experiment by name, or one of its own
    m1: {}                               # M1's geometry on its k = -1 runs
    dual_modes: {profiles: [paper]}      # the diversity sweep, at these profiles only
    e4: {run: "taskgeom.extras.dyck:e4", options: {references: [e1, e3]}}
```

An experiment of its own (``run: module:function``) is called as ``function(ctx, study,
**options)`` and may carry ``function.runs(ctx, study, **options)`` (the runs it needs, for the schedule)
and its module an ``evidence(table)`` (its interactive figures in the report)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import Field, ValidationError

from taskgeom.settings.config import DEFAULT_PROFILE, ConfigError, RunConfig, describe_validation, load_config, read_recipe
from taskgeom.settings.fields import StrictModel

RECIPE_DIR = Path(__file__).parents[1] / "configs"  # the package's configs/ folder


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str | Path) -> Path:
    """A path as given if it exists, else the shipped recipe of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RECIPE_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"no config file {str(name_or_path)!r} and no shipped recipe of that name; recipes: {recipe_names()}")


def load_recipe(name_or_path: str | Path, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
    return load_config(recipe_path(name_or_path), profile, list(overrides))


class ExperimentEntry(StrictModel):
    run: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module:function of an experiment of the recipe's own")
    profiles: list[str] | None = Field(None, description="only at these profiles; all when left out")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of an experiment of its own")


class StudySection(StrictModel):
    section: str = Field(min_length=1)
    experiments: dict[str, ExperimentEntry]


@dataclass(frozen=True)
class Study:
    """One recipe's part in a reproduction: its name (the file's stem: ``e1``, the prefix of its
    claims), its file, its report section's title, the experiments it takes part in and the
    profiles the recipe defines (in its order)."""

    name: str
    path: Path
    section: str
    experiments: dict[str, ExperimentEntry]
    profiles: tuple[str, ...]

    def takes_part(self, experiment: str, profile: str) -> bool:
        entry = self.experiments.get(experiment)
        return entry is not None and (entry.profiles is None or profile in entry.profiles)


def load_study(name_or_path: str | Path) -> Study:
    """The study section of a recipe; ConfigError naming the file when it has none or a wrong one."""
    path = recipe_path(name_or_path)
    recipe = read_recipe(path)
    section = recipe.study
    if section is None:
        raise ConfigError(f"{path}: no study section; `taskgeom reproduce` measures a recipe that declares what it takes part in "
                          "(see taskgeom.settings.recipes)")
    try:
        study = StudySection.model_validate(section)
    except ValidationError as err:
        raise ConfigError(f"{path}: {describe_validation(err, ('study',))}") from None
    return Study(path.stem, path, study.section, study.experiments, tuple(recipe.profiles))


def experiment_function(reference: str) -> Callable:
    """The function ``module:function`` names; ConfigError when it cannot be imported."""
    module, name = reference.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"experiment {reference!r} cannot be loaded: {type(err).__name__}: {err}") from None

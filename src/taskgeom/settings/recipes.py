"""Recipes, read here and nowhere else. A recipe is a YAML file (the shipped ``e1`` ... ``e4``, or
any other, found by name or by path) whose ``base`` settings merged with one of its ``profiles`` (a
profile may ``extends`` another), then dotted command-line overrides (``--set train.steps=200``),
make a run's config (``load_recipe``, ``build_config``; the schema is ``taskgeom.settings.config``). A
profile's ``measure:`` section holds what it measures beside its runs' settings (``load_measure``),
and the recipe's ``study`` section declares what ``taskgeom reproduce`` measures on it
(``load_study``):

```yaml
study:
  section: "E4: planted Dyck"            # its section of the report
  experiments:                           # registered experiments by name (taskgeom.claims.registry)
    m1: {}                               # M1's geometry on its k = -1 runs
    dual_modes: {profiles: [paper]}      # the diversity sweep, at these profiles only
    e4: {options: {references: [e1, e3]}}  # E4's own study, with what it reads of other recipes
```

An experiment reads the ``options`` of each recipe that takes part in it (``Study.options``)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from taskgeom.analysis.protocol import STUDY, Protocol
from taskgeom.settings.config import ConfigError, RunConfig, describe_validation, describe_value
from taskgeom.settings.fields import Int, PositiveInt, StrictModel

DEFAULT_PROFILE = "quick"  # the profile every command reads when none is named: every recipe defines it
RECIPE_DIR = Path(__file__).parents[1] / "configs"  # the package's configs/ folder
SHARED_PROFILES = RECIPE_DIR / "shared" / "profiles.yaml"  # the profiles every recipe has, written once


# ---- dotted overrides -----------------------------------------------------------------------
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=200"`` -> (["train", "steps"], 200); the value is read as plain YAML (no tags)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    try:
        if any(isinstance(token, yaml.TagToken) for token in yaml.scan(value)):
            raise ConfigError(f"override {text!r}: YAML tags (!...) are not allowed in a value; write the plain value")
        return key.strip().split("."), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({yaml_problem(err)})") from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what is wrong and where (line and column, counted from 1)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build_config(raw: dict, overrides: list[str] = ()) -> RunConfig:
    """Validate a plain dict (after dotted overrides) into a RunConfig, or raise ConfigError."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation(err)) from None


# ---- reading a recipe file: profiles and what they measure ---------------------------------
class MeasureSettings(StrictModel):
    """What a profile measures beside its runs' settings (a profile's ``measure:`` section, inherited
    through ``extends``): the diversity grid of the dual-mode sweep (the claims read its lowest and
    highest k), the sizes of the study's Fig. 4 statistic (docs/protocol.md, "Projection R^2") and the
    analyses' sample sizes it changes from the study's (``protocol``: fields of
    ``taskgeom.analysis.protocol.Protocol``'s ``SAMPLE_SIZES``, checked when a reproduction reads them)."""

    grid: list[Int] = Field(
        default_factory=lambda: [-1, 4, 10], min_length=2, description="diversities k of the dual-mode sweep"
    )
    projection_tasks: PositiveInt = Field(
        1024,
        description="OOD tasks of the claims' projection R^2 ([ours]: 8x the study's 128 draw, "
        "which is written beside it)",
    )
    projection_per_task: PositiveInt = Field(
        128, description="sequences per OOD task and per major task's mean (the study's 128)"
    )

    protocol: dict[str, Any] = Field(
        default_factory=dict,
        description="the analyses' sample sizes this profile changes from the study's protocol (the smoke profile's)",
    )

    @field_validator("protocol")
    @classmethod
    def _sample_sizes(cls, value: dict[str, Any]) -> dict[str, Any]:
        STUDY.changed(value)  # ValueError naming a field that is no sample size, or a wrong value
        return value

    @property
    def analysis_protocol(self) -> Protocol:
        """The protocol the analyses measure under at this profile: the study's with ``protocol``'s sizes."""
        return STUDY.changed(self.protocol)

    @property
    def projection_sizes(self) -> tuple[int, int]:
        """(OOD tasks, sequences per task) of projection R^2."""
        return self.projection_tasks, self.projection_per_task


@dataclass(frozen=True)
class Recipe:
    """A recipe file read once (``read_recipe``): its ``base`` settings, its ``profiles`` (each with
    ``extends`` resolved, its ``measure`` section validated) and its raw ``study`` section
    (``load_study`` validates it)."""

    path: Path
    base: dict
    profiles: dict[str, dict]
    measures: dict[str, MeasureSettings]
    study: Any

    def _known(self, profile: str) -> str:
        """``profile``, or ConfigError naming the profiles the recipe defines."""
        if profile not in self.profiles:
            raise ConfigError(f"{self.path}: unknown profile {profile!r}; available: {sorted(map(str, self.profiles))}")
        return profile

    def settings(self, profile: str = DEFAULT_PROFILE) -> dict:
        """``base`` merged with ``profiles[profile]``, less its ``measure`` section and ``about``."""
        settings = merge(self.base, self.profiles[self._known(profile)])
        settings.pop("measure", None)
        settings.pop("about", None)
        return settings

    def about(self, profile: str) -> str:
        """What ``profile`` is, in words (its ``about``; "" when it has none)."""
        return str(self.profiles[self._known(profile)].get("about", ""))

    def config(self, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
        """The run config of ``profile`` with dotted ``overrides``."""
        return build_config(self.settings(profile), overrides)

    def measure(self, profile: str = DEFAULT_PROFILE) -> MeasureSettings:
        """The ``measure:`` section of ``profile`` (its defaults where the profile has none)."""
        return self.measures[self._known(profile)].model_copy(deep=True)


def read_recipe(path: str | Path) -> Recipe:
    """The recipe at ``path``, parsed and validated once per content of the file (a file written
    again is read again); ConfigError for a file that is not a recipe, naming the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    return _read_recipe(path, path.read_bytes())


@functools.lru_cache(maxsize=64)
def _read_recipe(path: Path, content: bytes) -> Recipe:
    try:
        recipe = yaml.safe_load(content.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the recipe as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = set(recipe) - {"base", "profiles", "study"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown, key=str)}; allowed: base, profiles, study")
    base, profiles = recipe.get("base") or {}, recipe.get("profiles") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: 'base' must be a mapping of settings, got {describe_value(base)}")
    if not isinstance(profiles, dict):
        raise ConfigError(
            f"{path}: 'profiles' must be a mapping of profile names to settings, got {describe_value(profiles)}"
        )
    shared = {
        name: settings
        for name, settings in shared_profiles().items()
        if name not in profiles and settings.get("extends") in profiles
    }
    profiles = {**profiles, **shared}
    resolved = {str(name): _profile_settings(path, profiles, name) for name in profiles}
    measures = {}
    for name, settings in resolved.items():
        try:
            measures[name] = MeasureSettings.model_validate(settings.get("measure") or {})
        except ValidationError as err:
            raise ConfigError(f"{path}: {describe_validation(err, ('profiles', name, 'measure'))}") from None
    return Recipe(path, base, resolved, measures, recipe.get("study"))


def load_measure(path: str | Path, profile: str = DEFAULT_PROFILE) -> MeasureSettings:
    """The ``measure:`` section of ``profiles[profile]`` of the recipe at ``path`` (``MeasureSettings``;
    its defaults where the profile has none); ConfigError naming the field when it is wrong."""
    return read_recipe(path).measure(profile)


def load_config(path: str | Path, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe: its ``base`` section merged with ``profiles[profile]`` (less its ``measure``
    section, ``load_measure``'s), then overrides (its ``study`` section is ``load_study``'s)."""
    return read_recipe(path).config(profile, overrides)


def _profile_settings(path: Path, profiles: dict, profile: str, seen: tuple[str, ...] = ()) -> dict:
    """``profiles[profile]`` with ``extends: OTHER`` resolved: OTHER's settings, then its own over them."""
    if profile not in profiles:
        raise ConfigError(f"{path}: unknown profile {profile!r}; available: {sorted(map(str, profiles))}")
    if profile in seen:
        raise ConfigError(f"{path}: profiles extend each other in a cycle: {' -> '.join([*seen, profile])}")
    settings = profiles[profile] or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: profiles.{profile} must be a mapping of settings, got {describe_value(settings)}")
    settings = dict(settings)
    parent = settings.pop("extends", None)
    if parent is None:
        return settings
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: profiles.{profile}.extends must name another profile, got {describe_value(parent)}")
    inherited = _profile_settings(path, profiles, parent, (*seen, profile))
    inherited.pop("about", None)  # what a profile is is its own
    return merge(inherited, settings)


@functools.lru_cache(maxsize=1)
def shared_profiles() -> dict[str, dict]:
    """The profiles every recipe has unless it defines one of the name (``SHARED_PROFILES``), each
    extending one of the recipe's own."""
    profiles = yaml.safe_load(SHARED_PROFILES.read_text(encoding="utf-8"))["profiles"]
    return {str(name): dict(settings) for name, settings in profiles.items()}


# ---- recipes by name, and their study sections ----------------------------------------------
def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def common_profiles() -> dict[str, str]:
    """{profile: what it is} of the profiles every shipped recipe defines, in the first recipe's
    order: the choices of ``--profile``."""
    recipes = [read_recipe(recipe_path(name)) for name in recipe_names()]
    return {
        name: recipes[0].about(name) for name in recipes[0].profiles if all(name in r.profiles for r in recipes[1:])
    }


def profiles_help(lead: str) -> str:
    """``lead``, then each common profile and what it is: the help of a ``--profile`` option."""
    return (
        f"{lead}: "
        + "; ".join(f"{name} ({about})" if about else name for name, about in common_profiles().items())
        + "."
    )


def recipe_path(name_or_path: str | Path) -> Path:
    """A path as given if it exists, else the shipped recipe of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RECIPE_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(
        f"no config file {str(name_or_path)!r} and no shipped recipe of that name; recipes: {recipe_names()}"
    )


def load_recipe(name_or_path: str | Path, profile: str = DEFAULT_PROFILE, overrides: list[str] = ()) -> RunConfig:
    """The run config of ``profile`` of the recipe ``name_or_path`` (``recipe_path``) with dotted ``overrides``."""
    return load_config(recipe_path(name_or_path), profile, list(overrides))


class ExperimentEntry(StrictModel):
    profiles: list[str] | None = Field(None, description="only at these profiles; all when left out")
    options: dict[str, Any] = Field(default_factory=dict, description="what the experiment reads of this recipe")


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

    def options(self, experiment: str) -> dict[str, Any]:
        """What ``experiment`` reads of this recipe (its entry's ``options``)."""
        return dict(self.experiments[experiment].options)


def load_study(name_or_path: str | Path) -> Study:
    """The study section of a recipe; ConfigError naming the file when it has none or a wrong one."""
    path = recipe_path(name_or_path)
    recipe = read_recipe(path)
    section = recipe.study
    if section is None:
        raise ConfigError(
            f"{path}: no study section; `taskgeom reproduce` measures a recipe that declares what it takes part in "
            "(see taskgeom.settings.recipes)"
        )
    try:
        study = StudySection.model_validate(section)
    except ValidationError as err:
        raise ConfigError(f"{path}: {describe_validation(err, ('study',))}") from None
    return Study(path.stem, path, study.section, study.experiments, tuple(recipe.profiles))

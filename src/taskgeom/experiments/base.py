"""Shared pieces of the experiments: the output folder, training runs on demand, collecting
claims and figures (``Context``); the experiments themselves are registered (``claims.registry``)
and the ``reproduce`` driver above them is the package's (``taskgeom.experiments``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ContextManager

import torch

from taskgeom.analysis.protocol import STUDY, Protocol
from taskgeom.claims.rules import Claim
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.schedule import TrainTask
from taskgeom.progress import step_bar
from taskgeom.runs.folders import Run
from taskgeom.settings.config import ConfigError, RunConfig
from taskgeom.settings.recipes import (
    DEFAULT_PROFILE,
    Study,
    load_measure,
    load_recipe,
    load_study,
    recipe_names,
)
from taskgeom.training.memory import check_training_fits
from taskgeom.training.timing import Timings
from taskgeom.training.train import train


@dataclass(frozen=True)
class Figure:
    """A registered figure: its PNG path relative to the output folder, its caption, the
    experiment that drew it and the ids of the claims it is evidence for."""

    path: str
    caption: str
    experiment: str
    claims: tuple[str, ...] = ()


@dataclass
class Context:
    """Where one reproduction writes, its profile, the training seeds every setting is trained on,
    where its sweeps run (``executor``), where its runs train and what they also log to
    (``device``, ``tracker``), and what the experiments have produced: ``measured`` holds each
    claim once per seed, ``claims`` the claims judged over the seeds (``over_seeds``)."""

    out: Path
    profile: str = DEFAULT_PROFILE
    seeds: tuple[int, ...] = (0,)
    executor: Executor = Executor()
    device: str = "auto"
    tracker: str = "none"
    overrides: tuple[str, ...] = ()  # ``--set`` settings applied to every run's recipe, before each run's own
    studies: tuple[Study, ...] = field(
        default_factory=lambda: shipped_studies()
    )  # the recipes measured, with what each takes part in
    diversities: tuple[int, ...] | None = None  # the sweep's diversity grid (``--grid``); None: the profile's
    measured: list[tuple[int, Claim]] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)  # where the time goes (timings.json)
    experiment: str = ""  # the experiment running now
    made_by: dict[str, str] = field(default_factory=dict)  # claim id -> the experiment that checked it
    used: dict[str, None] = field(default_factory=dict)  # the run directories (names) the experiments used, in order
    forms: dict = field(
        default_factory=dict
    )  # protocol.EARLIER's choices (the claims' forms, the V search) measured and judged under, if not the study's

    def stage(self, name: str) -> ContextManager[None]:
        """Time a block as stage ``name`` of the current experiment."""
        return self.timings.stage(self.experiment, name)

    @property
    def runs_root(self) -> Path:
        return self.out / "runs"

    def figure(self, name: str, caption: str, claims: tuple[str, ...] = ()) -> Path:
        """Register figure ``figures/name`` with its caption and the claims it is evidence for;
        returns the path to save it to (the PNG; a PDF is saved beside it)."""
        path = self.out / "figures" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        self.figures.append(Figure(f"figures/{name}", caption, self.experiment, tuple(claims)))
        return path

    def claim(self, seed: int, *claims: Claim) -> None:
        """Record ``claims`` as measured on the runs of training seed ``seed``, stamped with this profile."""
        self.measured.extend((seed, replace(claim, profile=self.profile)) for claim in claims)

    @property
    def protocol(self) -> Protocol:
        """The protocol the analyses measure under: the study's, with the sample sizes the profile's
        ``measure: {protocol: ...}`` sets (``MeasureSettings.analysis_protocol``), the same in every
        recipe measured."""
        found = {study.name: load_measure(study.path, self.profile).analysis_protocol for study in self.studies}
        if len(set(found.values())) > 1:
            raise ConfigError(
                f"the recipes' profiles {self.profile!r} set different sample sizes of the protocol ({sorted(found)}); "
                "give them one measure: protocol: section"
            )
        return replace(next(iter(found.values()), STUDY), **self.forms)

    def taking_part(self, experiment: str) -> tuple[Study, ...]:
        """The studies (recipes) that declare ``experiment`` at this profile, in their order."""
        return tuple(study for study in self.studies if study.takes_part(experiment, self.profile))

    def config(self, recipe: str, overrides: tuple[str, ...] = (), seed: int = 0) -> RunConfig:
        """``recipe`` (a study's name, else a shipped recipe or a file) under this profile, with this
        reproduction's overrides, then ``overrides``, trained on ``seed``."""
        source = next((study.path for study in self.studies if study.name == recipe), recipe)
        return load_recipe(source, self.profile, [*self.overrides, *overrides, f"train.seed={seed}"])

    def plans(self, recipe: str, overrides: tuple[str, ...] = (), threads: int = 0) -> list[TrainTask]:
        """The runs ``trained(recipe, overrides, seed)`` gives for every seed, as tasks for the
        training schedule, with the torch threads each trains with: its config's ``train.threads``,
        else ``threads``, else this process's (as ``trained`` would use)."""
        configs = [self.config(recipe, overrides, seed) for seed in self.seeds]
        return [
            TrainTask(
                config,
                str(self.runs_root),
                self.device,
                self.tracker,
                config.train.threads or threads or torch.get_num_threads(),
            )
            for config in configs
        ]

    def trained(self, recipe: str, overrides: tuple[str, ...] = (), seed: int = 0) -> Run:
        """The run of ``recipe`` under this profile on training seed ``seed``, trained now unless
        already finished."""
        config = self.config(recipe, overrides, seed)
        if not (self.runs_root / f"{config.name}-{config.digest()}" / "model.safetensors").exists():
            check_training_fits(config, self.device)  # before its run directory is made
        run = Run.create(config, self.runs_root)
        self.used[run.path.name] = None
        if not run.finished:
            with (
                self.stage(f"train {run.path.name}"),
                step_bar(f"train {run.path.name}", run.config.train.steps) as update,
            ):
                train(run, update, self.device, self.tracker)
        return run


def shipped_studies() -> tuple[Study, ...]:
    """The study sections of the shipped recipes, by name."""
    return tuple(load_study(name) for name in recipe_names())

"""The registry of experiments: what ``taskgeom reproduce`` can run, each one an ``Experiment`` that
owns its claims. A recipe's ``study`` section names the experiments it takes part in; the claims'
catalog (``claims.catalog``), the thresholds page and ``--plan``'s costs are built from here.

The shipped experiments (``SHIPPED``, in the order a reproduction runs them) join the first time the
registry is read; an experiment from another package joins through the entry-point group
``taskgeom.experiments`` (name = the experiment's name, object = its ``Experiment``), after them in
the order of their names, so a plugin can ship claims as it ships a family
(``taskgeom.tasks.registry``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Optional

from taskgeom.claims.rules import Spec
from taskgeom.errors import TaskgeomError

ENTRY_POINT_GROUP = "taskgeom.experiments"
# The shipped experiments' modules, each with an ``EXPERIMENT``: the generic ones, then the recipes' own studies
SHIPPED = (
    "taskgeom.experiments.bayes_optimum",
    "taskgeom.experiments.m1",
    "taskgeom.experiments.dual_modes",
    "taskgeom.studies.e2",
    "taskgeom.studies.e4",
)


class ExperimentError(TaskgeomError, ValueError):
    """An experiment that cannot be registered or found; the message names it and its package."""


@dataclass(frozen=True)
class Experiment:
    """One experiment of ``taskgeom reproduce`` and the claims it owns. Its functions take the
    reproduction's ``taskgeom.experiments.base.Context`` (``ctx``; ``ctx.taking_part(name)`` gives
    the recipes that declare it, each with its ``options``):

    - ``measure(ctx)``: measures, records each claim per seed (``ctx.claim``) and draws the figures;
    - ``runs(ctx) -> list[TrainTask]``: the runs it reads, trained first by the schedule (none by default);
    - ``prepare(ctx) -> list[Prepared]``: the measurements it stores, made by the schedule on its pool
      as soon as what each reads is done (``experiments.schedule.Prepared``); it reads them back (None: none);
    - ``left(ctx) -> list[str]``: for ``--plan``, one run name per unit of its stored measurement not
      stored yet (None: it stores nothing, its cost is not counted);
    - ``cost``: CPU seconds of one such unit per second its run's training FLOPs take at one thread's
      matrix-multiply rate (``--plan``, scaled by the model's blocks), on the schedule's pool when
      ``on_pool`` and else in the reproducing process after it;
    - ``evidence(table) -> list[Evidence]``: the report's interactive pieces from the results folder's
      analysis table (None: none);
    - ``reads``: the family declarations its analyses read (``TaskFamily``, docs/adding-a-family.md).

    ``claims`` are its claims' specs, each naming this experiment."""

    name: str
    claims: tuple[Spec, ...]
    measure: Callable[[Any], None]
    runs: Callable[[Any], list] = lambda ctx: []
    prepare: Optional[Callable[[Any], list]] = None
    left: Optional[Callable[[Any], list[str]]] = None
    cost: float = 0.0
    on_pool: bool = False
    evidence: Optional[Callable[[Any], list]] = None
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        foreign = [spec.name for spec in self.claims if spec.experiment != self.name]
        if foreign:
            raise ExperimentError(f"experiment {self.name!r}: its claims {foreign} name another experiment")

    def __call__(self, ctx: Any) -> None:
        self.measure(ctx)


EXPERIMENTS: dict[str, Experiment] = {}
_SOURCES: dict[str, str] = {}
_loaded = False


def register(experiment: Experiment, source: str = "taskgeom") -> Experiment:
    """Add ``experiment`` under its name; ExperimentError if it is no Experiment or its name is taken."""
    if not isinstance(experiment, Experiment):
        raise ExperimentError(f"{source}: {experiment!r} is not a taskgeom.claims.registry.Experiment")
    name = experiment.name
    if name in EXPERIMENTS and EXPERIMENTS[name] is not experiment:
        raise ExperimentError(
            f"experiment {name!r} is registered twice: by {_SOURCES[name]} and by {source}; uninstall one of them"
        )
    EXPERIMENTS[name], _SOURCES[name] = experiment, source
    return experiment


def _load() -> None:
    """Register the shipped experiments, then the entry-point group's (once per process)."""
    global _loaded
    if _loaded:
        return
    for module in SHIPPED:
        register(importlib.import_module(module).EXPERIMENT)
    for entry in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        source = f"package {entry.dist.name if entry.dist else '?'} (entry point {entry.name} = {entry.value})"
        try:
            experiment = entry.load()
        except Exception as err:  # any import failure of a plugin is reported as the plugin's
            raise ExperimentError(f"{source} failed to import: {type(err).__name__}: {err}") from None
        if getattr(experiment, "name", None) != entry.name:
            raise ExperimentError(f"{source}: the entry point's name must be the experiment's name")
        register(experiment, source)
    _loaded = True  # only once every one has joined: a failed plugin fails every lookup, not only the first


def experiments() -> dict[str, Experiment]:
    """Every registered experiment by name, in the order a reproduction runs them."""
    _load()
    return dict(EXPERIMENTS)


def experiment(name: str) -> Experiment:
    """The experiment registered as ``name``; ExperimentError listing the registered ones otherwise."""
    known = experiments()
    if name not in known:
        raise ExperimentError(
            f"unknown experiment {name!r}; registered: {', '.join(known)} (an experiment from another package joins "
            f"through the entry-point group {ENTRY_POINT_GROUP})"
        )
    return known[name]

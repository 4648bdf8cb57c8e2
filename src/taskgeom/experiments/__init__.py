"""The experiments behind ``taskgeom reproduce``: the generic ones (``EXPERIMENTS``, in order), run on
every recipe whose ``study`` section declares them, then each recipe's own (``run: module:function``);
each adds claims and figures."""

from __future__ import annotations

from taskgeom.experiments.base import Context, Experiment, Extra, reproduce
from taskgeom.experiments.bayes_optimum import bayes_optimum
from taskgeom.experiments.dual_modes import dual_modes
from taskgeom.experiments.m1 import m1
from taskgeom.config import ConfigError
from taskgeom.recipes import Study, experiment_function

EXPERIMENTS = {"bayes_optimum": bayes_optimum, "m1": m1, "dual_modes": dual_modes}


def declared(studies: tuple[Study, ...], profile: str) -> dict[str, Experiment]:
    """The experiments ``studies`` declare at ``profile``: the generic ones any of them takes part in,
    in EXPERIMENTS' order, then the studies' own in theirs; ConfigError for an unknown name or a
    ``run`` that cannot be loaded, and for two studies' experiments of one name."""
    generic = {name: entry for study in studies for name, entry in study.experiments.items() if entry.run is None}
    unknown = sorted(set(generic) - set(EXPERIMENTS))
    if unknown:
        owners = sorted(study.name for study in studies if set(study.experiments) & set(unknown))
        raise ConfigError(f"recipes {owners}: unknown experiments {unknown}; generic ones: {list(EXPERIMENTS)} "
                          "(an experiment of a recipe's own names its function with run: module:function)")
    chosen: dict[str, Experiment] = {name: run for name, run in EXPERIMENTS.items()
                                     if any(study.takes_part(name, profile) for study in studies)}
    for study in studies:
        for name, entry in study.experiments.items():
            if entry.run is None or not study.takes_part(name, profile):
                continue
            if name in chosen:
                raise ConfigError(f"recipe {study.name}: experiment {name!r} is declared by another recipe too; give it a name of its own")
            chosen[name] = Extra(experiment_function(entry.run), study, entry.options)
    return chosen


__all__ = ["Context", "EXPERIMENTS", "declared", "reproduce"]

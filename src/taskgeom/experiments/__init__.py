"""The experiments behind ``taskgeom reproduce``, run in order; each adds claims and figures."""

from __future__ import annotations

from taskgeom.experiments.base import Context, reproduce
from taskgeom.experiments.bayes_optimum import bayes_optimum
from taskgeom.experiments.dual_modes import dual_modes
from taskgeom.experiments.e2 import e2
from taskgeom.experiments.e4 import e4
from taskgeom.experiments.m1 import m1

EXPERIMENTS = {"bayes_optimum": bayes_optimum, "m1": m1, "dual_modes": dual_modes, "e2": e2, "e4": e4}

__all__ = ["Context", "EXPERIMENTS", "reproduce"]

"""The experiments behind ``taskgeom reproduce``, run in order; each adds claims and figures."""

from __future__ import annotations

from taskgeom.experiments.base import Context, reproduce
from taskgeom.experiments.bayes_optimum import bayes_optimum
from taskgeom.experiments.e2 import e2

EXPERIMENTS = {"bayes_optimum": bayes_optimum, "e2": e2}

__all__ = ["Context", "EXPERIMENTS", "reproduce"]

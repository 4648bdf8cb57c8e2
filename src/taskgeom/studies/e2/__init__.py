"""E2's own study, in-context linear regression at k = -1: the model against the dMMSE (pool
posterior) and ridge (OOD-optimal) predictors (``claims``: the claims, their reading and judgement;
``experiment``: the runs, the measurement and the figure), registered as the experiment ``e2``."""

from taskgeom.claims.registry import Experiment
from taskgeom.studies.e2.claims import SPECS
from taskgeom.studies.e2.experiment import e2, runs

EXPERIMENT = Experiment("e2", SPECS, e2, runs)

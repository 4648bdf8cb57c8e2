"""E4's own study, planted Dyck (docs/concepts.md#e4-where-the-geometry-ends): P0 fails where E1 and
E3 satisfy it, and a probe recovers the earlier bracket prefix from the hidden states; registered as
the experiment ``e4``. ``claims``: its claims, their reading and judgement; ``variance`` and
``prefix``: the two measurements as the study makes them; ``experiment``: the runs, the stored
per-seed measurement and the report's evidence; ``figures``: its figures."""

from taskgeom.claims.registry import Experiment
from taskgeom.studies.e4.claims import SPECS
from taskgeom.studies.e4.experiment import COST, e4, evidence, left, prepare, runs

EXPERIMENT = Experiment("e4", SPECS, e4, runs, prepare=prepare, left=left, cost=COST, on_pool=True, evidence=evidence)

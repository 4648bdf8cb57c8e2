"""E4's own study, planted Dyck (docs/concepts.md#e4-where-the-geometry-ends): P0 fails where E1 and
E3 satisfy it, and a probe recovers the earlier bracket prefix from the hidden states; registered as
the experiment ``e4``. ``claims``: its claims, their reading and judgement; ``variance`` and
``prefix``: the two measurements as the study makes them; ``experiment``: the runs, the stored
per-seed measurement and the report's evidence; ``figures``: its figures."""

from taskgeom.claims.registry import Experiment
from taskgeom.studies.e4.claims import SPECS
from taskgeom.studies.e4.experiment import e4, evidence, left, runs

# cost [measured], CPU seconds of one seed's measurement per flop-second of its k = -1 run's training
# (``Experiment.cost``): its P0 and the prefix probe, one thread, 112.6 + 93.4 s on the quick runs
# (docs/benchmarks.md) over 46.9: 4.4, without its linear probes and natural-state P0 (20-35 CPU-s a seed)
EXPERIMENT = Experiment("e4", SPECS, e4, runs, left=left, cost=4.4, evidence=evidence)

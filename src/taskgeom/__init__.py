"""taskgeom: task-vector geometry of in-context task inference in small transformers.

The public API, ``import taskgeom as tg`` (docs/python-api.md walks through a study):

- ``tg.open_run(path)`` -> ``tg.StudyRun``: a finished run (model, family, pool, config) and its
  verbs: ``heldout`` sequences of a named ``tg.Split`` (``heldout_tasks``: whole tasks), ``cache``
  states at a ``tg.Place``, ``geometry`` / ``geometries`` / ``select_place``, ``loss``, ``ablate``
  directions, ``orthogonal_search``, ``projection_r2`` (the study's Fig. 4, a ``tg.ProjectionR2``)
  and its ``projection_reference``, ``snapshots``.
- ``tg.Geometry``: task vectors, basis, token effects, P0-P3, beta at a place; ``steer`` toward a
  point of the simplex, ``ablate`` the task subspace S (a ``tg.Edit``, used as ``with``),
  ``projection_r2``.
- ``tg.share_of_gain`` -> ``tg.Share``: the share of in-context gain an edit removes, with its gain
  (None when the gain is not positive; ``unreliable`` below ``tg.MIN_RELIABLE_GAIN``).
- ``tg.analyze_m1`` and ``tg.analyze_dual``: the stored analyses (``m1.json``, ``dual.json``),
  written with the objects above.
- ``tg.results(folder)`` -> ``tg.Results``: a reproduction's claims and every analysis row.
- ``tg.STUDY``: the study's measurement protocol (a frozen ``tg.Protocol``); ``tg.protocol(name)``
  an earlier convention's copy of it (docs/protocol.md#variants), which ``steer``, ``ablate``,
  ``projection_r2`` and ``orthogonal_search`` take as ``protocol=``; ``with tg.measured_under(p):``
  measures under ``p`` (a results folder's ``tg.results(folder).protocol``: the smoke profile's
  sample sizes).
- ``tg.tasks``: the latent-task families (``tasks.make``).
- ``tg.pin_kernels()``: torch's CPU kernels pinned as every ``taskgeom`` command pins them, so a
  session computes the published bits; call it first, before torch computes anything.
"""

from taskgeom import tasks
from taskgeom.analysis.geometry import Alignment, Geometry
from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN, Share, share_of_gain
from taskgeom.analysis.measures.variants import protocol
from taskgeom.analysis.protocol import STUDY, Protocol, measured_under
from taskgeom.analysis.reading.edits import Edit
from taskgeom.analysis.reading.heldout import Split
from taskgeom.analysis.reading.projection import ProjectionR2
from taskgeom.analysis.reading.steering import Steering
from taskgeom.analysis.stored.dual import analyze_dual
from taskgeom.analysis.stored.m1 import Result as M1Result
from taskgeom.analysis.stored.m1 import analyze as analyze_m1
from taskgeom.analysis.study import Selection, Sequences, StudyRun, open_run
from taskgeom.hooks import Place
from taskgeom.results import Results, results
from taskgeom.settings.kernels import use_portable_kernels as pin_kernels
from taskgeom.version import __version__

__all__ = [
    "open_run",
    "StudyRun",
    "Split",
    "Sequences",
    "Place",
    "Selection",
    "Geometry",
    "Alignment",
    "Steering",
    "Edit",
    "ProjectionR2",
    "share_of_gain",
    "Share",
    "MIN_RELIABLE_GAIN",
    "STUDY",
    "Protocol",
    "protocol",
    "measured_under",
    "analyze_m1",
    "M1Result",
    "analyze_dual",
    "results",
    "Results",
    "tasks",
    "pin_kernels",
    "__version__",
]

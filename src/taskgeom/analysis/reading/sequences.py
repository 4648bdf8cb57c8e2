"""Held-out sequences of a run (``Sequences``) and the run as the objects it hands out read it
back (``StudiedRun``: a ``study.StudyRun``, named here as a protocol so that the sequences, the
geometry and the edits need not import the study above them).

Shapes: ``N`` sequences, ``P`` analysed positions (every position; E2: its separators), ``D``
width, ``K`` major tasks.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol, Sequence

import torch

from taskgeom.analysis.reading.edits import Edited
from taskgeom.analysis.reading.heldout import Inputs, Kind, Split, family_inputs
from taskgeom.hooks import Place
from taskgeom.tasks import Batch, TaskFamily, TaskPool


class StudiedRun(Edited, Protocol):
    """What sequences, geometries and edits read of the run that made them (``study.StudyRun``)."""

    @property
    def family(self) -> TaskFamily: ...

    @property
    def pool(self) -> TaskPool: ...

    @property
    def seed(self) -> int: ...

    @property
    def analysed_positions(self) -> slice | torch.Tensor: ...

    def cache(self, sequences: Sequences, places: Sequence[tuple[int, str]]) -> dict[Place, torch.Tensor]: ...


class Sequences:
    """Held-out sequences of one run: ``batch`` (``kind`` sequences of ``split``), with what the
    analysis reads of them, computed when first asked for."""

    def __init__(self, run: StudiedRun, kind: Kind, split: Split, batch: Batch):
        self.kind, self.split, self.batch = kind, split, batch
        self._family, self._pool = run.family, run.pool

    def __len__(self) -> int:
        return self.batch.tokens.shape[0]

    @cached_property
    def inputs(self) -> Inputs:
        """The family's inputs (analysed positions, current tokens or x_t, posterior over the majors)."""
        return family_inputs(self._family, self.batch, self._pool.subset("major"))

    @property
    def alpha(self) -> torch.Tensor:
        """[N, P, K] the exact posterior over the major tasks after each analysed position."""
        return self.inputs.alpha

    @cached_property
    def references(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (ID-Bayes, OOD-optimal) predictions the losses are scored beside (float64)."""
        return self._family.reference_predictions(self.batch, self._pool)

"""An edit of the states (``Edit``): a change of the states at one ``hooks.Place``, in force on a run's model while its ``with`` block runs (``hooks.intervene``
underneath), so that every call inside the block (``StudyRun.loss``, ``cache``, the model itself)
sees it."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, intervene


class Edited(Protocol):
    """What an edit is in force on (a ``study.StudyRun``): its model and the edits in force there."""

    @property
    def model(self) -> torch.nn.Module: ...

    _edits: list[Edit]


class Edit:
    """A change ``change: [B, P', D] -> [B, P', D]`` of the states at ``place`` on ``positions``
    (None: all), in force on the run's model while its ``with`` block runs (removed on exit, even
    on error)."""

    def __init__(
        self,
        run: Edited,
        place: Place,
        change: Callable[[torch.Tensor], torch.Tensor],
        positions: slice | torch.Tensor | None,
    ):
        self.run, self.place, self.change, self.positions = run, Place(*place), change, positions
        self._hook = None

    def __enter__(self) -> "Edit":
        if self._hook is not None:
            raise AnalysisError(f"this edit at {tuple(self.place)} is already in force")
        self._hook = intervene(self.run.model, self.place, self.change, self.positions)
        self._hook.__enter__()
        self.run._edits.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.run._edits.remove(self)
        hook, self._hook = self._hook, None
        hook.__exit__(*exc)

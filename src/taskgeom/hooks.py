"""Context managers that capture or rewrite residual-stream sites; hooks leave on exit, even on error.

A ``Place`` is ``(layer, site)`` with ``site`` one of the model's ``sites`` (``models.SITES``, every model's): where states are
read or edited, here and in every analysis. Captured tensors are detached ``[B, T, D]`` (or ``[B, len(positions), D]`` when
positions are given).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
from torch import nn

from taskgeom.errors import AnalysisError


class Place(NamedTuple):
    """Where states are read or edited: block ``layer``, hook ``site`` (resid_mid, resid_post, ...)."""

    layer: int
    site: str

    @classmethod
    def at_depth(cls, block: int, of: int, n_layers: int, site: str = "resid_post") -> "Place":
        """The place at the relative depth of the study's block ``block`` of ``of`` (docs/protocol.md) in a model of ``n_layers`` blocks: block ``ceil((block + 1) n_layers / of) - 1``,
        exact when ``n_layers == of``."""
        if not 0 <= block < of or n_layers < 1:
            raise AnalysisError(f"no study block {block} of {of} in a model of {n_layers} blocks")
        return cls(-(-(block + 1) * n_layers // of) - 1, site)  # integer ceil


@contextmanager
def capture(
    model: nn.Module, places: Iterable[Place], positions: Sequence[int] | slice | None = None
) -> Iterator[dict[Place, torch.Tensor]]:
    """Record the value at each place during forward passes inside the block.

    Yields a dict filled as the model runs: ``store[Place(layer, site)] -> [B, T', D]`` (the last pass).
    """
    store: dict[Place, torch.Tensor] = {}
    index = slice(None) if positions is None else positions
    handles = []

    def recorder(place: Place) -> Callable:
        def hook(_module, _inputs, output):
            store[place] = output[:, index].detach()

        return hook

    try:
        for place in places:
            handles.append(model.site(*place).register_forward_hook(recorder(Place(*place))))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def intervene(
    model: nn.Module,
    place: Place,
    edit: Callable[[torch.Tensor], torch.Tensor],
    positions: Sequence[int] | slice | None = None,
) -> Iterator[None]:
    """Replace the value at ``place`` by ``edit(value)`` on the chosen positions.

    edit: [B, T', D] -> [B, T', D]; its output shape is checked.
    """
    index = slice(None) if positions is None else positions

    def hook(_module, _inputs, output):
        chosen = output[:, index]
        edited = edit(chosen)
        if edited.shape != chosen.shape:
            raise ValueError(
                f"intervention at {tuple(place)} returned shape {tuple(edited.shape)}, expected {tuple(chosen.shape)}"
            )
        output = output.clone()
        output[:, index] = edited
        return output

    handle = model.site(*place).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()

"""Context managers that capture or rewrite residual-stream sites; hooks leave on exit, even on error.

A site is ``(layer, name)`` with ``name`` one of the model's ``sites`` (``model.SITES`` for ours). Captured tensors are detached
``[B, T, D]`` (or ``[B, len(positions), D]`` when positions are given).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

Site = tuple[int, str]


@contextmanager
def capture(model: nn.Module, sites: Iterable[Site], positions: Sequence[int] | slice | None = None) -> Iterator[dict[Site, torch.Tensor]]:
    """Record the value at each site during forward passes inside the block.

    Yields a dict filled as the model runs: ``store[(layer, name)] -> [B, T', D]`` (the last pass).
    """
    store: dict[Site, torch.Tensor] = {}
    index = slice(None) if positions is None else positions
    handles = []

    def recorder(site: Site) -> Callable:
        def hook(_module, _inputs, output):
            store[site] = output[:, index].detach()

        return hook

    try:
        for site in sites:
            handles.append(model.site(*site).register_forward_hook(recorder(tuple(site))))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def intervene(
    model: nn.Module, site: Site, edit: Callable[[torch.Tensor], torch.Tensor], positions: Sequence[int] | slice | None = None
) -> Iterator[None]:
    """Replace the value at ``site`` by ``edit(value)`` on the chosen positions.

    edit: [B, T', D] -> [B, T', D]; its output shape is checked.
    """
    index = slice(None) if positions is None else positions

    def hook(_module, _inputs, output):
        chosen = output[:, index]
        edited = edit(chosen)
        if edited.shape != chosen.shape:
            raise ValueError(f"intervention at {site} returned shape {tuple(edited.shape)}, expected {tuple(chosen.shape)}")
        output = output.clone()
        output[:, index] = edited
        return output

    handle = model.site(*site).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()

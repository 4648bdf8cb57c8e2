"""Collect residual-stream states of a model at chosen sites, in mini-batches."""

from __future__ import annotations

from typing import Sequence

import torch

from taskgeom.hooks import Site, capture


@torch.no_grad()
def collect(
    model: torch.nn.Module, tokens: torch.Tensor, sites: Sequence[Site], batch_size: int = 256, positions: slice | None = None
) -> dict[Site, torch.Tensor]:
    """{site: [N, T', D] float32} for tokens: [N, T]; T' = positions' length (all by default)."""
    model.eval()
    chunks: dict[Site, list[torch.Tensor]] = {tuple(s): [] for s in sites}
    with capture(model, chunks.keys(), positions) as store:
        for start in range(0, tokens.shape[0], batch_size):
            model(tokens[start : start + batch_size])
            for site in chunks:
                chunks[site].append(store[site].float())
    return {site: torch.cat(parts) for site, parts in chunks.items()}

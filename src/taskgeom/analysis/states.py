"""Collect residual-stream states of a model at chosen sites, streamed layer by layer.

``stream_layers`` keeps only the residual stream entering the current block ([N, T, D]) and the
requested sites of that one layer, so memory does not grow with depth. For scale: 10,000
sequences x 128 positions x width 128 in float32 is 0.66 GB per site and layer, so one site at all
6 layers would take 3.9 GB at once; streamed, the peak is about 1.3 GB (carrier + one site).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from taskgeom.hooks import Site, capture


@torch.no_grad()
def stream_layers(
    model: torch.nn.Module, tokens: torch.Tensor, sites: Sequence[Site], batch_size: int = 256, positions: slice | None = None
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(layer, {site name: [N, T', D] float32})`` for each layer named in ``sites``, in order.

    tokens: [N, T]; T' = positions' length (all by default). One forward pass in all: block ``l``
    runs on the stored stream of every sequence before block ``l + 1`` starts.
    """
    model.eval()
    wanted: dict[int, list[str]] = {}
    for layer, name in sites:
        model.site(layer, name)  # validates the site
        wanted.setdefault(layer, []).append(name)
    stream = torch.cat([model.embed_inputs(tokens[s : s + batch_size]) for s in range(0, tokens.shape[0], batch_size)])
    for layer in range(max(wanted, default=-1) + 1):
        names = wanted.get(layer, [])
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        with capture(model, [(layer, name) for name in names], positions) as store:
            for s in range(0, tokens.shape[0], batch_size):
                out = model.blocks[layer](stream[s : s + batch_size])
                for name in names:  # copy before the stream is overwritten: resid_pre is a view of it
                    parts[name].append(store[(layer, name)].to(torch.float32, copy=True))
                stream[s : s + batch_size] = out
        if names:
            yield layer, {name: torch.cat(chunks) for name, chunks in parts.items()}


def collect(
    model: torch.nn.Module, tokens: torch.Tensor, sites: Sequence[Site], batch_size: int = 256, positions: slice | None = None
) -> dict[Site, torch.Tensor]:
    """{site: [N, T', D] float32} for tokens: [N, T]; T' = positions' length (all by default)."""
    return {(layer, name): h for layer, states in stream_layers(model, tokens, sites, batch_size, positions) for name, h in states.items()}

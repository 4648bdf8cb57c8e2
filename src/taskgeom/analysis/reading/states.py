"""Collect residual-stream states of a model at chosen sites, streamed layer by layer, and share
one batch's forward prefix between passes that edit it.

``stream_layers`` keeps only the residual stream entering the current block ([N, T, D]) and the
requested sites of that one layer, so memory does not grow with depth. For scale: 10,000
sequences x 128 positions x width 128 in float32 is 0.66 GB per site and layer, so one site at all
6 layers would take 3.9 GB at once; streamed, the peak is about 1.3 GB (carrier + one site).

``LayerStreams`` holds one batch's residual stream entering each block (and, where the blocks
resume there, each resid_mid), each computed once, so a pass that edits block ``l`` (an ablation,
a search step) runs only from block ``l`` (or its resid_mid) on.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, capture


@torch.no_grad()
def stream_layers(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    sites: Sequence[Place],
    batch_size: int = 256,
    positions: slice | None = None,
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
    model: torch.nn.Module,
    tokens: torch.Tensor,
    sites: Sequence[Place],
    batch_size: int = 256,
    positions: slice | None = None,
) -> dict[Place, torch.Tensor]:
    """{site: [N, T', D] float32} for tokens: [N, T]; T' = positions' length (all by default)."""
    return {
        (layer, name): h
        for layer, states in stream_layers(model, tokens, sites, batch_size, positions)
        for name, h in states.items()
    }


class LayerStreams:
    """One batch's unedited residual streams, each computed without gradients once and kept:
    ``streams`` {layer: [B, T, D]} entering each block (n_layers: leaving the last), filled from the
    embedding up to the deepest asked for, and for models with ``mid_sites`` ``mids`` {layer: [B, T,
    D]}, each block's resid_mid.

    ``model_from(site)`` is the model with an edit at ``site`` (None: no edit) as a function of these
    tokens, running only what the edit changes: what a family's losses call as
    ``model(batch.tokens)``. Its values equal the whole model's under the same edit. The kept
    states must be unedited: they are computed with no hook on the sites they pass through, else
    AnalysisError.
    """

    def __init__(self, model: torch.nn.Module, tokens: torch.Tensor):
        self.model, self.tokens = model, tokens
        self.streams: dict[int, torch.Tensor] = {}
        self.mids: dict[int, torch.Tensor] = {}

    def _check_unedited(self, layer: int, names: Sequence[str]) -> None:
        hooked = [(layer, name) for name in names if self.model.site(layer, name)._forward_hooks]
        if hooked:
            raise AnalysisError(
                f"the shared streams must be unedited, but sites {hooked} are hooked while they are computed"
            )

    @torch.no_grad()
    def entering(self, layer: int) -> torch.Tensor:
        """[B, T, D] the residual stream entering block ``layer`` (n_layers: leaving the last block)."""
        if not 0 <= layer <= len(self.model.blocks):
            raise AnalysisError(f"layer {layer} does not exist; the model has layers 0..{len(self.model.blocks) - 1}")
        if not self.streams:
            self.streams[0] = self.model.embed_inputs(self.tokens)
        for l in range(max(self.streams), layer):
            self._check_unedited(l, self.model.sites)
            block = self.model.blocks[l]
            self.streams[l + 1] = block.from_mid(self.mid(l)) if self.model.mid_sites else block(self.streams[l])
        return self.streams[layer]

    @torch.no_grad()
    def mid(self, layer: int) -> torch.Tensor:
        """[B, T, D] resid_mid of block ``layer`` (models with ``mid_sites``)."""
        if layer not in self.mids:
            stream = self.entering(layer)
            self._check_unedited(layer, [name for name in self.model.sites if name not in self.model.mid_sites])
            self.mids[layer] = self.model.blocks[layer].to_mid(stream)
        return self.mids[layer]

    def model_from(self, site: Place | None, length: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """tokens (these very tokens) -> logits with an edit at ``site`` (hooked by the caller):
        the model runs from the kept resid_mid of the site's block when the site is one of
        ``mid_sites``, else from the stream entering it (None: only the readout runs); ``length``:
        on the first ``length`` positions only (the model is causal: their logits are the whole
        sequence's)."""
        mid = site is not None and site[1] in self.model.mid_sites
        layer = len(self.model.blocks) if site is None else site[0]
        state = (self.mid(layer) if mid else self.entering(layer))[:, :length]

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            if tokens is not self.tokens:
                raise AnalysisError("these layer streams were computed for other tokens")
            return self.model.forward_from(layer, state, mid)

        return forward

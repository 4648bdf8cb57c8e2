"""The study's forced-token cells (docs/protocol.md, "P0, P1 on forced-token cells"), as its
``compute_hiddens_token_conditioned_coin`` draws them for a token family: at a position p, the
token values seen there in ``per_cell`` natural sequences of each major task; then for each such
value a and each major task k, ``per_cell`` fresh sequences of task k whose token at p is
overwritten by a, and their states at p. Every cell has the same size and no prefix depends on a.
Only the prefix (positions 0..p) is drawn and run: the model is causal.

Shapes: ``A`` token values seen at p, ``K`` major tasks, ``N`` sequences a cell, ``D`` width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from taskgeom.analysis.measures.anova import TwoWay, two_way
from taskgeom.analysis.reading.states import stream_layers
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.rng import generator
from taskgeom.tasks import TaskPool, TokenFamily

STREAM, P2_STREAM = "m1-cells", "m1-cells-p2"  # the draws of P0/P1's cells and of P2's


@dataclass(frozen=True)
class ForcedCells:
    """The states at ``position`` of every cell: tokens: [A] the values seen there (sorted);
    states: {place: [A, K, N, D] float32}, cell (a, k) the ``N`` sequences of task k with token
    ``tokens[a]`` at ``position``."""

    position: int
    tokens: torch.Tensor
    states: dict[Place, torch.Tensor]

    def __repr__(self) -> str:
        A, K, N, D = next(iter(self.states.values())).shape
        return f"ForcedCells(position {self.position}: {A} tokens x {K} tasks x {N} sequences, D={D}, {len(self.states)} places)"

    def layout(self, place: Place) -> TwoWay:
        """The two-way layout (task, token) of the cells at ``place``: P0 is its ``cell_r2``, P1 its ``additive_share``."""
        h = self.states[place]
        A, K, N, D = h.shape
        task = torch.arange(K).repeat_interleave(N).repeat(A)
        token = torch.arange(A).repeat_interleave(K * N)
        return two_way(h.reshape(-1, D), task, token, K, A)


def _check(family, position: int, per_cell: int) -> None:
    if not isinstance(family, TokenFamily):
        raise AnalysisError(f"forced-token cells overwrite a token; the family {family.name!r} does not read tokens")
    if position < 0 or per_cell < 1:
        raise AnalysisError(
            f"forced-token cells need a position >= 0 and at least one sequence a cell, got {position} and {per_cell}"
        )


def seen_tokens(
    family: TokenFamily, majors: TaskPool, seed: int, position: int, per_cell: int, stream: str = STREAM
) -> torch.Tensor:
    """[A] the token values (sorted) at ``position`` of ``per_cell`` natural sequences of each major task."""
    _check(family, position, per_cell)
    task = torch.arange(majors.size).repeat_interleave(per_cell)
    seen = family.make_batch(
        majors.params[task], task, position + 1, generator(seed, position, f"{stream}/tokens")
    ).tokens[:, position]
    return torch.unique(seen, sorted=True)


def forced_cells(
    model: torch.nn.Module,
    family: TokenFamily,
    majors: TaskPool,
    seed: int,
    position: int,
    per_cell: int,
    places: Sequence[Place],
    stream: str = STREAM,
    tokens: torch.Tensor | None = None,
) -> ForcedCells:
    """The forced-token cells at ``position`` (module docstring) of the major tasks ``majors``, their
    states at ``places``; the draws come from (seed, ``stream``), a stream no other analysis reads.
    ``tokens``: the values to force (default: those seen there, ``seen_tokens``)."""
    _check(family, position, per_cell)
    if tokens is None:
        tokens = seen_tokens(family, majors, seed, position, per_cell, stream)
    K, length = majors.size, position + 1
    task = torch.arange(K).repeat_interleave(per_cell)  # [K * N]
    parts: dict[Place, list[torch.Tensor]] = {Place(*p): [] for p in places}
    for a in tokens.tolist():
        batch = family.make_batch(majors.params[task], task, length, generator(seed, position, f"{stream}/token-{a}"))
        batch.tokens[:, position] = a
        for layer, states in stream_layers(model, batch.tokens, list(parts), positions=slice(position, length)):
            for site, h in states.items():
                parts[Place(layer, site)].append(h[:, 0].reshape(K, per_cell, -1))
    return ForcedCells(position, tokens, {place: torch.stack(chunks) for place, chunks in parts.items()})

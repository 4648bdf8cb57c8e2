"""The S and V ablations of the double dissociation at every block (docs/protocol.md, "S
ablation", "Orthogonal search", "Shares of in-context gain", "Random control"), as rows of
``dual.json`` (layout of ``rows``).

At each block's ``resid_mid`` (``block_places``): S is the probe's (``Geometry.probe``, fitted
there on the ``geometry`` split), V the orthogonal search's (rank 1, as the protocol searches it: the
study's, on the evaluation set's OOD tasks outside the search probe's span), and
the protocol's ``random_controls`` random directions of V's rank are drawn inside the complement V lives in.
Each is ablated at that block alone and measured on the ``loss`` split (major, minor, OOD):

- per block (``layer`` the block): ``loss_ablate_S``, ``gain_removed_ablate_S``, the same for V,
  ``gain_removed_random_draw{i}`` for each random draw and ``gain_removed_random``, the control's
  statistic there: the 75th percentile of the signed shares over the draws (``control_statistic``),
  with the draws' [min, max] share as its band;
- the summary (``layer`` None, ``site`` the blocks' site): the mean over blocks of each per-block
  row (a share of the mean ablated loss, which is the mean of the shares since the clean losses
  are the same), but for the control the largest over blocks (the study's ``max(... for l in
  layers)``), or under ``v-best-block`` (docs/protocol.md#variants) V's and the control's rows of one block;
- each block's V search (batch ``search``; ``search_rows``): its steps run, best step, the random
  start's weight in the kept average, the rank V avoids and the width it leaves.

A block whose avoided span leaves fewer free directions than V's rank has no V: its V and control
rows are null with the reason, and so are the summary's (``Block.no_room``).

Losses average the family's ``loss_window`` (E1 every prediction, as the study's coin code; E3
every one after the first); the control's change averages every prediction in both (the study's
random band, whose gain keeps the window). The claims read the summary; the random-control claim
reads the OOD set's, as the study's band does (``claims.dual_modes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from taskgeom.analysis.geometry import Geometry
from taskgeom.analysis.measures.orthogonal import SearchResult
from taskgeom.analysis.measures.shares import Share, loss_window, share_of_gain
from taskgeom.analysis.measures.subspace import complement_basis, random_directions
from taskgeom.analysis.protocol import Protocol, active
from taskgeom.analysis.stored.rows import row
from taskgeom.analysis.study import Sequences, StudyRun
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.rng import generator


def block_places(run: StudyRun, protocol: Protocol | None = None) -> list[Place]:
    """Where the ablations and the search act: the protocol's ``ablation_site`` (resid_mid; else
    resid_post where the run captures no such site) of every block."""
    chosen = (protocol or active()).ablation_site
    site = chosen if chosen in run.directory.sites else "resid_post"
    return [Place(layer, site) for layer in range(run.config.model.n_layers)]


@dataclass(frozen=True)
class Block:
    """One block's ablations: ``geometry`` at its place (S: ``geometry.probe``), V's ``search`` (V: [D, r],
    its steps run and best step) and the random controls: the protocol's ``random_controls`` x [D, r]
    inside the complement V was searched in. Where the span V avoids leaves fewer free directions
    than V's rank, there is no search and no control (``search`` None, ``controls`` empty) and
    ``no_room`` says why (docs/protocol.md, the V search: V's rows are null with that reason)."""

    geometry: Geometry
    search: SearchResult | None
    controls: tuple[torch.Tensor, ...]
    no_room: str | None = None

    @property
    def v(self) -> torch.Tensor:
        """[D, r] V, the search's kept directions; AnalysisError where the block has no room for V."""
        if self.search is None:
            raise AnalysisError(f"no V at {self.place}: {self.no_room}")
        return self.search.directions

    @property
    def place(self) -> Place:
        return self.geometry.place


def find_blocks(
    run: StudyRun,
    geometries: Sequence[Geometry],
    *,
    rank: int = 1,
    steps: int | None = None,
    protocol: Protocol | None = None,
) -> list[Block]:
    """V (the searches in lockstep, ``steps`` each: the protocol's ``search_steps`` when None) and the
    random controls at each geometry's place, as ``protocol`` (the active one when None) searches
    (what V avoids, the set it ascends on: ``StudyRun.orthogonal_search``)."""
    spans = [g.avoid(protocol) for g in geometries]
    room = [span.shape[0] - span.shape[1] >= rank for span in spans]
    found = iter(
        run.orthogonal_search([(g, rank) for g, fits in zip(geometries, room) if fits], steps=steps, protocol=protocol)
    )
    gen, draws = generator(run.seed, 0, "dual-random"), (protocol or active()).random_controls
    blocks = []
    for g, span, fits in zip(geometries, spans, room):
        if fits:
            controls = tuple(random_directions(complement_basis(span), rank, gen) for _ in range(draws))
            blocks.append(Block(g, next(found), controls))
        else:
            why = (
                f"the span V avoids at {g.place} (rank {span.shape[1]} of width {span.shape[0]}) leaves "
                f"{span.shape[0] - span.shape[1]} free directions, fewer than V's rank {rank}"
            )
            blocks.append(Block(g, None, (), why))
    return blocks


def _no_room(metric: str, block: Block, **where) -> dict:
    """The null row of ``metric`` at a block with no room for V, with the reason."""
    return {**row(metric, None, place=block.place, **where), "reason": block.no_room}


def control_statistic(values: Sequence[float | None], protocol: Protocol | None = None) -> float | None:
    """The random control of one set at one block: the protocol's ``control_quantile`` (linear
    interpolation) of the signed shares over the draws (the study's ``trial_stats`` q75); None when
    a share is None (no gain to remove)."""
    if any(v is None for v in values):
        return None
    quantile = (protocol or active()).control_quantile
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), quantile))


def search_rows(run: StudyRun, blocks: Sequence[Block], protocol: Protocol | None = None) -> list[dict]:
    """Each block's V search (batch ``search``, set: the sequences it ascended on): ``v_search.steps`` run,
    ``v_search.best_step`` (0-based), ``v_search.start_weight`` (the random start's weight in the kept
    average), ``v_search.avoided_rank`` (the span V avoids) and ``v_search.free_dims`` (the width left)."""
    where = {"batch": "search", "set": run.search_set(protocol)}
    rows = []
    for block in blocks:
        avoided, search = block.geometry.avoid(protocol), block.search
        found = {
            "steps": None if search is None else search.steps,
            "best_step": None if search is None else search.best_step,
            "start_weight": None if search is None else search.start_weight,
            "avoided_rank": avoided.shape[1],
            "free_dims": avoided.shape[0] - avoided.shape[1],
        }
        rows += [row(f"v_search.{name}", value, place=block.place, **where) for name, value in found.items()]
    return rows


def ablation_rows(
    run: StudyRun,
    blocks: Sequence[Block],
    sets: dict[str, Sequences],
    clean: dict[str, torch.Tensor],
    *,
    v_block: int | None = None,
    protocol: Protocol | None = None,
) -> list[dict]:
    """The per-block and summary rows (module docstring) on each set {name: sequences} of the
    ``loss`` split, whose clean per-prediction losses are ``clean`` {name: [P - 1]}; ``v_block``:
    the index of the block whose V and control rows are the summary (``v-best-block``), else the mean;
    ``protocol``: whose S is ablated (``Geometry.ablate``; the active one when None)."""
    window = loss_window(run.family)
    if not blocks:
        raise AnalysisError("the ablations need at least one block")
    if v_block is not None and not 0 <= v_block < len(blocks):
        raise AnalysisError(f"v_block must index one of the {len(blocks)} blocks, got {v_block}")
    summary = (None, blocks[0].place.site)
    rows = search_rows(run, blocks, protocol)
    for name, sequences in sets.items():
        where = {"batch": "loss", "set": name}
        ablated: dict[str, list[torch.Tensor]] = {"ablate_S": [], "ablate_V": []}
        controls: list[tuple[float | None, Share]] = []
        for block in blocks:
            edits = [("ablate_S", block.geometry.ablate(protocol))]
            if block.search is not None:
                edits.append(("ablate_V", run.ablate(block.v, block.place)))
            for label, edit in edits:
                with edit:
                    losses = run.loss(sequences, per_position=True)
                ablated[label].append(losses)
                share = share_of_gain(losses, clean[name], window)
                rows += [
                    row(f"loss_{label}", losses[window].mean(), place=block.place, **where),
                    row(f"gain_removed_{label}", share.value, place=block.place, share=share, **where),
                ]
            if block.search is None:
                rows += [_no_room(f"{m}_ablate_V", block, **where) for m in ("loss", "gain_removed")]
                rows.append(_no_room("gain_removed_random", block, **where))
                controls.append((None, None))
                continue
            draws = []
            for i, directions in enumerate(block.controls):
                with run.ablate(directions, block.place):
                    draws.append(
                        share_of_gain(
                            run.loss(sequences, per_position=True), clean[name], window, change_window=slice(0, None)
                        )
                    )
                rows.append(
                    row(f"gain_removed_random_draw{i}", draws[-1].value, place=block.place, share=draws[-1], **where)
                )
            values = [d.value for d in draws]
            controls.append((control_statistic(values, protocol), draws[0]))
            band = None if None in values else [min(values), max(values)]
            rows.append(row("gain_removed_random", controls[-1][0], band, place=block.place, share=draws[0], **where))
        missing = next((block.no_room for block in blocks if block.search is None), None)
        for label, losses in ablated.items():
            if label == "ablate_V" and missing is not None:  # the mean over blocks needs V at every block
                rows += [
                    {**row(f"{m}_{label}", None, place=summary, **where), "reason": missing}
                    for m in ("loss", "gain_removed")
                ]
                continue
            chosen = [losses[v_block]] if label == "ablate_V" and v_block is not None else losses
            mean = torch.stack(chosen).mean(0)
            share = share_of_gain(mean, clean[name], window)
            rows += [
                row(f"loss_{label}", mean[window].mean(), place=summary, **where),
                row(f"gain_removed_{label}", share.value, place=summary, share=share, **where),
            ]
        chosen = [controls[v_block]] if v_block is not None else controls
        stats = [stat for stat, _ in chosen]
        band = None if None in stats else [min(stats), max(stats)]
        control = row(
            "gain_removed_random",
            None if None in stats else max(stats),
            band,
            place=summary,
            share=chosen[0][1],
            **where,
        )
        rows.append(control if missing is None else {**control, "reason": missing})
    return rows


def rank_rows(
    run: StudyRun,
    blocks: Sequence[Block],
    ranks: Sequence[int],
    ood: Sequences,
    clean: torch.Tensor,
    *,
    steps: int | None = None,
) -> list[dict]:
    """The rank curve: the share of OOD gain removed by V of rank r (searched afresh for r other
    than the blocks' own rank) at each block, and its mean over blocks (``layer`` None); none where a
    block has no room for V."""
    if any(block.search is None for block in blocks):
        return []
    own = blocks[0].v.shape[1]
    others = [r for r in ranks if r != own]
    searched = iter(run.orthogonal_search([(b.geometry, r) for b in blocks for r in others], steps=steps))
    found = {(i, r): next(searched).directions for i in range(len(blocks)) for r in others}
    where, window = {"batch": "loss", "set": "ood"}, loss_window(run.family)
    rows = []
    for r in ranks:
        per_block = []
        for i, block in enumerate(blocks):
            with run.ablate(block.v if r == own else found[(i, r)], block.place):
                per_block.append(run.loss(ood, per_position=True))
            share = share_of_gain(per_block[-1], clean, window)
            rows += [
                row(f"loss_ablate_V_rank{r}", per_block[-1][window].mean(), place=block.place, **where),
                row(f"gain_removed_ablate_V_rank{r}", share.value, place=block.place, share=share, **where),
            ]
        mean = torch.stack(per_block).mean(0)
        share = share_of_gain(mean, clean, window)
        rows += [
            row(f"loss_ablate_V_rank{r}", mean[window].mean(), place=(None, blocks[0].place.site), **where),
            row(
                f"gain_removed_ablate_V_rank{r}", share.value, place=(None, blocks[0].place.site), share=share, **where
            ),
        ]
    return rows


def v_block(run: StudyRun, blocks: Sequence[Block], n_seq: int) -> int:
    """The index of the block whose V raises the OOD loss most on the ``search-select`` split
    (``v-best-block``, docs/protocol.md#variants): compared by the ablated loss itself (the clean loss is the same
    for every block, and a share flips sign with the gain)."""
    select = run.heldout("ood", n_seq, split="search-select")
    losses = {}
    for i, block in enumerate(blocks):
        if block.search is not None:  # a block with no room for V is never chosen
            with run.ablate(block.v, block.place):
                losses[i] = run.loss(select)
    if not losses:
        raise AnalysisError(f"no block has room for V: {blocks[0].no_room}")
    return max(losses, key=losses.__getitem__)

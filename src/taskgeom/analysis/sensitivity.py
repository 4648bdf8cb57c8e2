"""How the orthogonal-subspace ablation moves when each choice PAPER.md section 7 adds to the
study's protocol is flipped, one at a time, on the same run (``taskgeom sensitivity``). It reports,
it does not replace: the claims keep the pinned definition (``analysis.dual``).

The choices, each flipped alone from the pinned measurement:

- ``pinned``: V avoids S and the token subspace, is ablated at the layer the search chose, and the
  share of in-context gain averages every prediction after the first (the value ``dual.json`` holds);
- ``V may enter the token subspace``: V avoids S only (its search, and the choice of its layer,
  run again);
- ``V ablated at every layer``: each layer's V (the pinned searches) ablated at once, each at its
  own layer's ``resid_mid``;
- ``gain over the late window``: the pinned V, its share averaged over the last quarter of the
  predictions instead (L_0 is still the first prediction's clean loss).

Each row: ``{choice, set, gain_removed, gain, clean, ablated, unreliable, reason, layer}`` on the
``loss`` split (major, OOD; ``shares.Share``: gain_removed is None, with the reason, when the gain
is not positive); losses are the family's own, per prediction; ``layer`` is None for every layer.

The place of the claims (selected on a separate batch, then measured apart: **[ours]**) is the
other choice: ``place_choices`` reads, from a run's stored analyses, the values the claims would
have at every other (layer, site): P0-P2 on the M1 measurement batch (``m1.json``) and projection
R^2, the protocol's and the ``per-sequence-r2`` variant (``dual.json``).
"""

from __future__ import annotations

import contextlib

from taskgeom.analysis.orthogonal import avoid_basis
from taskgeom.analysis.dual import search_places, v_layer
from taskgeom.analysis.rows import stored_rows
from taskgeom.analysis.shares import share_of_gain
from taskgeom.analysis.study import StudyRun
from taskgeom.analysis.task_vectors import late_window
from taskgeom.runs import Run

CHOICES = ("pinned", "V may enter the token subspace", "V ablated at every layer", "gain over the late window")


def orthogonal_choices(run: StudyRun, n_seq: int = 256, search_steps: int = 200) -> list[dict]:
    """The rows of every choice of ``CHOICES`` for ``run`` (module docstring)."""
    places = search_places(run)
    geometries = list(run.geometries(run.heldout("major", n_seq, split="geometry"), places))
    avoid = {"pinned": lambda g: g.avoided, "V may enter the token subspace": lambda g: avoid_basis(g.basis.float())}
    kinds = tuple(avoid)
    found = {kind: dict(zip(places, run.orthogonal_search([(g, 1) for g in geometries], steps=search_steps, avoid=avoid[kind])))
             for kind in kinds}
    chosen = {kind: v_layer(run, found[kind], n_seq)[0] for kind in kinds}

    rows = []
    for name in ("major", "ood"):
        sequences = run.heldout(name, n_seq, split="loss")
        clean = run.loss(sequences, per_position=True)
        at_layer = {}
        for kind in kinds:
            with run.ablate(found[kind][chosen[kind]], chosen[kind]):
                at_layer[kind] = run.loss(sequences, per_position=True)
        with contextlib.ExitStack() as stack:
            for place, directions in found["pinned"].items():
                stack.enter_context(run.ablate(directions, place))
            every_layer = run.loss(sequences, per_position=True)
        after_first, late = slice(1, None), late_window(len(clean))
        measured = {**{kind: (at_layer[kind], after_first, chosen[kind]) for kind in kinds},
                    "V ablated at every layer": (every_layer, after_first, None),
                    "gain over the late window": (at_layer["pinned"], late, chosen["pinned"])}
        for choice in CHOICES:
            ablated, window, place = measured[choice]
            share = share_of_gain(ablated, clean, window)
            rows.append({"choice": choice, "set": name, "gain_removed": share.value, "gain": share.gain, "clean": share.clean,
                         "ablated": share.ablated, "unreliable": share.unreliable, "reason": share.reason,
                         "layer": None if place is None else place.layer})
    return rows


PLACE_METRICS = {"m1": ("p0.cell_r2", "p1.additive_share", "p2.r2_task"), "dual": ("projection_r2", "projection_r2_per_sequence")}


def place_choices(run: Run) -> list[dict]:
    """``{analysis, metric, layer, site, value, pinned}`` for every (layer, site) a stored analysis
    of ``run`` measured (``m1.json``: the measurement batch's late window; ``dual.json``: projection
    R^2 of the final model, the protocol's and the ``per-sequence-r2`` variant); ``pinned``: the
    place the claims read. A file of an earlier row version
    is left out (measure it again)."""
    rows = []
    for analysis, metrics in PLACE_METRICS.items():
        stored = stored_rows(run, analysis)
        if stored is None:
            continue
        if analysis == "m1":
            chosen = next(r for r in stored if r["metric"] == "place.selected")
            values = [r for r in stored if r["batch"] == "measure" and r["position"] is None and r["metric"] in metrics]
        else:
            chosen = next(r for r in stored if r["metric"] == "projection_r2" and r["step"] is None)  # the protocol's place
            values = [{**r, "metric": r["metric"].removeprefix("table.")} for r in stored
                      if r["metric"].removeprefix("table.") in metrics and r["metric"].startswith("table.")]
        rows += [{"analysis": analysis, "metric": r["metric"], "layer": r["layer"], "site": r["site"], "value": r["value"],
                  "pinned": (r["layer"], r["site"]) == (chosen["layer"], chosen["site"])} for r in values]
    return rows

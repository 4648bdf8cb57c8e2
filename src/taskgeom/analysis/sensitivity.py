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

Each row: ``{choice, set, gain_removed, gain, clean, ablated, layer}`` on the ``dual`` batches
(major, OOD); losses are the family's own, per prediction; ``layer`` is None for every layer.

The place of the claims (selected on a separate batch, then measured apart: **[ours]**) is the
other choice: ``place_choices`` reads, from a run's stored analyses, the values the claims would
have at every other (layer, site): P0-P2 on the M1 measurement batch (``m1.json``) and projection
R^2 of OOD states in both forms (``dual.json``).
"""

from __future__ import annotations

import contextlib
import json

import torch

from taskgeom.analysis.dual import SEARCH_SITE, fitted_geometries, loss_batches, search_loss_fn, select_v_site
from taskgeom.analysis.orthogonal import avoid_basis, orthogonal_searches, token_subspace
from taskgeom.analysis.retrieval import analysis_inputs, family_inputs
from taskgeom.analysis.subspace import direction_ablation, model_losses
from taskgeom.analysis.task_vectors import late_window
from taskgeom.analysis.states import LayerStreams
from taskgeom.hooks import intervene
from taskgeom.runs import Run
from taskgeom.tasks.regression import Regression

CHOICES = ("pinned", "V may enter the token subspace", "V ablated at every layer", "gain over the late window")


def share(ablated: torch.Tensor, clean: torch.Tensor, window: slice) -> dict[str, float]:
    """The share of in-context gain removed, 100 (L_ablated - L) / (L_0 - L), with L and L_ablated
    averaged over the predictions in ``window`` of [P] per-prediction losses; and its parts."""
    late, late_ablated = float(clean[window].mean()), float(ablated[window].mean())
    gain = float(clean[0]) - late
    return {"gain_removed": 100 * (late_ablated - late) / gain, "gain": gain, "clean": late, "ablated": late_ablated}


def orthogonal_choices(run: Run, n_seq: int = 256, search_steps: int = 200) -> list[dict]:
    """The rows of every choice of ``CHOICES`` for ``run`` (module docstring)."""
    model, family, cfg = run.load_model(), run.family, run.config
    seed, n_layers = cfg.train.seed, cfg.model.n_layers
    major_inputs = analysis_inputs(run, "dual-geometry", n_seq)
    ood = family.sample_ood(n_seq, cfg.task.seq_len, seed, 0, "dual-geometry-ood")
    ood_inputs = family_inputs(family, ood, run.pool.subset("major"))
    sites = [(layer, SEARCH_SITE if SEARCH_SITE in run.sites else "resid_post") for layer in range(n_layers)]
    fitted = fitted_geometries(model, major_inputs, ood_inputs, sites, late_window(major_inputs.current.shape[1]))
    positions = major_inputs.model_positions(slice(None))
    avoid = {}
    for site in sites:
        basis = fitted[site][0].subspace.basis.float()
        tokens = token_subspace(fitted[site][0].nu.float(), centre=not isinstance(family, Regression))
        avoid[site] = {"pinned": avoid_basis(basis, tokens), "V may enter the token subspace": avoid_basis(basis)}
    kinds = ("pinned", "V may enter the token subspace")
    searches = [(site, avoid[site][kind], 1) for kind in kinds for site in sites]
    results = orthogonal_searches(model, search_loss_fn(run, model), searches, steps=search_steps, seed=seed, positions=positions)
    found = {kind: dict(zip(sites, [r.directions for r in results[i * len(sites):(i + 1) * len(sites)]])) for i, kind in enumerate(kinds)}
    chosen = {kind: select_v_site(run, model, found[kind], n_seq, positions)[0] for kind in kinds}

    rows = []
    batches = {name: batch for name, batch in loss_batches(run, n_seq).items() if name in ("major", "ood")}
    for name, batch in batches.items():
        references = family.reference_predictions(batch, run.pool)
        streams = LayerStreams(model, batch.tokens)
        clean = model_losses(family, streams, batch, references)
        after_first, late = slice(1, None), late_window(len(clean))
        at_layer = {kind: model_losses(family, streams, batch, references, chosen[kind], direction_ablation(found[kind][chosen[kind]]),
                                       positions) for kind in kinds}
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for site, directions in found["pinned"].items():
                stack.enter_context(intervene(model, site, direction_ablation(directions), positions))
            every_layer = family.position_losses(model, batch, *references)["loss"].mean(0)
        measured = {**{kind: (at_layer[kind], after_first, chosen[kind]) for kind in kinds},
                    "V ablated at every layer": (every_layer, after_first, None),
                    "gain over the late window": (at_layer["pinned"], late, chosen["pinned"])}
        for choice in CHOICES:
            ablated, window, site = measured[choice]
            rows.append({"choice": choice, "set": name, **share(ablated, clean, window), "layer": None if site is None else site[0]})
    return rows


PLACE_METRICS = {"m1": ("p0.cell_r2", "p1.additive_share", "p2.r2_task"), "dual": ("projection_r2_token", "projection_r2")}


def place_choices(run: Run) -> list[dict]:
    """``{analysis, metric, layer, site, value, pinned}`` for every (layer, site) a stored analysis
    of ``run`` measured (``m1.json``: the measurement batch's late window; ``dual.json``: the final
    model's OOD states); ``pinned``: the place the claims read."""
    rows = []
    for analysis, metrics in PLACE_METRICS.items():
        path = run.path / "analysis" / f"{analysis}.json"
        if not path.is_file():
            continue
        stored = json.loads(path.read_text(encoding="utf-8"))
        if analysis == "m1":
            chosen = next(r for r in stored if r["metric"] == "place.selected")
            values = [r for r in stored if r["batch"] == "measure" and r["position"] is None and r["metric"] in metrics]
        else:
            chosen = next(r for r in stored if r["metric"] == "place_selected")
            values = [{**r, "metric": r["metric"].removeprefix("table.")} for r in stored
                      if r["metric"].removeprefix("table.") in metrics and r["metric"].startswith("table.")]
        rows += [{"analysis": analysis, "metric": r["metric"], "layer": r["layer"], "site": r["site"], "value": r["value"],
                  "pinned": (r["layer"], r["site"]) == (chosen["layer"], chosen["site"])} for r in values]
    return rows

"""One run's dual-mode measurements (PAPER.md sections 5 and 7), saved as ``analysis/dual.json``.

Rows have the layout of ``rows`` (that of ``m1.json`` too: ``band`` an interquartile pair or null,
``batch`` the held-out split, ``set`` major, minor or ood). The analysis is written with the
objects of ``analysis.study``, so each stored number is what they return. Where each is measured:

- **The place** of the task subspace: chosen as the M1 analysis chooses it with its default options
  (highest R^2_task of P2 over every layer and site on the M1 selection batch,
  ``StudyRun.select_place``), so the same run gets the same place in both analyses. The S ablation
  is measured there (on the ``loss`` split).
- **The task subspace** is the one ``TaskSubspace`` of the M1 geometry (the layout's task effects,
  rank K - 1), fitted on the ``geometry`` split's major sequences at each place that needs one.
- **Projection R^2** as the study's Fig. 4 measures it (``analysis.projection``; ``StudyRun.
  projection_r2``) on the ``projection`` split's whole tasks (``projection_r2_tasks`` OOD tasks of
  ``projection_r2_per_task`` sequences, every major task with as many), at the protocol's place
  (``projection.place``): ``projection_r2`` (band: the interquartile range over OOD tasks), of the
  final model and of each kept snapshot (``step``), beside the linear-code reference
  ``projection_r2_reference`` (null, with the reason, for a family without ``ood_estimate``).
  The variant ``per-sequence-r2`` (each late OOD state of the ``geometry`` split, centred by
  mu_t + nu(x_t), regressed on theta_{k, x_t}) is ``projection_r2_per_sequence`` there. Both are
  also written at every layer and site (``table.*`` rows).
- **The orthogonal search** (``orthogonal.orthogonal_search``) runs at ``resid_mid`` of every layer,
  avoiding S and the token subspace fitted at that layer, with a fresh batch of OOD sequences per
  step; the layer whose V raises the OOD loss most on a batch of its own is chosen, and V is
  measured on the fresh ``loss`` split, beside random directions drawn where V may lie. At that
  layer the gain removed by V of rank r = 1..ceil(d0) is the rank curve. For E2 every edit (S, V,
  the controls and the search) acts on the separators.
- **Losses and shares** average every prediction after the first; the clean, ablated and first
  losses are written beside each share, and each share row carries its gain (``shares.Share``:
  null with a reason when the gain is not positive, ``unreliable`` below ``MIN_RELIABLE_GAIN``).
- **Shared work, the same measurement.** ``StudyRun.loss`` keeps each batch's unedited residual
  streams and runs an edit from its block on; the searches (every layer's, then the rank curve's)
  run in lockstep, so each step's batch is drawn, and its prefix run, once for all of them. The
  values are those of whole forward passes, up to float rounding.

Losses are the family's own (nats for token families, squared error for E2); the predictor
transition and Theorem 2 compare next-token distributions, so they are measured for token families
only.
"""

from __future__ import annotations

import math

import torch

from taskgeom.analysis import projection
from taskgeom.analysis.properties import quantiles
from taskgeom.analysis.probes import linear_probe
from taskgeom.analysis.rows import row, stored_rows
from taskgeom.analysis.shares import share_of_gain
from taskgeom.analysis.edits import Place
from taskgeom.analysis.geometry import Geometry
from taskgeom.analysis.study import SELECTION_SEQUENCES, Sequences, StudyRun
from taskgeom.analysis.subspace import complement_basis, random_directions
from taskgeom.analysis.task_vectors import late_window
from taskgeom.analysis.theory import clr, participation_ratio, theorem2
from taskgeom.analysis.transition import reference_predictors, transition_statistic
from taskgeom.errors import AnalysisError
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json
from taskgeom.tasks import TokenFamily
from taskgeom.tasks.regression import Regression

N_RANDOM_CONTROLS = 5
SEARCH_SITE = "resid_mid"
PRIOR_TASKS = 2048  # OOD tasks whose predictions sample the OOD prediction map (d0)


def quartiles(x: torch.Tensor) -> list[float]:
    """[lower, upper] quartile of x (float64), as a row's band."""
    _, low, high = quantiles(x.flatten())
    return [float(low), float(high)]


def search_places(run: StudyRun) -> list[Place]:
    """Where the orthogonal search runs: resid_mid (else resid_post) of every layer."""
    site = SEARCH_SITE if SEARCH_SITE in run.directory.sites else "resid_post"
    return [Place(layer, site) for layer in range(run.config.model.n_layers)]


def loss_sets(run: StudyRun, n: int) -> dict[str, Sequences]:
    """The ``loss`` split's sequences: major, minor (if the pool has minors) and ood."""
    kinds = ("major", "minor", "ood") if run.pool.n_minor else ("major", "ood")
    return {kind: run.heldout(kind, n, split="loss") for kind in kinds}


def v_layer(run: StudyRun, found: dict[Place, torch.Tensor], n_seq: int) -> tuple[Place, list[dict]]:
    """The layer of V: where ablating its V (``found``: {place: [D, r]}) raises the OOD loss most
    on the ``search-select`` split, compared by the ablated loss itself (the clean loss is the same
    for every layer, and a share flips sign with the gain); and the rows recording it."""
    select = run.heldout("ood", n_seq, split="search-select")
    clean = run.loss(select, per_position=True)
    where = {"batch": "search-select", "set": "ood"}
    rows = [row("search_loss", clean[1:].mean(), **where), row("search_loss_first", clean[0], **where)]
    ablated_loss = {}
    for place, directions in found.items():
        with run.ablate(directions, place):
            ablated = run.loss(select, per_position=True)
        ablated_loss[place] = float(ablated[1:].mean())
        share = share_of_gain(ablated, clean)
        rows += [row("search_loss_ablate_V", ablated_loss[place], place=place, **where),
                 row("search_gain_removed", share.value, place=place, share=share, **where)]
    return max(found, key=ablated_loss.get), rows


def analyze_dual(run: StudyRun, *, n_seq: int = 256, rank: int = 1, search_steps: int = 200,
                 projection_sizes: tuple[int, int] = projection.QUICK_SIZES) -> list[dict]:
    """All section-5 measurements of a finished run (``n_seq`` sequences per batch, V of ``rank``
    directions found in ``search_steps`` steps, projection R^2 on ``projection_sizes`` = (OOD tasks,
    sequences per task)); writes ``analysis/dual.json`` and returns its rows."""
    family, cfg, seed = run.family, run.config, run.seed
    n_layers = cfg.model.n_layers
    all_sites = run.places()
    selection = run.select_place(run.heldout("major", SELECTION_SEQUENCES, split="select"), all_sites, n_random=0)
    place = selection.best
    rows = [row("place_selected", 1.0, place=place, batch="select", set="major")]
    if selection.runner_up is not None:
        rows.append(row("place_runner_up", 1.0, place=selection.runner_up, batch="select", set="major"))
    del selection

    major, ood = run.heldout("major", n_seq, split="geometry"), run.heldout("ood", n_seq, split="geometry")
    searched = search_places(run)
    readout_site = Place(n_layers - 1, "resid_post")
    wanted = list(dict.fromkeys([*all_sites, *searched, readout_site]))
    geometries = {g.place: g for g in run.geometries(major, wanted)}
    ood_states = run.cache(ood, wanted)
    checkpoints = {**run.snapshots(), cfg.train.steps: run}  # {step: the run at that step}
    rows += projection_rows(run, checkpoints, geometries, ood, ood_states, projection_sizes)

    geometry = geometries[place]
    rows.append(row("task_rank", geometry.basis.shape[1], place=place, batch="geometry", set="major"))

    found = dict(zip(searched, run.orthogonal_search([(geometries[site], rank) for site in searched], steps=search_steps)))
    v_site, select_rows = v_layer(run, found, n_seq)
    rows += select_rows
    directions, v_geometry = found[v_site], geometries[v_site]
    rows += [row("v_layer_selected", 1.0, place=v_site),
             row("orthogonality", (directions.T.double() @ v_geometry.basis).abs().max(), place=v_site),
             row("orthogonality_avoided", (directions.T.double() @ v_geometry.avoided.double()).abs().max(), place=v_site)]

    gen = generator(seed, 0, "dual-random")
    free = complement_basis(v_geometry.avoided)  # random controls live where V may
    controls = [random_directions(free, rank, gen) for _ in range(N_RANDOM_CONTROLS)]
    sets = loss_sets(run, n_seq)
    clean = {name: run.loss(sequences, per_position=True) for name, sequences in sets.items()}
    for name, sequences in sets.items():
        where = {"batch": "loss", "set": name}
        rows += [row("loss", clean[name][1:].mean(), **where), row("loss_first", clean[name][0], **where)]
        for label, edit in (("ablate_S", geometry.ablate()), ("ablate_V", run.ablate(directions, v_site))):
            with edit:
                ablated = run.loss(sequences, per_position=True)
            share = share_of_gain(ablated, clean[name])
            rows += [row(f"loss_{label}", ablated[1:].mean(), place=edit.place, **where),
                     row(f"gain_removed_{label}", share.value, place=edit.place, share=share, **where)]
        shares = []
        for v in controls:
            with run.ablate(v, v_site):
                shares.append(share_of_gain(run.loss(sequences, per_position=True), clean[name]))
        values = [s.value for s in shares]
        summary = (None, None) if None in values else (sum(values) / len(values), [min(values), max(values)])
        rows.append(row("gain_removed_random", *summary, place=v_site, share=shares[0], **where))

    prior = None if isinstance(family, Regression) else family.predict_ood(run.heldout("ood", PRIOR_TASKS, split="prior").batch.tokens)[:, -1]
    d0 = float(family.d) if prior is None else participation_ratio(clr(prior))  # d for E2's ridge map
    rows.append(row("d0", d0))
    ranks = range(1, min(math.ceil(d0), free.shape[1]) + 1)
    others = [r for r in ranks if r != rank]
    curve = {rank: directions, **dict(zip(others, run.orthogonal_search([(v_geometry, r) for r in others], steps=search_steps)))}
    for r in ranks:
        with run.ablate(curve[r], v_site):
            ablated = run.loss(sets["ood"], per_position=True)
        share = share_of_gain(ablated, clean["ood"])
        rows += [row(f"loss_ablate_V_rank{r}", ablated[1:].mean(), place=v_site, batch="loss", set="ood"),
                 row(f"gain_removed_ablate_V_rank{r}", share.value, place=v_site, batch="loss", set="ood", share=share)]

    rows += probe_rows(run, v_geometry, directions, ood, ood_states[v_site])
    if isinstance(family, TokenFamily):
        rows += token_prediction_rows(run, checkpoints, geometries[readout_site], ood, ood_states[readout_site], prior)
    atomic_write_json(run.path / "analysis" / "dual.json", rows)
    return rows


def projection_rows(run: StudyRun, checkpoints: dict[int, StudyRun], geometries: dict[Place, Geometry], ood: Sequences,
                    ood_states: dict[Place, torch.Tensor], sizes: tuple[int, int]) -> list[dict]:
    """Projection R^2 (module docstring) at every place of ``run.places()``, where ``geometries``
    (fitted on the ``geometry`` split) and the OOD states ``ood_states``: [N, P, D] of ``ood`` are,
    and across the ``checkpoints`` {step: run} at the protocol's place; ``sizes``: (OOD tasks,
    sequences per task)."""
    n_tasks, per_task = sizes
    tasks = {"ood": run.heldout_tasks("ood", per_task, n_tasks=n_tasks), "major": run.heldout_tasks("major", per_task)}
    where = projection.place(run.family, run.config.model.n_layers)
    places = run.places()
    if where not in places:
        raise AnalysisError(f"projection R^2 is read at {tuple(where)}, which this model does not have")
    fig4, at = {"batch": "projection", "set": "ood"}, {"batch": "geometry", "set": "ood"}
    rows = [row("projection_r2_tasks", n_tasks, place=where, **fig4), row("projection_r2_per_task", per_task, place=where, **fig4)]
    table = projection.measure(run, tasks["ood"], tasks["major"], places)
    for site, r2 in table.items():
        per_sequence = geometries[site].projection_r2(ood, "token", ood_states[site])
        rows += [row("table.projection_r2", r2.mean, r2.quartiles, place=site, **fig4),
                 row("table.projection_r2_per_sequence", per_sequence.mean(), quartiles(per_sequence), place=site, **at)]
        if site == where:
            rows += [row("projection_r2", r2.mean, r2.quartiles, place=site, **fig4),
                     row("projection_r2_per_sequence", per_sequence.mean(), quartiles(per_sequence), place=site, **at)]
    for step, snapshot in checkpoints.items():
        r2 = table[where] if snapshot is run else snapshot.projection_r2(tasks["ood"], tasks["major"], where)
        rows.append(row("projection_r2", r2.mean, r2.quartiles, place=where, step=step, **fig4))
    why = projection.reference_unavailable(run.family)
    if why is None:
        reference = run.projection_reference(tasks["ood"], tasks["major"])
        rows.append(row("projection_r2_reference", reference.mean, reference.quartiles, **fig4))
    else:
        rows.append({**row("projection_r2_reference", None, **fig4), "reason": why})
    return rows


def probe_rows(run: StudyRun, geometry: Geometry, directions: torch.Tensor, ood: Sequences, h_ood: torch.Tensor) -> list[dict]:
    """What V encodes: linear probes from V^T h (and from the complement of S) of the OOD states
    h_ood: [N, P, D] at V's place to the context statistic of the OOD-optimal learner."""
    complement = complement_basis(geometry.basis.float())
    positions, target = run.family.context_statistic(ood.batch)  # at the analysed positions (E2: its separators)
    late = late_window(len(positions))
    target = target[:, late]
    groups = torch.arange(len(ood))[:, None].expand(-1, target.shape[1]).reshape(-1)
    states = h_ood[:, late]
    rows = []
    for label, x in (("V", states @ directions), ("complement", states @ complement)):
        probe = linear_probe(x.reshape(-1, x.shape[-1]).double(), target.reshape(-1, target.shape[-1]).double(), "regression", groups=groups)
        rows += [row(f"probe_r2_{label}", probe.score, place=geometry.place, batch="geometry", set="ood"),
                 row(f"probe_r2_{label}_shuffled", probe.control, place=geometry.place, batch="geometry", set="ood")]
    return rows


def token_prediction_rows(run: StudyRun, checkpoints: dict[int, StudyRun], readout: Geometry, ood: Sequences, h_ood: torch.Tensor,
                          prior: torch.Tensor) -> list[dict]:
    """Theorem 2 (at the last layer's resid_post, where the readout is the final norm and
    unembedding) and the predictor transition over the checkpoints {step: run at that step}, on
    the OOD sequences whose states h_ood: [N, T, D] there ``readout`` was fitted beside; prior:
    [2048, V] OOD-optimal predictions over OOD tasks."""
    family, pool, model, tokens = run.family, run.pool, run.model, ood.batch.tokens
    subspace, t, place = readout.fit.subspace, tokens.shape[1] - 1, readout.place
    with torch.no_grad():
        logits = model.readout(h_ood)  # [N, T, V] the final model's output, read off the cached states
    n = tokens.shape[0]
    theory = theorem2(model.readout, h_ood[:, t], subspace.mu[t].float().expand(n, -1), subspace.basis.float(), logits[:, t],
                      family.predict_ood(tokens)[:, t], prior)
    where = {"place": place, "batch": "geometry"}
    rows = [row(f"theorem2_{key}", theory[key], **where) for key in ("k_star", "d0", "lipschitz")]
    rows += [row(f"theorem2_{key}", theory[key].median(), quartiles(theory[key]), set="ood", **where) for key in ("c", "delta", "bound", "distance")]
    rows.append(row("theorem2_share_bound_holds", (theory["distance"] >= theory["bound"]).double().mean(), set="ood", **where))
    references = reference_predictors(family, tokens, pool, run.config.task.p_minor)
    for step, snapshot in checkpoints.items():
        with torch.no_grad():
            stat = transition_statistic(logits if snapshot is run else snapshot.model(tokens), *references)
        rows += [row(f"transition_{key}", value, batch="geometry", set="ood", step=step) for key, value in stat.items()]
    return rows


def load_dual(run: Run) -> list[dict] | None:
    """The saved rows of the run directory, or None if it has not been analysed under the current
    conventions (rows of an earlier ``rows.ROW_VERSION`` are measured again; the run is not retrained)."""
    return stored_rows(run, "dual")

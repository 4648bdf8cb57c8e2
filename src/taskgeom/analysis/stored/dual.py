"""One run's dual-mode measurements (docs/concepts.md and docs/protocol.md), saved as ``analysis/dual.json``.

Rows have the layout of ``rows`` (that of ``m1.json`` too: ``band`` an interquartile pair or null,
``batch`` the held-out split, ``set`` major, minor or ood). The analysis is written with the
objects of ``analysis.study``, so each stored number is what they return. Where each is measured:

- **The place** of the task subspace: chosen as the M1 analysis chooses it with its default options
  (highest R^2_task of P2 over every layer and site on the M1 selection batch,
  ``StudyRun.select_place``), so the same run gets the same place in both analyses (the
  ``selected-place`` variant's; the task rank is written there).
- **The task subspace** is the one ``TaskSubspace`` of the M1 geometry (the layout's task effects,
  rank K - 1), fitted on the ``geometry`` split's major sequences at each place that needs one.
- **Projection R^2** as the study's Fig. 4 measures it (``analysis.reading.projection``; ``StudyRun.
  projection_r2``) on the ``projection`` split's whole tasks (``projection_r2_tasks`` OOD tasks of
  ``projection_r2_per_task`` sequences, every major task with as many), at the protocol's place
  (``projection.place``): ``projection_r2`` (band: the interquartile range over OOD tasks) with its
  standard error over tasks ``projection_r2_se``, beside the linear-code reference
  ``projection_r2_reference`` (null, with the reason, for a family without ``ood_estimate``). The
  study's own draw (the protocol's ``projection_study_sizes``, 128 tasks of 128 sequences; batch
  ``projection_study``) is ``projection_r2_study_draw`` (and its ``_se``) of the final model, and
  ``projection_r2`` with a ``step`` of the final model and of each kept snapshot.
  The variant ``per-sequence-r2`` (each late OOD state of the ``geometry`` split, centred by
  mu_t + nu(x_t), regressed on theta_{k, x_t}) is ``projection_r2_per_sequence`` there. Both are
  also written at every layer and site (``table.*`` rows).
- **The ablations** (``analysis.stored.ablations``) act at ``resid_mid`` of every block: S is the
  probe's there (``Geometry.probe``), V the orthogonal search's (rank 1, outside the span of the
  study's search probe, for E3 also of its token subspace, on fresh sequences of the evaluation
  set's 30 OOD tasks each step; ``Geometry.avoid``), beside five random directions drawn where V may lie; each is measured on the
  fresh ``loss`` split per block and summarised by the mean over blocks, which the claims read. At
  each block the gain removed by V of rank r = 1..ceil(d0) is the rank curve. For E2 every edit
  (S, V, the controls and the search) acts on the analysed positions.
- **Losses and shares** average the family's ``loss_window`` (E1 every prediction, as the study's
  coin code; the others every prediction after the first, as its latent-Markov code); the clean, ablated and first
  losses are written beside each share, and the Bayes OOD-optimal predictor's on the same OOD
  sequences (``bayes_ood_loss``, ``bayes_ood_loss_first``: the OOD-mode precondition's reference), and each share row carries its gain (``shares.Share``:
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

from taskgeom.analysis.geometry import Geometry
from taskgeom.analysis.measures.linear_probes import linear_probe
from taskgeom.analysis.measures.properties import quantiles
from taskgeom.analysis.measures.shares import loss_window
from taskgeom.analysis.measures.subspace import complement_basis
from taskgeom.analysis.measures.task_vectors import late_window
from taskgeom.analysis.measures.theory import clr, participation_ratio, theorem2
from taskgeom.analysis.measures.transition import reference_predictors, transition_statistic
from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading import projection
from taskgeom.analysis.stored.ablations import ablation_rows, block_places, find_blocks, rank_rows
from taskgeom.analysis.stored.rows import row, stamped, stored_rows
from taskgeom.analysis.study import Sequences, StudyRun
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import atomic_write_json
from taskgeom.settings.recipes import MeasureSettings
from taskgeom.tasks import TokenFamily

# The protocol's sample sizes read here (``active()``): prior_tasks, the OOD tasks whose predictions sample
# the OOD prediction map (d0); transition_sequences, the study's num_samples of the predictor transition
# (fig_kl_transition_combined.py); eval_sequences, the study's evaluation sets (n_samples_eval = 500 drawn
# in batches of 64, so 8 batches, 512 sequences); geometry_sequences and search_steps; projection_study_sizes
REFERENCE_CHUNK = 256  # sequences whose Bayes predictors are computed at once


def quartiles(x: torch.Tensor) -> list[float]:
    """[lower, upper] quartile of x (float64), as a row's band."""
    _, low, high = quantiles(x.flatten())
    return [float(low), float(high)]


def loss_sets(run: StudyRun, n: int | None = None) -> dict[str, Sequences]:
    """The ``loss`` split's sequences, ``n`` of each set (the protocol's ``eval_sequences`` when None,
    the study's 512): major, minor (if the pool has minors) and ood (from the study's 30 OOD tasks,
    the protocol's ``loss_ood_tasks``)."""
    n = active().eval_sequences if n is None else n
    kinds = ("major", "minor", "ood") if run.pool.n_minor else ("major", "ood")
    return {kind: run.heldout(kind, n, split="loss") for kind in kinds}


def analyze_dual(
    run: StudyRun,
    *,
    n_seq: int | None = None,
    rank: int = 1,
    search_steps: int | None = None,
    projection_sizes: tuple[int, int] = MeasureSettings().projection_sizes,
) -> list[dict]:
    """All section-5 measurements of a finished run (``n_seq`` sequences per geometry batch, the
    protocol's ``eval_sequences`` per evaluation set, V of ``rank`` directions found in ``search_steps``
    steps, projection R^2 on ``projection_sizes`` = (OOD tasks, sequences per task); ``n_seq`` and
    ``search_steps``: the protocol's ``geometry_sequences`` and ``search_steps`` when None); writes
    ``analysis/dual.json`` and returns its rows."""
    n_seq = active().geometry_sequences if n_seq is None else n_seq
    search_steps = active().search_steps if search_steps is None else search_steps
    family, cfg = run.family, run.config
    n_layers = cfg.model.n_layers
    all_sites = run.places()
    selection = run.select_place(run.selection_batch(), all_sites, n_random=0)
    place = selection.best
    rows = [row("place_selected", 1.0, place=place, batch="select", set="major")]
    if selection.runner_up is not None:
        rows.append(row("place_runner_up", 1.0, place=selection.runner_up, batch="select", set="major"))
    del selection

    major, ood = run.heldout("major", n_seq, split="geometry"), run.heldout("ood", n_seq, split="geometry")
    searched = block_places(run)
    readout_site = Place(n_layers - 1, "resid_post")
    wanted = list(dict.fromkeys([*all_sites, *searched, readout_site]))
    geometries = {g.place: g for g in run.geometries(major, wanted)}
    ood_states = run.cache(ood, wanted)
    checkpoints = {**run.snapshots(), cfg.train.steps: run}  # {step: the run at that step}
    rows += projection_rows(run, checkpoints, geometries, ood, ood_states, projection_sizes)

    geometry = geometries[place]
    rows.append(row("task_rank", geometry.basis.shape[1], place=place, batch="geometry", set="major"))

    blocks = find_blocks(run, [geometries[site] for site in searched], rank=rank, steps=search_steps)
    for block in (block for block in blocks if block.search is not None):
        rows += [
            row("orthogonality", (block.v.T.double() @ block.geometry.probe).abs().max(), place=block.place),
            row(
                "orthogonality_avoided",
                (block.v.T.double() @ block.geometry.avoid().double()).abs().max(),
                place=block.place,
            ),
        ]
    sets = loss_sets(run)
    clean = {name: run.loss(sequences, per_position=True) for name, sequences in sets.items()}
    window = loss_window(family)
    for name in sets:
        rows += [
            row("loss", clean[name][window].mean(), batch="loss", set=name),
            row("loss_first", clean[name][0], batch="loss", set=name),
        ]
    bayes_ood = bayes_ood_losses(run, sets["ood"])  # the OOD-mode precondition's reference (claims.dual_modes.ood_mode)
    rows += [
        row("bayes_ood_loss", bayes_ood[window].mean(), batch="loss", set="ood"),
        row("bayes_ood_loss_first", bayes_ood[0], batch="loss", set="ood"),
    ]
    rows += ablation_rows(run, blocks, sets, clean)

    prior = (
        family.predict_ood(run.heldout("ood", active().prior_tasks, split="prior").batch.tokens)[:, -1]
        if family.reads_tokens
        else None
    )
    d0 = float(family.d) if prior is None else participation_ratio(clr(prior))  # a vector family's d: E2's ridge map
    rows.append(row("d0", d0))
    free = min(span.shape[0] - span.shape[1] for span in (block.geometry.avoid() for block in blocks))
    rows += rank_rows(
        run, blocks, range(1, min(math.ceil(d0), free) + 1), sets["ood"], clean["ood"], steps=search_steps
    )

    for block in (block for block in blocks if block.search is not None):
        rows += probe_rows(run, block.geometry, block.v, ood, ood_states[block.place])
    if isinstance(family, TokenFamily):
        rows += token_prediction_rows(run, checkpoints, geometries[readout_site], ood, ood_states[readout_site], prior)
    rows = stamped(rows, "dual")
    atomic_write_json(run.path / "analysis" / "dual.json", rows)
    return rows


def bayes_ood_losses(run: StudyRun, sequences: Sequences) -> torch.Tensor:
    """[P - 1] the Bayes OOD-optimal predictor's loss per prediction on ``sequences`` (the family's
    ``bayes_ood_loss``: E1, E3 the add-alpha learner's cross-entropy, E2 ridge's squared error),
    averaged over them as ``StudyRun.loss`` averages the model's."""
    with torch.no_grad():
        return run.family.position_losses(run.model, sequences.batch, *sequences.references)["bayes_ood_loss"].mean(0)


def projection_rows(
    run: StudyRun,
    checkpoints: dict[int, StudyRun],
    geometries: dict[Place, Geometry],
    ood: Sequences,
    ood_states: dict[Place, torch.Tensor],
    sizes: tuple[int, int],
) -> list[dict]:
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
    rows = [
        row("projection_r2_tasks", n_tasks, place=where, **fig4),
        row("projection_r2_per_task", per_task, place=where, **fig4),
    ]
    table = projection.measure(run, tasks["ood"], tasks["major"], places)
    for site, r2 in table.items():
        per_sequence = geometries[site].projection_r2(ood, "token", ood_states[site])
        rows += [
            row("table.projection_r2", r2.mean, r2.quartiles, place=site, **fig4),
            row("table.projection_r2_per_sequence", per_sequence.mean(), quartiles(per_sequence), place=site, **at),
        ]
        if site == where:
            rows += [
                row("projection_r2", r2.mean, r2.quartiles, place=site, **fig4),
                row("projection_r2_se", r2.standard_error, place=site, **fig4),
                row("projection_r2_per_sequence", per_sequence.mean(), quartiles(per_sequence), place=site, **at),
            ]
    # the study's own draw (128 OOD tasks of 128 sequences), at the final model and across training
    study_sizes = active().projection_study_sizes
    drawn = tasks["ood"] if study_sizes == sizes else run.heldout_tasks("ood", study_sizes[1], n_tasks=study_sizes[0])
    study_major = tasks["major"] if study_sizes[1] == per_task else run.heldout_tasks("major", study_sizes[1])
    study = {"batch": "projection_study", "set": "ood"}
    for step, snapshot in checkpoints.items():
        r2 = (
            table[where]
            if snapshot is run and drawn is tasks["ood"]
            else snapshot.projection_r2(drawn, study_major, where)
        )
        if snapshot is run:
            rows += [
                row("projection_r2_study_draw", r2.mean, r2.quartiles, place=where, **study),
                row("projection_r2_study_draw_se", r2.standard_error, place=where, **study),
            ]
        rows.append(row("projection_r2", r2.mean, r2.quartiles, place=where, step=step, **study))
    why = projection.reference_unavailable(run.family)
    if why is None:
        reference = run.projection_reference(tasks["ood"], tasks["major"])
        rows.append(row("projection_r2_reference", reference.mean, reference.quartiles, **fig4))
    else:
        rows.append({**row("projection_r2_reference", None, **fig4), "reason": why})
    return rows


def probe_rows(
    run: StudyRun, geometry: Geometry, directions: torch.Tensor, ood: Sequences, h_ood: torch.Tensor
) -> list[dict]:
    """What V encodes: linear probes from V^T h (and from the complement of the probe's S) of the OOD states
    h_ood: [N, P, D] at V's place to the context statistic of the OOD-optimal learner."""
    complement = complement_basis(geometry.probe.float())
    positions, target = run.family.context_statistic(ood.batch)  # at the analysed positions (E2: its separators)
    late = late_window(len(positions))
    target = target[:, late]
    groups = torch.arange(len(ood))[:, None].expand(-1, target.shape[1]).reshape(-1)
    states = h_ood[:, late]
    rows = []
    for label, x in (("V", states @ directions), ("complement", states @ complement)):
        probe = linear_probe(
            x.reshape(-1, x.shape[-1]).double(),
            target.reshape(-1, target.shape[-1]).double(),
            "regression",
            groups=groups,
        )
        rows += [
            row(f"probe_r2_{label}", probe.score, place=geometry.place, batch="geometry", set="ood"),
            row(f"probe_r2_{label}_shuffled", probe.control, place=geometry.place, batch="geometry", set="ood"),
        ]
    return rows


def token_prediction_rows(
    run: StudyRun,
    checkpoints: dict[int, StudyRun],
    readout: Geometry,
    ood: Sequences,
    h_ood: torch.Tensor,
    prior: torch.Tensor,
) -> list[dict]:
    """Theorem 2 (at the last layer's resid_post, where the readout is the final norm and
    unembedding) on the OOD sequences whose states h_ood: [N, T, D] there ``readout`` was fitted
    beside (prior: [2048, V] OOD-optimal predictions over OOD tasks), and the predictor transition
    over the checkpoints {step: run at that step} on the protocol's ``transition_sequences`` sequences of the
    training mixture (``measures.transition``)."""
    family, pool, model, tokens = run.family, run.pool, run.model, ood.batch.tokens
    subspace, t, place = readout.fit.subspace, tokens.shape[1] - 1, readout.place
    with torch.no_grad():
        logits = model.readout(h_ood[:, t])  # [N, V] the final model's last output, read off the cached states
    n = tokens.shape[0]
    theory = theorem2(
        model.readout,
        h_ood[:, t],
        subspace.mu[t].float().expand(n, -1),
        subspace.basis.float(),
        logits,
        family.predict_ood(tokens)[:, t],
        prior,
    )
    where = {"place": place, "batch": "geometry"}
    rows = [row(f"theorem2_{key}", theory[key], **where) for key in ("k_star", "d0", "lipschitz")]
    rows += [
        row(f"theorem2_{key}", theory[key].median(), quartiles(theory[key]), set="ood", **where)
        for key in ("c", "delta", "bound", "distance")
    ]
    rows.append(
        row("theorem2_share_bound_holds", (theory["distance"] >= theory["bound"]).double().mean(), set="ood", **where)
    )
    mixture = run.heldout(
        "mixture", active().transition_sequences, split="transition"
    ).batch.tokens  # the study's mode="train"
    by_chunk = [
        reference_predictors(family, chunk, pool, run.config.task.p_minor) for chunk in mixture.split(REFERENCE_CHUNK)
    ]
    references = tuple(
        torch.cat(parts) for parts in zip(*by_chunk)
    )  # the pool posterior of ~1,000 tasks a chunk at a time
    for step, snapshot in checkpoints.items():
        with torch.no_grad():
            stat = transition_statistic(snapshot.model(mixture), *references)
        rows += [
            row(f"transition_{key}", value, batch="transition", set="mixture", step=step) for key, value in stat.items()
        ]
    return rows


def load_dual(run: Run, projection_sizes: tuple[int, int] | None = None) -> list[dict] | None:
    """The saved rows of the run directory, or None if it has not been analysed under the current
    conventions (rows of another key, ``keys.key('dual')``, are measured again; the run is not
    retrained) or, when ``projection_sizes`` (OOD tasks, sequences per task) are given, with other
    sizes of projection R^2."""
    rows = stored_rows(run, "dual")
    if rows is None or projection_sizes is None:
        return rows
    stored = {r["metric"]: r["value"] for r in rows if r["metric"] in ("projection_r2_tasks", "projection_r2_per_task")}
    return (
        rows
        if (stored.get("projection_r2_tasks"), stored.get("projection_r2_per_task")) == tuple(projection_sizes)
        else None
    )

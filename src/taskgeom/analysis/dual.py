"""One run's dual-mode measurements (PAPER.md sections 5 and 7), saved as ``analysis/dual.json``.

Rows are tidy ``{metric, value, band, set, step, layer, site}`` records (``band`` an
interquartile pair or null) that ``pandas.read_json`` loads in one call. Where each is measured:

- **The place** of the task subspace: chosen as the M1 analysis chooses it with its default options
  (highest R^2_task of P2 over every layer and site on the M1 selection batch,
  ``retrieval.select_place``), so the same run gets the same place in both analyses. The claims'
  projection R^2 and the S ablation are measured there, on the ``dual`` batches; projection R^2 is
  also written at every layer and site (``table.*`` rows).
- **The task subspace** is the one ``TaskSubspace`` of the M1 geometry (the layout's task effects,
  rank K - 1), fitted on the ``dual`` major batch at each place that needs one.
- **Projection R^2** of late OOD states, in two forms: plain (centred by mu_t, regressed on S)
  and token-conditioned (centred by mu_t + nu(x_t), regressed on theta_{k, x_t}); the claims read
  the token-conditioned one.
- **The orthogonal search** (``orthogonal.orthogonal_search``) runs at ``resid_mid`` of every layer,
  avoiding S and the token subspace fitted at that layer, with a fresh batch of OOD sequences per
  step; the layer whose V raises the OOD loss most on a batch of its own is chosen, and V is
  measured on the fresh ``dual`` batches, beside random directions drawn where V may lie. At that
  layer the gain removed by V of rank r = 1..ceil(d0) is the rank curve. For E2 every edit (S, V,
  the controls and the search) acts on the separators.
- **Losses and shares** average every prediction after the first; the clean, ablated and first
  losses are written beside each share.
- **Shared work, the same measurement.** Each batch's unedited residual streams are computed once
  (``states.LayerStreams``) and every edit of that batch runs the model from its block on (from
  the block's resid_mid, for the searches at resid_mid); the searches (every layer's, then the
  rank curve's) run in lockstep, so each step's batch is drawn, and its prefix run, once for all
  of them. The values are those of whole forward passes, up to float rounding.

Losses are the family's own (nats for token families, squared error for E2); the predictor
transition and Theorem 2 compare next-token distributions, so they are measured for token families
only.
"""

from __future__ import annotations

import functools
import json
import math

import torch

from taskgeom.analysis.orthogonal import BATCH_SIZE, avoid_basis, orthogonal_searches, token_subspace
from taskgeom.analysis.probes import linear_probe
from taskgeom.analysis.properties import Geometry
from taskgeom.analysis.retrieval import SELECTION_STREAM, Inputs, analysis_inputs, family_inputs, select_place
from taskgeom.analysis.states import LayerStreams, stream_layers
from taskgeom.analysis.subspace import complement_basis, direction_ablation, gain_removed, model_losses, projection_r2, random_directions, task_ablation
from taskgeom.analysis.task_vectors import late_window
from taskgeom.analysis.theory import clr, participation_ratio, theorem2
from taskgeom.analysis.transition import reference_predictors, transition_statistic
from taskgeom.hooks import Site
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json
from taskgeom.tasks import Batch, TokenFamily
from taskgeom.tasks.regression import Regression

DUAL_VERSION = 3  # 2: the measurement conventions of PAPER.md section 7; 3: the full projection table, V's layer by its loss
_PROJECTION = {"plain": "projection_r2", "token": "projection_r2_token"}
N_RANDOM_CONTROLS = 5
SELECTION_SEQUENCES = 512  # the M1 analysis' default, so both select the same place
SEARCH_SITE = "resid_mid"


def _quartiles(x: torch.Tensor) -> list[float]:
    q = torch.quantile(x.double().flatten(), torch.tensor([0.25, 0.75], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def _projection_r2(geometry: Geometry, h_ood: torch.Tensor, current: torch.Tensor, window: slice) -> dict[str, torch.Tensor]:
    """{"plain", "token"}: [N * W] projection R^2 of late OOD states h_ood: [N, P, D] (current: their
    inputs, [N, P] or [N, P, d]) on the task subspace of ``geometry``."""
    subspace = geometry.subspace
    late = current[:, window]
    centred = (h_ood[:, window].double() - subspace.mu[window]).flatten(0, 1)  # [N * W, D]
    token_centred = centred - geometry.layout.effect(late).double().flatten(0, 1)
    return {"plain": projection_r2(centred, subspace.basis),
            "token": projection_r2(token_centred, subspace.conditioned_basis(late).flatten(0, 1))}


def loss_batches(run: Run, size: int) -> dict[str, Batch]:
    """Held-out batches for losses: major, minor (if the pool has minors) and ood."""
    family, pool, cfg = run.family, run.pool, run.config
    T, seed = cfg.task.seq_len, cfg.train.seed
    out = {"major": family.sample(pool, size, T, seed, 0, "dual", "major")}
    if pool.n_minor:
        out["minor"] = family.sample(pool, size, T, seed, 0, "dual", "minor")
    out["ood"] = family.sample_ood(size, T, seed, 0, "dual-ood")
    return out


def fitted_geometries(model: torch.nn.Module, major: Inputs, ood: Inputs, sites: list[Site],
                window: slice) -> dict[Site, tuple[Geometry, torch.Tensor]]:
    """{site: (geometry fitted on the major inputs, OOD states [N, P, D])} from one streamed pass."""
    n, K = major.batch.tokens.shape[0], major.alpha.shape[-1]
    out = {}
    for layer, states in stream_layers(model, torch.cat([major.batch.tokens, ood.batch.tokens]), sites):
        for name, h in states.items():
            geometry = major.fit(major.select(h[:n]), major.batch.task, major.current, K, window)
            out[(layer, name)] = (geometry, ood.select(h[n:]))
    return out


def search_loss_fn(run: Run, model: torch.nn.Module):
    """loss_fn(step, site) for ``orthogonal_searches``: the training loss of batch ``step`` of the
    search stream (``BATCH_SIZE`` fresh OOD sequences) run from ``site`` on. The searches run in
    lockstep: one draw and one prefix per step serve them all."""
    family, T, seed = run.family, run.config.task.seq_len, run.config.train.seed

    @functools.lru_cache(maxsize=1)
    def search_batch(step: int) -> tuple[Batch, LayerStreams]:
        batch = family.sample_ood(BATCH_SIZE, T, seed, step, "dual-ood-search")
        return batch, LayerStreams(model, batch.tokens)

    def search_loss(step: int, site: Site) -> torch.Tensor:
        batch, streams = search_batch(step)
        return family.training_loss(streams.model_from(site), batch)

    return search_loss


def select_v_site(run: Run, model: torch.nn.Module, found: dict[Site, torch.Tensor], n_seq: int,
                  positions: slice | torch.Tensor) -> tuple[Site, list[dict]]:
    """The layer of V: where ablating its V (``found``: {site: [D, r]}) raises the OOD loss most on
    a batch of its own, compared by the ablated loss itself (the clean loss is the same for every
    layer, and a share flips sign with the gain); and the rows (``add`` keywords) recording it."""
    family, T, seed = run.family, run.config.task.seq_len, run.config.train.seed
    search_select = family.sample_ood(n_seq, T, seed, 0, "dual-ood-search-select")
    search_refs = family.reference_predictions(search_select, run.pool)
    select_streams = LayerStreams(model, search_select.tokens)
    search_clean = model_losses(family, select_streams, search_select, search_refs)
    rows = [{"metric": "loss", "value": search_clean[1:].mean(), "set_name": "ood-search"},
            {"metric": "loss_first", "value": search_clean[0], "set_name": "ood-search"}]
    ablated_loss = {}
    for site, directions in found.items():
        ablated = model_losses(family, select_streams, search_select, search_refs, site, direction_ablation(directions), positions)
        ablated_loss[site] = float(ablated[1:].mean())
        rows += [{"metric": "search_loss_ablate_V", "value": ablated_loss[site], "set_name": "ood-search", "place": site},
                 {"metric": "search_gain_removed", "value": gain_removed(ablated, search_clean), "set_name": "ood-search", "place": site}]
    return max(found, key=ablated_loss.get), rows


def prior_predictions(run: Run) -> torch.Tensor:
    """[2048, V] OOD-optimal predictions at the last position over 2048 OOD tasks (token families):
    the sample of the OOD prediction map that d0 is estimated from."""
    family, cfg = run.family, run.config
    return family.predict_ood(family.sample_ood(2048, cfg.task.seq_len, cfg.train.seed, 0, "dual-prior").tokens)[:, -1]


def analyze_dual(run: Run, n_seq: int = 256, rank: int = 1, search_steps: int = 200) -> list[dict]:
    """All section-5 measurements of a finished run; writes and returns the rows."""
    model, family, pool, cfg = run.load_model(), run.family, run.pool, run.config
    majors, seed, n_layers = pool.subset("major"), cfg.train.seed, cfg.model.n_layers
    rows: list[dict] = []

    def add(metric: str, value: float, band: list[float] | None = None, set_name: str | None = None, step: int | None = None,
            place: Site | None = None) -> None:
        layer, site = place if place is not None else (None, None)
        rows.append({"metric": metric, "value": float(value), "band": band, "set": set_name, "step": step, "layer": layer, "site": site})

    site_names = [s for s in ("resid_mid", "resid_post") if s in run.sites]
    all_sites = [(layer, name) for layer in range(n_layers) for name in site_names]
    selection = analysis_inputs(run, SELECTION_STREAM, SELECTION_SEQUENCES)
    place, runner_up, _ = select_place(model, selection, all_sites, late_window(selection.current.shape[1]), 0, seed)
    add("place_selected", 1.0, place=place)
    if runner_up is not None:
        add("place_runner_up", 1.0, place=runner_up)

    major_inputs = analysis_inputs(run, "dual-geometry", n_seq)
    ood = family.sample_ood(n_seq, cfg.task.seq_len, seed, 0, "dual-geometry-ood")
    ood_inputs = family_inputs(family, ood, majors)
    window = late_window(major_inputs.current.shape[1])
    search_sites = [(layer, SEARCH_SITE if SEARCH_SITE in run.sites else "resid_post") for layer in range(n_layers)]
    readout_site = (n_layers - 1, "resid_post")
    fitted = fitted_geometries(model, major_inputs, ood_inputs, list(dict.fromkeys([*all_sites, *search_sites, readout_site])), window)
    for site in all_sites:  # the full table; the claims read the selected place
        for form, r2 in _projection_r2(*fitted[site], ood_inputs.current, window).items():
            add(f"table.{_PROJECTION[form]}", r2.mean(), _quartiles(r2), "ood", place=site)

    geometry, h_ood = fitted[place]
    add("task_rank", geometry.subspace.rank, place=place)
    final = _projection_r2(geometry, h_ood, ood_inputs.current, window)
    for form, r2 in final.items():
        add(_PROJECTION[form], r2.mean(), _quartiles(r2), "ood", place=place)
    checkpoints = {**run.snapshots(), cfg.train.steps: model}  # {step: model} across training
    for step, snapshot in checkpoints.items():
        by_form = final if snapshot is model else _projection_r2(*fitted_geometries(snapshot, major_inputs, ood_inputs, [place], window)[place],
                                                                 ood_inputs.current, window)
        for form, r2 in by_form.items():
            add(_PROJECTION[form], r2.mean(), _quartiles(r2), "ood", step, place)

    T = cfg.task.seq_len
    s_positions = major_inputs.model_positions(slice(None))  # E2: its separators; token families: every position
    avoided = {site: avoid_basis(fitted[site][0].subspace.basis.float(),
                                 token_subspace(fitted[site][0].nu.float(), centre=not isinstance(family, Regression)))
               for site in search_sites}

    search_loss = search_loss_fn(run, model)

    def search(site_ranks: list[tuple[Site, int]]) -> list[torch.Tensor]:
        """V: [D, r] of each (site, rank)."""
        results = orthogonal_searches(model, search_loss, [(site, avoided[site], r) for site, r in site_ranks], steps=search_steps,
                                      seed=seed, positions=s_positions)
        return [result.directions for result in results]

    found = dict(zip(search_sites, search([(site, rank) for site in search_sites])))
    v_site, select_rows = select_v_site(run, model, found, n_seq, s_positions)
    for row in select_rows:
        add(**row)
    directions = found[v_site]
    add("v_layer_selected", 1.0, place=v_site)
    v_geometry = fitted[v_site][0]
    add("orthogonality", (directions.T.double() @ v_geometry.subspace.basis).abs().max(), place=v_site)
    add("orthogonality_avoided", (directions.T.double() @ avoided[v_site].double()).abs().max(), place=v_site)

    gen = generator(seed, 0, "dual-random")
    free = complement_basis(avoided[v_site])  # random controls live where V may
    controls = [random_directions(free, rank, gen) for _ in range(N_RANDOM_CONTROLS)]
    batches = loss_batches(run, n_seq)
    references = {name: family.reference_predictions(batch, pool) for name, batch in batches.items()}
    streams = {name: LayerStreams(model, batch.tokens) for name, batch in batches.items()}  # one prefix per batch for every edit
    clean = {name: model_losses(family, streams[name], batch, references[name]) for name, batch in batches.items()}

    def batch_losses(name: str, site: Site, edit) -> torch.Tensor:
        """[P] losses of batch ``name`` with ``edit`` at ``site`` (on the analysed positions)."""
        return model_losses(family, streams[name], batches[name], references[name], site, edit, s_positions)

    for name in batches:
        add("loss", clean[name][1:].mean(), set_name=name)
        add("loss_first", clean[name][0], set_name=name)
        for label, site, edit in (("ablate_S", place, task_ablation(geometry.subspace)), ("ablate_V", v_site, direction_ablation(directions))):
            ablated = batch_losses(name, site, edit)
            add(f"loss_{label}", ablated[1:].mean(), set_name=name, place=site)
            add(f"gain_removed_{label}", gain_removed(ablated, clean[name]), set_name=name, place=site)
        shares = torch.tensor([gain_removed(batch_losses(name, v_site, direction_ablation(v)), clean[name]) for v in controls])
        add("gain_removed_random", shares.mean(), [float(shares.min()), float(shares.max())], name, place=v_site)

    prior = None if isinstance(family, Regression) else prior_predictions(run)
    d0 = float(family.d) if prior is None else participation_ratio(clr(prior))  # d for E2's ridge map
    add("d0", d0)
    ranks = range(1, min(math.ceil(d0), free.shape[1]) + 1)
    others = [r for r in ranks if r != rank]
    curve = {rank: directions, **dict(zip(others, search([(v_site, r) for r in others])))}
    for r in ranks:
        ablated = batch_losses("ood", v_site, direction_ablation(curve[r]))
        add(f"loss_ablate_V_rank{r}", ablated[1:].mean(), set_name="ood", place=v_site)
        add(f"gain_removed_ablate_V_rank{r}", gain_removed(ablated, clean["ood"]), set_name="ood", place=v_site)

    complement = complement_basis(v_geometry.subspace.basis.float())
    positions, target = family.context_statistic(ood)  # at the analysed positions (E2: its separators)
    late = late_window(len(positions))
    target = target[:, late]
    groups = torch.arange(ood.tokens.shape[0])[:, None].expand(-1, target.shape[1]).reshape(-1)
    v_states = fitted[v_site][1][:, late]  # the OOD states at V's layer, from the one streamed pass
    for label, x in (("V", v_states @ directions), ("complement", v_states @ complement)):
        probe = linear_probe(x.reshape(-1, x.shape[-1]).double(), target.reshape(-1, target.shape[-1]).double(), "regression", groups=groups)
        add(f"probe_r2_{label}", probe.score, set_name="ood", place=v_site)
        add(f"probe_r2_{label}_shuffled", probe.control, set_name="ood", place=v_site)

    if isinstance(family, TokenFamily):
        _token_predictions(run, model, checkpoints, fitted[readout_site], ood.tokens, readout_site, prior, add)
    for row in rows:
        row["version"] = DUAL_VERSION
    atomic_write_json(run.path / "analysis" / "dual.json", rows)
    return rows


def _token_predictions(run: Run, model, checkpoints, readout_place: tuple[Geometry, torch.Tensor], tokens, site: Site,
                       prior: torch.Tensor, add) -> None:
    """Theorem 2 (at the last layer's resid_post, where the readout is the final norm and
    unembedding) and the predictor transition over the checkpoints {step: model}, on the OOD
    tokens: [N, T] whose states [N, T, D] at ``site`` ``readout_place`` holds; prior:
    ``prior_predictions``."""
    family, pool, T = run.family, run.pool, run.config.task.seq_len
    geometry, h_ood = readout_place
    subspace, t = geometry.subspace, T - 1
    with torch.no_grad():
        logits = model.readout(h_ood)  # [N, T, V] the final model's output, read off the one streamed pass
    n = tokens.shape[0]
    theory = theorem2(model.readout, h_ood[:, t], subspace.mu[t].float().expand(n, -1), subspace.basis.float(), logits[:, t],
                      family.predict_ood(tokens)[:, t], prior)
    for key in ("k_star", "d0", "lipschitz"):
        add(f"theorem2_{key}", theory[key], place=site)
    for key in ("c", "delta", "bound", "distance"):
        add(f"theorem2_{key}", theory[key].median(), _quartiles(theory[key]), "ood", place=site)
    add("theorem2_share_bound_holds", (theory["distance"] >= theory["bound"]).double().mean(), set_name="ood", place=site)
    references = reference_predictors(family, tokens, pool, run.config.task.p_minor)
    for step, snapshot in checkpoints.items():
        with torch.no_grad():
            stat = transition_statistic(logits if snapshot is model else snapshot(tokens), *references)
        for key, value in stat.items():
            add(f"transition_{key}", value, set_name="ood", step=step)


def load_dual(run: Run) -> list[dict] | None:
    """The saved rows, or None if this run has not been analysed under the current conventions
    (rows of an earlier ``DUAL_VERSION`` are measured again; the run is not retrained)."""
    path = run.path / "analysis" / "dual.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())
    return rows if rows and all(isinstance(r, dict) and r.get("version") == DUAL_VERSION for r in rows) else None

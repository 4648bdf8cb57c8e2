"""One run's dual-mode measurements (PAPER.md section 5), saved as ``analysis/dual.json``.

Rows are tidy ``{metric, value, band, set, step, layer, site}`` records (``band`` an
interquartile pair or null) that ``pandas.read_json`` loads in one call. The site defaults to the
last layer's ``resid_post``; task vectors come from major-task sequences, the orthogonal
directions from a separate batch of OOD sequences, and every loss from held-out sequences of their
own streams. Losses are the family's own (nats for token families, squared error for E2); the
predictor transition and Theorem 2 compare next-token distributions, so they are measured for
token families only.
"""

from __future__ import annotations

import json

import torch

from taskgeom.analysis.probes import linear_probe
from taskgeom.analysis.states import collect
from taskgeom.analysis.subspace import (complement_basis, direction_ablation, gain_removed, model_losses, orthogonal_search,
                                        projection_r2, random_directions, task_ablation)
from taskgeom.analysis.task_vectors import late_window, task_vectors
from taskgeom.analysis.theory import clr, theorem2
from taskgeom.analysis.transition import transition_statistic
from taskgeom.hooks import Site
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json
from taskgeom.tasks import Batch, TokenFamily

N_RANDOM_CONTROLS = 5


def _quartiles(x: torch.Tensor) -> list[float]:
    q = torch.quantile(x.double().flatten(), torch.tensor([0.25, 0.75], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def _projection_r2(h_major: torch.Tensor, h_ood: torch.Tensor, task: torch.Tensor, n_major: int, window: slice) -> torch.Tensor:
    """[N * W] projection R^2 of late OOD states [N, T, D] on the task vectors of h_major."""
    vectors = task_vectors(h_major, task, n_major, window)
    return projection_r2((h_ood - vectors.mu)[:, window].reshape(-1, h_ood.shape[-1]), vectors.theta)


def _batches(run: Run, size: int) -> dict[str, Batch]:
    """Held-out batches: major, minor (if the pool has minors), ood, and ood-search."""
    family, pool, cfg = run.family, run.pool, run.config
    T, seed = cfg.task.seq_len, cfg.train.seed
    out = {"major": family.sample(pool, size, T, seed, 0, "dual", "major")}
    if pool.n_minor:
        out["minor"] = family.sample(pool, size, T, seed, 0, "dual", "minor")
    out["ood"] = family.sample_ood(size, T, seed, 0, "dual-ood")
    out["ood-search"] = family.sample_ood(size, T, seed, 0, "dual-ood-search")
    return out


def analyze_dual(run: Run, site: Site | None = None, n_seq: int = 256, rank: int = 1, search_steps: int = 200) -> list[dict]:
    """All section-5 measurements of a finished run at ``site``; writes and returns the rows."""
    model, family, pool = run.load_model(), run.family, run.pool
    site = site or (run.config.model.n_layers - 1, "resid_post")
    window = late_window(run.config.task.seq_len)
    batches = _batches(run, n_seq)
    rows: list[dict] = []

    def add(metric: str, value: float, band: list[float] | None = None, set_name: str | None = None, step: int | None = None) -> None:
        rows.append({"metric": metric, "value": float(value), "band": band, "set": set_name, "step": step})

    major, ood = batches["major"], batches["ood"]
    states = collect(model, torch.cat([major.tokens, ood.tokens]), [site])[site]
    h_major, h_ood = states[:n_seq], states[n_seq:]
    vectors = task_vectors(h_major, major.task, pool.n_major, window)
    basis = vectors.basis
    add("task_rank", basis.shape[1])

    r2 = _projection_r2(h_major, h_ood, major.task, pool.n_major, window)
    add("projection_r2", r2.mean(), _quartiles(r2), "ood")
    checkpoints = {**run.snapshots(), run.config.train.steps: model}  # {step: model} across training
    for step, snapshot in checkpoints.items():
        if snapshot is model:
            r2_step = r2
        else:
            early = collect(snapshot, torch.cat([major.tokens, ood.tokens]), [site])[site]
            r2_step = _projection_r2(early[:n_seq], early[n_seq:], major.task, pool.n_major, window)
        add("projection_r2", r2_step.mean(), _quartiles(r2_step), "ood", step)

    search = batches["ood-search"]
    directions = orthogonal_search(model, lambda m: family.training_loss(m, search), site, basis, rank=rank, steps=search_steps,
                                   seed=run.config.train.seed)
    complement = complement_basis(basis)
    gen = generator(run.config.train.seed, 0, "dual-random")
    controls = [random_directions(complement, rank, gen) for _ in range(N_RANDOM_CONTROLS)]
    add("orthogonality", (directions.T @ basis).abs().max())
    for name in [n for n in ("major", "minor", "ood") if n in batches]:
        batch = batches[name]
        references = family.reference_predictions(batch, pool)
        clean = model_losses(family, model, batch, references)
        late = late_window(len(clean))
        add("loss", clean[late].mean(), set_name=name)
        add("loss_first", clean[0], set_name=name)
        for label, edit in (("ablate_S", task_ablation(vectors)), ("ablate_V", direction_ablation(directions))):
            ablated = model_losses(family, model, batch, references, site, edit)
            add(f"loss_{label}", ablated[late].mean(), set_name=name)
            add(f"gain_removed_{label}", gain_removed(ablated, clean, late), set_name=name)
        shares = torch.tensor([gain_removed(model_losses(family, model, batch, references, site, direction_ablation(v)), clean, late)
                               for v in controls])
        add("gain_removed_random", shares.mean(), [float(shares.min()), float(shares.max())], name)

    positions, target = family.context_statistic(ood)
    late = positions[late_window(len(positions))]
    target = target[:, late_window(len(positions))]
    groups = torch.arange(n_seq)[:, None].expand(-1, len(late)).reshape(-1)
    for label, x in (("V", h_ood[:, late] @ directions), ("complement", h_ood[:, late] @ complement)):
        probe = linear_probe(x.reshape(-1, x.shape[-1]).double(), target.reshape(-1, target.shape[-1]).double(), "regression", groups=groups)
        add(f"probe_r2_{label}", probe.score, set_name="ood")
        add(f"probe_r2_{label}_shuffled", probe.control, set_name="ood")

    if isinstance(family, TokenFamily):
        _token_predictions(run, model, checkpoints, h_ood, vectors.mu, basis, ood.tokens, site, add)
    for row in rows:
        row.update(layer=site[0], site=site[1])
    atomic_write_json(run.path / "analysis" / "dual.json", rows)
    return rows


def _token_predictions(run: Run, model, checkpoints, h_ood, mu, basis, tokens, site: Site, add) -> None:
    """Theorem 2 (at the last layer's resid_post) and the predictor transition over the
    checkpoints {step: model}."""
    family, pool, T, seed = run.family, run.pool, run.config.task.seq_len, run.config.train.seed
    if site == (run.config.model.n_layers - 1, "resid_post"):
        t = T - 1
        with torch.no_grad():
            logits = model(tokens)[:, t]
        prior = family.predict_ood(family.sample_ood(2048, T, seed, 0, "dual-prior").tokens)[:, t]
        n = tokens.shape[0]
        theory = theorem2(model.readout, h_ood[:, t], mu[t].expand(n, -1), basis, logits, family.predict_ood(tokens)[:, t], prior)
        for key in ("k_star", "d0", "lipschitz"):
            add(f"theorem2_{key}", theory[key])
        for key in ("c", "delta", "bound", "distance"):
            add(f"theorem2_{key}", theory[key].median(), _quartiles(theory[key]), "ood")
        add("theorem2_share_bound_holds", (theory["distance"] >= theory["bound"]).double().mean(), set_name="ood")
    for step, snapshot in checkpoints.items():
        stat = transition_statistic(snapshot, family, tokens, pool, run.config.task.p_minor)
        for key, value in stat.items():
            add(f"transition_{key}", value, set_name="ood", step=step)


def load_dual(run: Run) -> list[dict] | None:
    """The saved rows, or None if this run has not been analysed."""
    path = run.path / "analysis" / "dual.json"
    return json.loads(path.read_text()) if path.exists() else None

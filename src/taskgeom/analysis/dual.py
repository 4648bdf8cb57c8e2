"""One run's dual-mode measurements (PAPER.md section 5), saved as ``analysis/dual.json``.

Rows are tidy ``{metric, value, band, set, step}`` records (``band`` an interquartile pair or
null) that ``pandas.read_json`` loads in one call. The site defaults to the last layer's
``resid_post``; task vectors come from major-task sequences, the orthogonal directions from a
separate batch of OOD sequences, and every loss from held-out sequences of their own streams.
"""

from __future__ import annotations

import json

import torch

from taskgeom.analysis.probes import linear_probe
from taskgeom.analysis.states import collect
from taskgeom.analysis.subspace import (complement_basis, direction_ablation, gain_removed, orthogonal_search, position_losses,
                                        projection_r2, random_directions, task_ablation)
from taskgeom.analysis.task_vectors import late_window, task_vectors
from taskgeom.analysis.theory import clr, theorem2
from taskgeom.analysis.transition import transition_statistic
from taskgeom.hooks import Site
from taskgeom.rng import generator
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json

N_RANDOM_CONTROLS = 5


def _quartiles(x: torch.Tensor) -> list[float]:
    q = torch.quantile(x.double().flatten(), torch.tensor([0.25, 0.75], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def _batches(run: Run, size: int) -> dict[str, torch.Tensor]:
    """Held-out token batches: major, minor (if the pool has minors), ood, and ood-search."""
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
    T = run.config.task.seq_len
    window = late_window(T)
    loss_window = slice(window.start, T - 1)  # per-position losses cover positions 0..T-2
    batches = _batches(run, n_seq)
    rows: list[dict] = []

    def add(metric: str, value: float, band: list[float] | None = None, set_name: str | None = None, step: int | None = None) -> None:
        rows.append({"metric": metric, "value": float(value), "band": band, "set": set_name, "step": step})

    major = batches["major"]
    states = collect(model, torch.cat([major.tokens, batches["ood"].tokens]), [site])[site]
    h_major, h_ood = states[:n_seq], states[n_seq:]
    vectors = task_vectors(h_major, major.task, pool.n_major, window)
    basis = vectors.basis
    add("task_rank", basis.shape[1])

    r2 = projection_r2((h_ood - vectors.mu)[:, window].reshape(-1, h_ood.shape[-1]), vectors.theta)
    add("projection_r2", r2.mean(), _quartiles(r2), "ood")

    directions = orthogonal_search(model, batches["ood-search"].tokens, site, basis, rank=rank, steps=search_steps, seed=run.config.train.seed)
    complement = complement_basis(basis)
    gen = generator(run.config.train.seed, 0, "dual-random")
    controls = [random_directions(complement, rank, gen) for _ in range(N_RANDOM_CONTROLS)]
    add("orthogonality", (directions.T @ basis).abs().max())
    for name in [n for n in ("major", "minor", "ood") if n in batches]:
        tokens = batches[name].tokens
        clean = position_losses(model, tokens)
        add("loss", clean[loss_window].mean(), set_name=name)
        add("loss_first", clean[0], set_name=name)
        for label, edit in (("ablate_S", task_ablation(vectors)), ("ablate_V", direction_ablation(directions))):
            ablated = position_losses(model, tokens, site, edit)
            add(f"loss_{label}", ablated[loss_window].mean(), set_name=name)
            add(f"gain_removed_{label}", gain_removed(ablated, clean, loss_window), set_name=name)
        shares = torch.tensor([gain_removed(position_losses(model, tokens, site, direction_ablation(v)), clean, loss_window) for v in controls])
        add("gain_removed_random", shares.mean(), [float(shares.min()), float(shares.max())], name)

    ood = batches["ood"]
    ood_optimal = family.predict_ood(ood.tokens)  # [N, T, V]
    features = (h_ood @ directions)[:, window]  # [N, W, rank]
    targets = clr(ood_optimal[:, window])
    groups = torch.arange(n_seq)[:, None].expand(-1, features.shape[1]).reshape(-1)
    for label, x in (("V", features), ("complement", (h_ood @ complement)[:, window])):
        probe = linear_probe(x.reshape(-1, x.shape[-1]).double(), targets.reshape(-1, targets.shape[-1]), "regression", groups=groups)
        add(f"probe_r2_{label}", probe.score, set_name="ood")
        add(f"probe_r2_{label}_shuffled", probe.control, set_name="ood")

    last = run.config.model.n_layers - 1
    if site == (last, "resid_post"):
        t = T - 1
        with torch.no_grad():
            logits = model(ood.tokens)[:, t]
        prior = family.predict_ood(family.sample_ood(2048, T, run.config.train.seed, 0, "dual-prior").tokens)[:, t]
        theory = theorem2(model.readout, h_ood[:, t], vectors.mu[t].expand(n_seq, -1), basis, logits, ood_optimal[:, t], prior)
        for key in ("k_star", "d0", "lipschitz"):
            add(f"theorem2_{key}", theory[key])
        for key in ("c", "delta", "bound", "distance"):
            add(f"theorem2_{key}", theory[key].median(), _quartiles(theory[key]), "ood")
        add("theorem2_share_bound_holds", (theory["distance"] >= theory["bound"]).double().mean(), set_name="ood")

    p_new = run.config.task.p_minor
    for step, snapshot in {**run.snapshots(), run.config.train.steps: model}.items():
        stat = transition_statistic(snapshot, family, ood.tokens, pool, p_new)
        for key, value in stat.items():
            add(f"transition_{key}", value, set_name="ood", step=step)

    for row in rows:
        row.update(layer=site[0], site=site[1])
    atomic_write_json(run.path / "analysis" / "dual.json", rows)
    return rows


def load_dual(run: Run) -> list[dict] | None:
    """The saved rows, or None if this run has not been analysed."""
    path = run.path / "analysis" / "dual.json"
    return json.loads(path.read_text()) if path.exists() else None

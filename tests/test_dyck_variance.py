"""E4's P0 as the study's ``variance.py`` computes it (``compute_p1_variance_dyck`` and
``_compute_dyck_r2``), held to a plain implementation of its steps on a tiny trained E4 run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taskgeom.rng import generator
from taskgeom.settings.recipes import build_config
from taskgeom.studies.e4.variance import STREAM, bracket_masks, study_p0

N_MASKS, PER_MASK = 4, 24


@pytest.fixture(scope="module")
def dyck_run(tmp_path_factory):
    """A finished 2-block, 16-wide E4 model (3 pairs, 3 noise tokens, 3 majors) trained 30 steps."""
    from taskgeom.runs.folders import Run
    from taskgeom.training.train import train

    config = build_config(
        {
            "name": "tiny-dyck",
            "task": {"family": "dyck", "seq_len": 24, "n_pairs": 3, "n_noise": 3, "p_bracket": 0.4},
            "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 24},
            "train": {
                "steps": 30,
                "batch_size": 16,
                "eval_every": 30,
                "checkpoint_every": 30,
                "eval_batch": 16,
                "lr": 3e-3,
                "threads": 1,
            },
        }
    )
    run = Run.create(config, tmp_path_factory.mktemp("dyck"))
    train(run)
    return Run.open(run.path)


def _residual_ratio_by_hand(run) -> np.ndarray:
    """[L, J] the study's steps one by one: masks drawn once (a coin per position from the same
    generator, the first 2n successes kept); for each (task, mask) the sequences built token by token, the task's i-th bracket at
    the mask's i-th place; each block's attention output (resid_mid) read by a forward hook at the
    mask's bracket positions before the last position, the fewest over masks; per task the mean
    state and the mean squared norm; per bracket j the tasks grouped by their brackets j-2..j, R^2 =
    1 - SS_within / (SS_between + SS_within + 1e-10) as ``_compute_dyck_r2`` sums them."""
    family, model, T = run.family, run.load_model(), run.config.task.seq_len
    gen = generator(run.config.train.seed, 0, STREAM)
    coin = torch.rand(N_MASKS, T, generator=gen, dtype=torch.float64) < family.p_bracket
    masks = torch.zeros(N_MASKS, T, dtype=torch.bool)
    for m in range(N_MASKS):
        for t in [t for t in range(T) if coin[m, t]][: family.length]:
            masks[m, t] = True
    words = run.pool.params[: run.pool.n_major].tolist()
    real = [[t for t in range(T - 1) if masks[m, t]] for m in range(N_MASKS)]
    J = min(len(r) for r in real)
    L, K, D = len(model.blocks), len(words), run.config.model.d_model
    cache = {}
    handles = [
        model.site(layer, "resid_mid").register_forward_hook(
            lambda module, inputs, out, layer=layer: cache.__setitem__(layer, out)
        )
        for layer in range(L)
    ]
    sum_h, sum_h2 = np.zeros((L, K, J, D)), np.zeros((L, K, J))
    for k, word in enumerate(words):
        for m in range(N_MASKS):
            noise = torch.randint(0, family.n_noise, (PER_MASK, T), generator=gen)
            tokens = noise.clone()
            for b in range(PER_MASK):
                placed = 0
                for t in range(T):
                    if masks[m, t]:
                        tokens[b, t] = family.n_noise + word[placed]
                        placed += 1
            with torch.no_grad():
                model(tokens)
            for layer in range(L):
                h = cache[layer][:, real[m][:J]].double().numpy()
                sum_h[layer, k] += h.sum(0)
                sum_h2[layer, k] += (h**2).sum(-1).sum(0)
    for handle in handles:
        handle.remove()
    n = N_MASKS * PER_MASK
    mean_h = sum_h / n
    var = np.clip(sum_h2 / n - (mean_h**2).sum(-1), 0.0, None)
    ratio = np.zeros((L, J))
    for layer in range(L):
        for j in range(J):
            groups = {}
            for k in range(K):
                groups.setdefault(tuple(words[k][max(0, j + 1 - 3) : j + 1]), []).append(k)
            grand = mean_h[layer, :, j].mean(0)
            between = within = 0.0
            for ids in groups.values():
                cell = mean_h[layer, ids, j].mean(0)
                between += len(ids) * n * ((cell - grand) ** 2).sum()
                for k in ids:
                    within += n * var[layer, k, j] + n * ((mean_h[layer, k, j] - cell) ** 2).sum()
            ratio[layer, j] = 1.0 - (1.0 - within / (between + within + 1e-10))
    return ratio


def test_e4_p0_is_the_study_s_residual_variance_ratio_by_hand(dyck_run):
    """The package's [L, J] residual variance ratio equals the plain implementation: the state at
    resid_mid at bracket j's own position, cells of the tasks sharing their last three brackets."""
    expected = _residual_ratio_by_hand(dyck_run)
    measured = study_p0(dyck_run, n_masks=N_MASKS, per_mask=PER_MASK).numpy()
    assert measured.shape == expected.shape and expected.shape[1] >= 2
    np.testing.assert_allclose(measured, expected, rtol=1e-6, atol=1e-9)
    assert ((measured > 0) & (measured <= 1)).all()


def test_bracket_masks_place_the_family_s_brackets():
    """A mask keeps the first 2n successes of a p_bracket coin per position, as the family places its
    brackets: planting through a mask gives the family's own tokens for the same coin and noise."""
    from taskgeom import tasks

    family = tasks.make("dyck", n_pairs=3, n_noise=3, p_bracket=0.5)
    masks = bracket_masks(family, 200, 30, torch.Generator().manual_seed(0))
    assert int(masks.sum(1).max()) == family.length and 0.4 < float(masks[:, :5].float().mean()) < 0.6
    words = family.sample_params(1, torch.Generator().manual_seed(1))
    noise = torch.randint(0, 3, (200, 30), generator=torch.Generator().manual_seed(2))
    tokens = family.plant(words.expand(200, -1), masks, noise)
    assert torch.equal(tokens >= family.n_noise, masks)
    assert torch.equal(
        family.planted(tokens, 1)[masks.sum(1) == family.length, -1],
        words[0, -1].expand(int((masks.sum(1) == family.length).sum())),
    )

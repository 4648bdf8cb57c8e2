"""E2 (in-context linear regression): layout, predictors against closed forms, config checks and
the vector model's pass through the shared trainer and evaluator."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from taskgeom import tasks
from taskgeom.hooks import capture
from taskgeom.models import Transformer
from taskgeom.runs.folders import Run
from taskgeom.settings.config import ConfigError, ModelConfig
from taskgeom.settings.recipes import build_config
from taskgeom.tasks import Batch, TaskPool
from taskgeom.training.evaluate import evaluate_run
from taskgeom.training.train import train

torch.set_num_threads(1)


def _family(**kw) -> tasks.TaskFamily:
    return tasks.make("regression", **kw)


def _batch(family, x: torch.Tensor, y: torch.Tensor) -> Batch:
    return Batch(
        family.encode(x, y), torch.zeros(x.shape[0], dtype=torch.long), torch.zeros(x.shape[0], x.shape[2]), x, y
    )


# ---- layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,stride,pred_offset", [("separator", 3, 1), ("pair", 2, 0)])
def test_layout_places_x_separator_and_y(layout, stride, pred_offset):
    family = _family(d=3, layout=layout)
    batch = family.sample(family.sample_pool(2, 0), 4, 5 * stride, seed=1)
    assert batch.tokens.shape == (4, 5 * stride, 5) and batch.x.shape == (4, 5, 3) and batch.y.shape == (4, 5)
    slots = batch.tokens.view(4, 5, stride, 5)
    torch.testing.assert_close(slots[:, :, 0, :3], batch.x.float())
    assert (slots[:, :, 0, 3:] == 0).all()
    torch.testing.assert_close(slots[:, :, -1, 3], batch.y.float())
    assert (slots[:, :, -1, :3] == 0).all() and (slots[:, :, -1, 4] == -1).all()
    if layout == "separator":
        assert (slots[:, :, 1, :4] == 0).all() and (slots[:, :, 1, 4] == 1).all()
    assert family.prediction_positions(5).tolist() == [stride * i + pred_offset for i in range(5)]
    with pytest.raises(ValueError, match="multiple of"):
        family.n_examples(5 * stride + 1)


def test_samples_follow_the_model_and_the_seed():
    family = _family(d=4, noise=0.5)
    pool = family.sample_pool(3, 4)
    a = family.sample(pool, 2000, family.stride * 8, seed=3, step=7)
    b = family.sample(pool, 2000, family.stride * 8, seed=3, step=7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.task, b.task)
    torch.testing.assert_close(a.params, pool.params[a.task])
    noise = a.y - torch.einsum("bnd,bd->bn", a.x, a.params)
    assert abs(noise.std().item() - 0.5) < 0.01 and abs(a.x.std().item() - 1.0) < 0.01
    ood = family.sample_ood(3000, family.stride, seed=0)
    assert (ood.task == -1).all() and abs(ood.params.std().item() - 1.0) < 0.03


# ---- predictors against closed forms ----------------------------------------------------------
def test_posterior_over_two_tasks_after_one_example_by_hand():
    family = _family(d=2, noise=0.7)
    w = torch.tensor([[1.0, -2.0], [0.5, 0.25]], dtype=torch.float64)
    pool = TaskPool(w, torch.tensor([0.3, 0.7], dtype=torch.float64), n_major=2)
    x = torch.tensor([[[0.4, -1.1], [2.0, 0.3]]], dtype=torch.float64)
    y = torch.tensor([[1.3, -0.2]], dtype=torch.float64)
    batch = _batch(family, x, y)
    post = family.log_posterior(batch, pool).exp()[0]  # [n, K]
    # by hand: p_k ∝ pi_k exp(-(y - w_k.x)^2 / (2 sigma^2)) after the first example
    r1, r2 = 1.3 - (0.4 * 1.0 + -1.1 * -2.0), 1.3 - (0.4 * 0.5 + -1.1 * 0.25)
    a1, a2 = 0.3 * math.exp(-(r1**2) / (2 * 0.49)), 0.7 * math.exp(-(r2**2) / (2 * 0.49))
    torch.testing.assert_close(post[0], torch.tensor([0.3, 0.7], dtype=torch.float64))
    torch.testing.assert_close(post[1], torch.tensor([a1 / (a1 + a2), a2 / (a1 + a2)], dtype=torch.float64))
    dmmse = (a1 * (2.0 * 1.0 + 0.3 * -2.0) + a2 * (2.0 * 0.5 + 0.3 * 0.25)) / (a1 + a2)
    assert family.predict_id(batch, pool)[0, 1].item() == pytest.approx(dmmse, rel=1e-12)


def test_mix_prediction_with_one_hot_weights_is_the_task_prediction():
    family = _family(d=3)
    gen = torch.Generator().manual_seed(0)
    params, x = (
        torch.randn(4, 3, generator=gen, dtype=torch.float64),
        torch.randn(5, 6, 3, generator=gen, dtype=torch.float64),
    )
    k = torch.randint(0, 4, (5, 6), generator=gen)
    onehot = torch.nn.functional.one_hot(k, 4).double()
    torch.testing.assert_close(family.mix_prediction(x, params, onehot), (params[k] * x).sum(-1))


def test_ridge_matches_numpy_solve_for_every_prefix():
    family = _family(d=3, noise=0.6)
    batch = family.sample_ood(4, family.stride * 7, seed=2)
    got = family.ridge_weights(batch.x, batch.y).numpy()
    pred = family.predict_ood(batch).numpy()
    x, y = batch.x.numpy(), batch.y.numpy()
    for b in range(4):
        for i in range(7):
            X, Y = x[b, :i], y[b, :i]
            w = np.linalg.solve(X.T @ X + 0.36 * np.eye(3), X.T @ Y)
            np.testing.assert_allclose(got[b, i], w, rtol=1e-10, atol=1e-12)
            assert pred[b, i] == pytest.approx(float(w @ x[b, i]), rel=1e-9, abs=1e-12)


def test_dmmse_approaches_ridge_as_a_prior_pool_grows():
    """A uniform pool of K draws from the prior: its posterior mean tends to the ridge solution."""
    family = _family(d=2, noise=0.5)
    batch = family.sample_ood(32, 3 * 6, seed=4)
    ridge = family.predict_ood(batch)
    gaps = []
    for size in (4, 64, 1024, 16384):
        params = family.sample_params(size, torch.Generator().manual_seed(size))
        pool = TaskPool(params, torch.full((size,), 1.0 / size, dtype=torch.float64), n_major=size)
        gaps.append(((family.predict_id(batch, pool) - ridge) ** 2).mean().item())
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 0.02 * gaps[0], gaps


# ---- model, config, training --------------------------------------------------------------------
def test_vector_model_keeps_hook_identities_and_its_loss_is_the_mse():
    family = _family(d=3, layout="separator")
    model = Transformer(ModelConfig(n_layers=2, d_model=16, n_heads=2, d_mlp=32, max_len=24), **family.model_io())
    batch = family.sample(family.sample_pool(3, 0), 5, 24, seed=0)
    sites = [(layer, s) for layer in range(2) for s in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")]
    with capture(model, sites) as store:
        out = model(batch.tokens)
    for layer in range(2):
        torch.testing.assert_close(
            store[(layer, "resid_mid")], store[(layer, "resid_pre")] + store[(layer, "attn_out")]
        )
        torch.testing.assert_close(
            store[(layer, "resid_post")], store[(layer, "resid_mid")] + store[(layer, "mlp_out")]
        )
    assert out.shape == (5, 24, 1)
    expected = ((out[:, 1::3, 0] - batch.y.float()) ** 2).mean()
    torch.testing.assert_close(family.training_loss(model, batch), expected)
    with pytest.raises(ValueError, match="vector model reads inputs"):
        model(batch.tokens[..., :4])


def _raw(**task) -> dict:
    return {"name": "t", "task": {"family": "regression", **task}, "model": {"max_len": 48}}


@pytest.mark.parametrize(
    "field,value", [("d", 0), ("n_examples", 0), ("n_examples", -3), ("noise", 0.0), ("noise", -0.5)]
)
def test_config_rejects_impossible_sizes_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"task.{field}"):
        build_config(_raw(**{field: value}))


def test_config_rejects_sequences_longer_than_the_model_positions():
    assert build_config(_raw(n_examples=16, layout="separator")).task.seq_len == 48
    with pytest.raises(ConfigError, match=r"task.n_examples \(17\) needs 51 positions.*model.max_len \(48\)"):
        build_config(_raw(n_examples=17, layout="separator"))
    assert build_config(_raw(n_examples=24, layout="pair")).task.seq_len == 48
    with pytest.raises(ConfigError, match="task.n_examples"):
        build_config(_raw(n_examples=25, layout="pair"))


def test_a_short_run_trains_and_evaluates_against_dmmse_and_ridge(tmp_path):
    config = build_config(
        {
            "name": "e2t",
            "task": {"family": "regression", "d": 2, "n_examples": 4, "diversity": 1},
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 12},
            "train": {"steps": 4, "batch_size": 8, "eval_every": 2, "checkpoint_every": 2, "eval_batch": 16},
        }
    )
    run = Run.create(config, tmp_path)
    record = train(run)
    assert set(record["eval"]) == {"major", "minor", "ood"}
    rows = evaluate_run(run)
    metrics = {r["metric"] for r in rows}
    assert metrics == {"loss", "bayes_id_loss", "bayes_ood_loss", "sq_gap_bayes_model", "excess"}
    assert {r["position"] for r in rows} == set(range(4))
    # position 0: no examples yet, so ridge predicts 0 and its squared error is the mean y^2
    ood = run.family.sample_ood(16, config.task.seq_len, config.train.seed, 0, "eval-ood")
    first = next(
        r["value"] for r in rows if r["set"] == "ood" and r["metric"] == "bayes_ood_loss" and r["position"] == 0
    )
    assert first == pytest.approx(float((ood.y[:, 0] ** 2).mean()), rel=1e-12)


def test_pair_layout_reads_the_prediction_at_x():
    family = _family(d=3, layout="pair")
    model = Transformer(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=32, max_len=16), **family.model_io())
    batch = family.sample(family.sample_pool(3, 0), 4, 16, seed=0)
    out = model(batch.tokens)[..., 0]
    torch.testing.assert_close(family.training_loss(model, batch), ((out[:, 0::2] - batch.y.float()) ** 2).mean())


def test_late_means_average_the_last_half_of_the_examples():
    from taskgeom.studies.e2.claims import late_means

    rows = [
        {"set": s, "position": i, "metric": "loss", "value": float(10 * i + (s == "ood"))}
        for s in ("major", "ood")
        for i in range(6)
    ]
    means = late_means(pd.DataFrame(rows), 6)
    assert means.loc["major", "loss"] == pytest.approx((30 + 40 + 50) / 3)
    assert means.loc["ood", "loss"] == pytest.approx((31 + 41 + 51) / 3)


# ---- E2 at the study's settings (docs/protocol.md#the-studys-settings-the-paper-profile): pair layout, majors from a fixed task seed -----
def test_e2_majors_are_the_same_at_every_diversity_and_with_major_seed_in_every_run(tmp_path):
    from taskgeom.settings.recipes import load_recipe

    def majors(seed: int, k: int, *more: str) -> torch.Tensor:
        return Run(
            tmp_path, load_recipe("e2", "paper", [f"train.seed={seed}", f"task.diversity={k}", *more])
        ).pool.params[:3]

    first = majors(0, -1)
    assert first.shape == (3, 6)
    for seed, k in ((1, -1), (2, 3), (0, 10)):
        assert torch.equal(majors(seed, k), first), (seed, k)
    # without a major seed: drawn from the run's pool seed, still the same at every diversity of one seed
    per_run = majors(0, -1, "task.major_seed=null")
    assert torch.equal(majors(0, 6, "task.major_seed=null"), per_run) and not torch.equal(
        majors(1, -1, "task.major_seed=null"), per_run
    )
    minors = [
        Run(tmp_path, load_recipe("e2", "paper", [f"train.seed={s}", "task.diversity=2"])).pool.params[3:]
        for s in (0, 1)
    ]
    assert not torch.equal(*minors)


def test_pair_layout_bayes_at_the_x_tokens_matches_numpy():
    """In the pair layout the prediction of y_i is read at x_i's token, which holds x_i and no y_i;
    the pool posterior, dMMSE and ridge in force there use examples 0..i-1 (numpy, by loops)."""
    family = _family(d=3, noise=0.5, layout="pair")
    pool = family.sample_pool(3, 2, 0.1, seed=4)
    batch = family.sample(pool, 5, 2 * 9, seed=6)
    at = family.prediction_positions(9)
    assert at.tolist() == list(range(0, 18, 2))
    torch.testing.assert_close(batch.tokens[:, at, :3], batch.x.float())
    assert (batch.tokens[:, at, 3:] == 0).all()  # neither y_i nor the y flag at x_i's token
    post, dmmse, ridge = (
        family.log_posterior(batch, pool).exp().numpy(),
        family.predict_id(batch, pool).numpy(),
        family.predict_ood(batch).numpy(),
    )
    x, y, w, prior = batch.x.numpy(), batch.y.numpy(), pool.params.numpy(), pool.weights.numpy()
    for b in range(5):
        for i in range(9):
            loglik = np.array([-((y[b, :i] - x[b, :i] @ w[k]) ** 2).sum() / (2 * 0.25) for k in range(pool.size)])
            p = prior * np.exp(loglik - loglik.max())
            p /= p.sum()
            np.testing.assert_allclose(post[b, i], p, rtol=1e-9, atol=1e-12)
            assert dmmse[b, i] == pytest.approx(float(p @ w @ x[b, i]), rel=1e-9, abs=1e-12)
            X, Y = x[b, :i], y[b, :i]
            assert ridge[b, i] == pytest.approx(
                float(np.linalg.solve(X.T @ X + 0.25 * np.eye(3), X.T @ Y) @ x[b, i]), rel=1e-9, abs=1e-12
            )

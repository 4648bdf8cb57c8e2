"""P0-P3 on planted geometry, and layer-streamed state collection."""

import math

import pytest
import torch
from conftest import planted_paths

from taskgeom.analysis.measures.properties import alignment, interpolation, shrinkage, stability
from taskgeom.analysis.protocol import STUDY
from taskgeom.analysis.reading.states import collect, stream_layers
from taskgeom.hooks import capture
from taskgeom.models import SITES, Transformer
from taskgeom.settings.config import ModelConfig

K, V, D, T, REPEATS = 3, 4, 12, 16, 8  # REPEATS: a multiple of V, so tokens are balanced per task


def planted(seed: int = 0):
    """States h = mu_t + nu(x_t) + sum_k beta_k theta_k with beta on the simplex.

    Balanced design: each group of K sequences shares one Dirichlet path of beta, cyclically
    shifted so that sequence k of the group leans to task k; every task sees every token equally
    often at each position. At late positions beta is the task's one-hot vector, and mu_t is
    constant there.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = V * REPEATS
    theta, mu, beta, task, window = planted_paths(gen, groups, K, D, T)
    nu = torch.randn(V, D, generator=gen, dtype=torch.float64)
    group = torch.arange(groups).repeat_interleave(K)
    tokens = (group[:, None] + torch.arange(T)) % V  # [N, T]
    h = mu + nu[tokens] + beta @ theta
    return h, tokens, task, beta, theta, window


def test_planted_convex_combinations_give_r2_one_and_the_planted_coefficients():
    h, tokens, task, beta, theta, window = planted()
    geometry = stability(h, task, tokens, K, V, window)
    assert geometry.layout.within_share == pytest.approx(0.0, abs=1e-12)
    assert geometry.layout.cell_r2 == pytest.approx(1.0, abs=1e-12)
    assert geometry.layout.additive_share == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(geometry.subspace.theta.double(), theta, atol=1e-5)
    fit = interpolation(geometry.residual(h, tokens), geometry.subspace.theta, window, n_random=4)
    assert fit.r2_task == pytest.approx(1.0, abs=1e-6)
    assert fit.r2_exact == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(fit.r2_by_position, torch.ones(T, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(fit.beta.double(), beta, atol=1e-5)
    assert (fit.r2_random < 0.9).all()  # rotated vertices do not span the planted subspace
    tv, kl = alignment(fit.beta, beta)
    assert tv.max() < 1e-5


def _cells(states: torch.Tensor, task: torch.Tensor, tokens: torch.Tensor):
    """Independent two-way sums: (flat states [M, D], cell index [M], counts [K*V], cell means [K*V, D])."""
    flat, cell = states.reshape(-1, D), (task[:, None] * V + tokens).reshape(-1)
    counts = torch.bincount(cell, minlength=K * V).double()
    means = torch.zeros(K * V, D, dtype=torch.float64).index_add_(0, cell, flat) / counts[:, None]
    return flat, cell, counts, means


def test_planted_interaction_lowers_p1_by_its_share():
    """Late states c + theta_k + nu(a) + g(k, a), g double-centred over balanced cells: the
    additive share drops from 1 to exactly 1 - SS_g / SS_between."""
    h, tokens, task, _, _, window = planted(1)
    late_h, late_x = h[:, window], tokens[:, window]
    g = torch.randn(K, V, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = g - g.mean(0, keepdim=True) - g.mean(1, keepdim=True) + g.mean((0, 1), keepdim=True)
    states = late_h + g[task[:, None], late_x]
    clean = stability(late_h, task, late_x, K, V, slice(None)).layout.additive_share
    layout = stability(states, task, late_x, K, V, slice(None)).layout

    flat, _, counts, means = _cells(states, task, late_x)
    ss_between = (counts[:, None] * (means - flat.mean(0)) ** 2).sum()
    planted_share = float((counts.view(K, V, 1) * g**2).sum() / ss_between)
    assert clean == pytest.approx(1.0, abs=1e-12)
    assert planted_share > 0.05
    assert layout.additive_share == pytest.approx(clean - planted_share, abs=1e-10)
    assert layout.within_share == pytest.approx(0.0, abs=1e-12)


def test_planted_within_cell_noise_sets_the_p0_share():
    h, tokens, task, _, _, window = planted(2)
    late_h, late_x = h[:, window], tokens[:, window]
    noise = 0.5 * torch.randn(late_h.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    states = late_h + noise
    flat, cell, _, means = _cells(states, task, late_x)
    expected = float(((flat - means[cell]) ** 2).sum() / ((flat - flat.mean(0)) ** 2).sum())
    layout = stability(states, task, late_x, K, V, slice(None)).layout
    assert 0.01 < expected < 0.99
    assert layout.within_share == pytest.approx(expected, abs=1e-10)
    assert layout.cell_r2 == pytest.approx(1 - expected, abs=1e-10)


def test_alignment_closed_forms():
    beta = torch.tensor([[[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]])
    alpha = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    tv, kl = alignment(beta, alpha)
    assert tv[0, 0] == pytest.approx(0.5) and tv[0, 1] == pytest.approx(0.0, abs=1e-12)
    smooth = lambda b: (b + STUDY.kl_floor / 3) / (1 + STUDY.kl_floor)  # noqa: E731
    expected = 0.5 * math.log(0.5 / smooth(1.0)) + 0.5 * math.log(0.5 / smooth(0.0))
    assert kl[0, 0] == pytest.approx(expected, rel=1e-9)


def test_streamed_states_equal_one_full_forward():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=3, d_model=16, n_heads=2, d_mlp=32, max_len=20), 7).eval()
    tokens = torch.randint(0, 7, (10, 20))
    sites = [(layer, name) for layer in range(3) for name in SITES]
    with torch.no_grad(), capture(model, sites) as full:
        model(tokens)
    streamed = collect(model, tokens, sites, batch_size=3)
    for site in sites:
        assert torch.equal(streamed[site], full[site]), site
    layers = [
        layer for layer, _ in stream_layers(model, tokens, [(2, "resid_pre"), (0, "mlp_out")], positions=slice(4, 9))
    ]
    assert layers == [0, 2]
    part = collect(model, tokens, [(2, "resid_pre")], batch_size=4, positions=slice(4, 9))[(2, "resid_pre")]
    assert torch.equal(part, full[(2, "resid_pre")][:, 4:9])


def test_selection_and_measurement_sequences_are_held_out_and_independent(tmp_path):
    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run
    from taskgeom.settings.recipes import load_recipe
    from taskgeom.training.evaluate import eval_sets

    run = Run.create(load_recipe("e1", "quick", ["task.diversity=1", "train.eval_batch=16"]), tmp_path)
    study = StudyRun(run)
    select, measure = (study.heldout("major", 16, split=split).batch for split in ("select", "measure"))
    for batch in (select, measure):
        assert batch.task.lt(run.pool.n_major).all() and batch.tokens.shape == (16, run.config.task.seq_len)
        assert not torch.equal(batch.tokens, eval_sets(run)[0].batch.tokens)
    assert not torch.equal(select.tokens, measure.tokens)
    assert torch.equal(
        select.tokens, StudyRun(run).heldout("major", 16, split="select").batch.tokens
    )  # a pure function of the seed


def test_shrinkage_compares_quarters_of_the_uncertain_positions_or_is_not_applicable():
    N, T, K_ = 4, 20, 3
    alpha = torch.zeros(N, T, K_, dtype=torch.float64)
    alpha[..., 0] = 1.0
    tv = torch.rand(N, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    settled = shrinkage(tv, alpha)
    assert settled.reason is not None and "at 0 position(s) only" in settled.reason
    assert math.isnan(settled.tv_first) and math.isnan(settled.tv_last)

    uncertain = [2, 3, 5, 8, 9, 11, 12, 15]  # 8 positions: quarters of 2
    alpha[:, uncertain] = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    alpha[0, 15] = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)  # one certain sequence does not move the median
    result = shrinkage(tv, alpha)
    assert result.reason is None and result.positions == uncertain
    assert result.tv_first == pytest.approx(float(tv[:, [2, 3]].mean()))
    assert result.tv_last == pytest.approx(float(tv[:, [12, 15]].mean()))

    alpha[:, uncertain[4:]] = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    assert shrinkage(tv, alpha).reason is not None  # 4 < the protocol's min_uncertain_positions


# ---------------------------------------------------------------- the study's protocol: P0/P1 per position, P3 on mean beta


def test_p0_p1_per_position_equal_a_plain_loop_over_positions():
    """Per position, SS_within / SS_total over the (task, token) cells by a loop and the additive
    fit by numpy least squares on the observations; mu_t drifts over positions, which the
    per-position fit does not count as within-cell variance (the pooled one does)."""
    import numpy as np

    from taskgeom.analysis.measures.anova import two_way, two_way_by_position

    gen = torch.Generator().manual_seed(11)
    N, T_ = 60, 5
    task = torch.arange(N) % K
    tokens = torch.randint(0, V, (N, T_), generator=gen)
    theta, nu = (
        torch.randn(K, D, generator=gen, dtype=torch.float64),
        torch.randn(V, D, generator=gen, dtype=torch.float64),
    )
    interaction = torch.randn(K, V, D, generator=gen, dtype=torch.float64)
    drift = 3 * torch.randn(T_, D, generator=gen, dtype=torch.float64)
    h = (
        drift
        + theta[task][:, None]
        + nu[tokens]
        + 0.5 * interaction[task[:, None], tokens]
        + 0.3 * torch.randn(N, T_, D, generator=gen, dtype=torch.float64)
    )
    shares = two_way_by_position(h, task, tokens, K, V)
    k = task.numpy()
    for t in range(T_):
        x, a = h[:, t].numpy(), tokens[:, t].numpy()
        total = ((x - x.mean(0)) ** 2).sum()
        within = 0.0
        for cell in set(zip(k.tolist(), a.tolist())):
            members = x[(k == cell[0]) & (a == cell[1])]
            within += ((members - members.mean(0)) ** 2).sum()
        design = np.concatenate([np.ones((N, 1)), np.eye(K)[k], np.eye(V)[a]], axis=1)
        residual = x - design @ np.linalg.lstsq(design, x, rcond=None)[0]
        lost = (residual**2).sum() - within
        assert 0.01 < within / total < 0.99 and lost > 0.01 * total
        assert float(shares.within_share[t]) == pytest.approx(within / total, rel=1e-9), t
        assert float(shares.cell_r2[t]) == pytest.approx(1 - within / total, rel=1e-9), t
        assert float(shares.additive_share[t]) == pytest.approx(1 - lost / (total - within), rel=1e-9), t
    pooled = two_way(h.reshape(-1, D), task[:, None].expand(-1, T_).reshape(-1), tokens.reshape(-1), K, V)
    assert pooled.within_share > float(shares.within_share.max())  # the drift of mu_t counted as within-cell variance


def test_planted_geometry_holds_at_every_position_though_mu_drifts():
    from taskgeom.analysis.measures.anova import two_way_by_position

    h, tokens, task, _, _, window = planted()
    shares = two_way_by_position(h, task, tokens, K, V)
    late = slice(window.start, None)
    torch.testing.assert_close(
        shares.within_share[late], torch.zeros(T - window.start, dtype=torch.float64), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        shares.additive_share[late], torch.ones(T - window.start, dtype=torch.float64), atol=1e-12, rtol=0
    )


def _project_by_bisection(v):
    """The Euclidean projection of v (numpy [K]) onto the simplex: the threshold tau with
    sum max(v - tau, 0) = 1, found by bisection (independent of the sort-based solver)."""
    import numpy as np

    low, high = v.min() - 1, v.max()
    for _ in range(200):
        tau = (low + high) / 2
        low, high = (tau, high) if np.maximum(v - tau, 0).sum() > 1 else (low, tau)
    return np.maximum(v - (low + high) / 2, 0)


def test_p3_reads_the_mean_beta_of_each_task_against_its_mean_posterior():
    """Planted paths: raw sum-to-one coefficients (beta plus zero-sum noise, some negative) and a
    posterior alpha; by hand, each task's mean raw beta projected onto the simplex, its mean
    alpha, their TV per position, the mean over the tasks and the last quarter of positions."""
    import numpy as np

    from taskgeom.analysis.geometry import Alignment
    from taskgeom.analysis.measures.properties import project_simplex, shrinkage
    from taskgeom.analysis.measures.task_vectors import late_window

    gen = torch.Generator().manual_seed(4)
    _, _, beta, task, _ = planted_paths(gen, 6, K, D, T)
    noise = 0.4 * torch.randn(beta.shape, generator=gen, dtype=torch.float64)
    raw = beta + noise - noise.mean(-1, keepdim=True)
    assert (raw < 0).any()
    gamma = torch._standard_gamma(torch.ones(beta.shape, dtype=torch.float64), gen)
    alpha = 0.7 * beta + 0.3 * gamma / gamma.sum(-1, keepdim=True)
    window = late_window(T)
    p3 = Alignment.of(project_simplex(raw).float(), raw, alpha, task, window)

    r, al, k = raw.numpy(), alpha.numpy(), task.numpy()
    tv = np.zeros((K, T))
    for m in range(K):
        for t in range(T):
            mean_beta = _project_by_bisection(r[k == m, t].mean(0))
            tv[m, t] = 0.5 * np.abs(mean_beta - al[k == m, t].mean(0)).sum()
    np.testing.assert_allclose(p3.mean.tv.numpy(), tv, atol=1e-9)
    assert p3.tv_mean_beta == pytest.approx(tv[:, window].mean(), abs=1e-9)
    assert p3.tv_mean_beta < float(p3.tv[:, window].mean())  # averaging first removes the per-state noise
    expected = shrinkage(torch.tensor(tv), p3.mean.alpha)  # P3.shrinks on the mean curves
    assert (p3.shrinkage.positions, p3.shrinkage.tv_first, p3.shrinkage.tv_last) == (
        expected.positions,
        pytest.approx(expected.tv_first),
        pytest.approx(expected.tv_last),
    )


@pytest.mark.parametrize(
    "fractions, length, expected",
    [
        ((100 / 128, 120 / 128), 128, (100, 120)),
        ((54 / 64, 1.0), 64, (54, 64)),
        ((170 / 192, 190 / 192), 192, (170, 190)),
        ((100 / 128, 120 / 128), 64, (50, 60)),
        ((0.75, 1.0), 16, (12, 16)),
        ((0.99, 1.0), 8, (7, 8)),
    ],
)
def test_task_vector_windows_are_the_studys_fractions_of_the_context(fractions, length, expected):
    from taskgeom.analysis.measures.task_vectors import fraction_window
    from taskgeom.tasks import Dice, Markov, Regression

    assert (Dice.vector_window, Regression.vector_window, Markov.vector_window) == (
        (100 / 128, 120 / 128),
        (54 / 64, 1.0),
        (170 / 192, 190 / 192),
    )
    window = fraction_window(length, fractions)
    assert (window.start, window.stop) == expected
    with pytest.raises(ValueError, match="fractions"):
        fraction_window(length, (0.5, 0.5))

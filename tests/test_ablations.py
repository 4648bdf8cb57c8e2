"""The S and V ablations of docs/protocol.md against independent computations: the probe's S
against a least-squares fit by hand, the block mean against the per-block rows, the search's V
against the spans it must avoid, and the random control as the study's band, by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from taskgeom.analysis.measures.task_probe import ProbeData, fit_probe, fit_rows, probe_basis_with_mean
from taskgeom.analysis.measures.variants import protocol
from taskgeom.analysis.protocol import STUDY
from taskgeom.analysis.stored.ablations import (
    ablation_rows,
    block_places,
    control_statistic,
    find_blocks,
)
from taskgeom.analysis.stored.dual import loss_sets
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.dual_modes import ablation_claims
from taskgeom.claims.rules import over_seeds
from taskgeom.errors import AnalysisError
from taskgeom.rng import generator
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import build_config
from taskgeom.tasks import TaskProbe
from taskgeom.training.train import train


def projector(basis: np.ndarray) -> np.ndarray:
    q, _ = np.linalg.qr(basis)
    return q @ q.T


def planted(gen: torch.Generator, N: int, P: int, K: int, D: int, vocab: int | None, sums_to_one: bool = True):
    """(states, pi, current, logits): h = pi W + onehot(x) A + logits C + position effect + b + noise
    (E2: x A with continuous x), pi a posterior over K tasks (summing to one unless told otherwise)."""
    pi = torch._standard_gamma(torch.ones(N, P, K + (0 if sums_to_one else 1), dtype=torch.float64), gen)
    pi = (pi / pi.sum(-1, keepdim=True))[..., :K]
    current = (
        torch.randint(0, vocab, (N, P), generator=gen)
        if vocab
        else torch.randn(N, P, 2, generator=gen, dtype=torch.float64)
    )
    tokens = torch.nn.functional.one_hot(current, vocab).double() if vocab else current
    logits = torch.randn(N, P, 4, generator=gen, dtype=torch.float64)
    w, a, c, pos, b = (torch.randn(n, D, generator=gen, dtype=torch.float64) for n in (K, tokens.shape[-1], 4, P, 1))
    states = (
        pi @ w + tokens @ a + logits @ c + pos + b + 0.01 * torch.randn(N, P, D, generator=gen, dtype=torch.float64)
    )
    return states, pi, current, logits, w


def by_hand(states, pi, current, vocab, logits, rows, dropped: bool, positions: bool) -> np.ndarray:
    """W_task [K, D] of numpy's least-squares fit of the study's design, built here independently:
    pi (without its last column when it sums to one), the token one-hot without its last column
    (E2: x_t), the logits, the position one-hot without its last column, an intercept; a zero row
    for pi's dropped column."""
    N, P, K = pi[rows].shape
    flat = lambda x: x[rows].reshape(N * P, -1).numpy()  # noqa: E731
    parts = [flat(pi)[:, : K - 1] if dropped else flat(pi)]
    parts.append(np.eye(vocab)[current[rows].reshape(-1).numpy()][:, :-1] if vocab else flat(current))
    if logits is not None:
        parts.append(flat(logits))
    if positions:
        parts.append(np.tile(np.eye(P), (N, 1))[:, :-1])
    parts.append(np.ones((N * P, 1)))
    solution = np.linalg.lstsq(np.concatenate(parts, 1), flat(states), rcond=None)[0]
    weights = np.zeros((K, states.shape[-1]))
    weights[: K - 1 if dropped else K] = solution[: K - 1 if dropped else K]
    return weights


@pytest.mark.parametrize(
    "vocab, spec, sums_to_one",
    [
        (5, TaskProbe(window=(0.5, 1.0), logits=True, positions=True), True),  # E3's probe, k = -1
        (5, TaskProbe(window=(0.5, 1.0), logits=False, positions=True), False),  # E1's at k > -1 (pi short of one)
        (None, TaskProbe(window=(0.5, 1.0), logits=False, positions=False, centred=True), True),  # E2's, x_t, centred
    ],
)
def test_the_probe_s_is_the_row_space_of_a_least_squares_fit_by_hand(vocab, spec, sums_to_one):
    """S of the exact fit (the variant ``probe-exact``) is the row space of W_task of numpy's
    least-squares fit of the study's regressors with its dropped columns (principal cosines 1):
    rank K - 1 where pi sums to one, K where it does not. On this well-conditioned design the
    protocol's single-precision pseudo-inverse spans the same S."""
    gen = torch.Generator().manual_seed(0)
    N, P, K, D = 40, 6, 3, 12
    states, pi, current, logits, w = planted(gen, N, P, K, D, vocab, sums_to_one)
    rows = fit_rows(N, torch.Generator().manual_seed(1))
    data = ProbeData(states.float(), pi, current, logits, vocab)
    fit = fit_probe(data, spec, torch.Generator().manual_seed(1), solver="exact")
    single = fit_probe(data, spec, torch.Generator().manual_seed(1))
    np.testing.assert_allclose(
        single.basis.numpy() @ single.basis.numpy().T, fit.basis.numpy() @ fit.basis.numpy().T, atol=1e-3
    )

    weights = by_hand(
        states.float().double(), pi, current, vocab, logits if spec.logits else None, rows, sums_to_one, spec.positions
    )
    spanned = weights - weights.mean(0) if spec.centred else weights
    rank = K - 1 if sums_to_one else K
    assert len(rows) == int(0.8 * N) and fit.dropped == sums_to_one and fit.basis.shape == (D, rank)
    np.testing.assert_allclose(fit.weights.numpy(), weights, atol=1e-6)
    np.testing.assert_allclose(fit.basis.T.numpy() @ fit.basis.numpy(), np.eye(rank), atol=1e-10)
    span = np.linalg.svd(spanned.T, full_matrices=False)[0][:, :rank]
    np.testing.assert_allclose(
        np.linalg.svd(fit.basis.numpy().T @ span, compute_uv=False), np.ones(rank), atol=1e-8
    )  # principal cosines
    if sums_to_one and not spec.centred:  # the planted contrasts: each task's effect minus the last task's
        np.testing.assert_allclose(fit.weights[: K - 1].numpy(), (w[: K - 1] - w[K - 1]).numpy(), atol=0.05)


def ols_single_precision(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The study's ``_fit_ols`` written out in numpy: the pseudo-inverse of x (its intercept column
    last) in single precision, keeping singular values above eps32 * max(rows, columns) of the
    largest (torch's default), times y."""
    x, y = x.astype(np.float32), y.astype(np.float32)
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    keep = s > s.max() * np.finfo(np.float32).eps * max(x.shape)
    return (vt[keep].T / s[keep]) @ (u[:, keep].T @ y)


def test_the_probe_is_fitted_as_the_study_s_single_precision_pseudo_inverse():
    """Where the design has directions below the cut-off (large logits beside small posterior
    contrasts over 20,000 rows), the protocol's W_task is the single-precision pseudo-inverse's, by
    hand, and not the exact fit's: the cut-off is part of the protocol."""
    gen = torch.Generator().manual_seed(3)
    N, P, K, D, vocab = 500, 40, 3, 12, 5
    states, pi, current, logits, _ = planted(gen, N, P, K, D, vocab)
    pi = 0.5 + 0.002 * (pi - 1 / K)  # posterior contrasts a thousandth of the logits' scale: below eps32 x rows
    pi = pi / pi.sum(-1, keepdim=True)
    logits = 50 * logits
    spec = TaskProbe(window=(0.5, 1.0), logits=True, positions=False)
    data = ProbeData(states.float(), pi, current, logits, vocab)
    fit = fit_probe(data, spec, torch.Generator().manual_seed(1))
    exact = fit_probe(data, spec, torch.Generator().manual_seed(1), solver="exact")

    rows = fit_rows(N, torch.Generator().manual_seed(1)).numpy()
    flat = lambda x: x[rows].reshape(len(rows) * P, -1).numpy()  # noqa: E731
    design = np.concatenate(
        [
            flat(pi)[:, : K - 1],
            np.eye(vocab)[current[rows].reshape(-1).numpy()][:, :-1],
            flat(logits),
            np.ones((len(rows) * P, 1)),
        ],
        1,
    )
    by_hand = ols_single_precision(design, flat(states.float()))[: K - 1]
    np.testing.assert_allclose(fit.weights[: K - 1].numpy(), by_hand, rtol=1e-2, atol=1e-2 * np.abs(by_hand).max())
    assert not np.allclose(exact.weights[: K - 1].numpy(), by_hand, rtol=0.1, atol=0.1 * np.abs(by_hand).max())


def test_s_with_mean_is_the_minimum_norm_fit_with_every_posterior_column():
    """The variant: W_task of the minimum-norm least-squares fit of [pi, onehot(x), 1] over the
    window, every column kept, is rank K."""
    gen = torch.Generator().manual_seed(0)
    N, P, K, D, vocab = 40, 8, 3, 12, 5
    states, pi, current, _, _ = planted(gen, N, P, K, D, vocab)
    basis = probe_basis_with_mean(states.float(), pi, current, vocab, slice(4, 8))
    rows = lambda x: x[:, 4:8].reshape(-1, x.shape[-1]).numpy()  # noqa: E731
    design = np.concatenate([rows(pi), np.eye(vocab)[current[:, 4:8].reshape(-1).numpy()], np.ones((N * 4, 1))], 1)
    fitted = np.linalg.lstsq(design, rows(states.float().double()), rcond=None)[0][:K]
    assert basis.shape == (D, K)
    np.testing.assert_allclose(basis.numpy() @ basis.numpy().T, projector(fitted.T), atol=1e-6)


def test_a_probe_whose_task_weights_collapse_is_refused():
    N, P, K, D = 10, 4, 3, 6
    pi = torch.full((N, P, K), 1 / K, dtype=torch.float64)  # one posterior everywhere: no task effect to fit
    with pytest.raises(AnalysisError, match="span fewer than 3 directions"):
        probe_basis_with_mean(torch.randn(N, P, D), pi, torch.zeros(N, P, dtype=torch.long), 4, slice(0, 4))


def test_the_protocol_s_leaves_the_mean_state_out_where_the_minimum_norm_fit_holds_it(tmp_path_factory):
    """On a small trained E3 model (k = -1), the mean state's direction lies in the intercept of the
    study's probe: its S (rank K - 1) holds under 10% of it, where the rank-K minimum-norm fit
    (``s-with-mean``) holds most of it."""
    config = build_config(
        {
            "name": "small-markov",
            "task": {"family": "markov", "seq_len": 32},
            "model": {
                "n_layers": 2,
                "d_model": 32,
                "n_heads": 2,
                "d_mlp": 64,
                "max_len": 32,
                "final_norm": False,
                "activation": "silu",
            },
            "train": {
                "steps": 300,
                "batch_size": 32,
                "eval_every": 100,
                "checkpoint_every": 100,
                "eval_batch": 16,
                "lr": 3e-3,
                "threads": 1,
            },
        }
    )
    run = Run.create(config, tmp_path_factory.mktemp("markov-mean"))
    train(run)
    study = StudyRun(Run.open(run.path))
    geometry = study.geometry(study.heldout("major", 128, split="geometry"), (1, "resid_post"))
    mean = geometry.states.double().reshape(-1, 32).mean(0)
    mean = mean / mean.norm()
    held = lambda basis: float(((basis.T.double() @ mean) ** 2).sum())  # noqa: E731
    assert geometry.task_probe.dropped and geometry.probe.shape == (32, 2) and geometry.probe_with_mean.shape == (32, 3)
    assert held(geometry.probe) < 0.10 < 0.5 < held(geometry.probe_with_mean)


def tiny_run(tmp_path_factory, family: str) -> StudyRun:
    """A 2-block model trained for 40 steps on a pool with minors (seconds)."""
    config = build_config(
        {
            "name": f"tiny-{family}",
            "task": {"family": family, "seq_len": 16, "diversity": 2},
            "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 16},
            "train": {
                "steps": 40,
                "batch_size": 8,
                "eval_every": 20,
                "checkpoint_every": 20,
                "eval_batch": 16,
                "lr": 3e-3,
                "threads": 1,
            },
        }
    )
    run = Run.create(config, tmp_path_factory.mktemp(family))
    train(run)
    return StudyRun(Run.open(run.path))


@pytest.fixture(scope="module")
def dice(tmp_path_factory) -> StudyRun:
    return tiny_run(tmp_path_factory, "dice")


def test_the_probe_inputs_follow_the_active_protocol_s_probe_size(dice):
    """The probe's sequences are collected once per size the protocol asks, never a size another protocol asked."""
    from dataclasses import replace

    from taskgeom.analysis.protocol import measured_under

    for size in (64, 96, 64):
        with measured_under(replace(STUDY, probe_sequences=size)):
            assert sum(len(chunk) for chunk in dice.probe_inputs.chunks) == size


@pytest.fixture(scope="module")
def measured(dice):
    """(blocks, rows) of the ablations of the tiny dice run, with a short search."""
    geometries = list(dice.geometries(dice.heldout("major", 64, split="geometry"), block_places(dice)))
    blocks = find_blocks(dice, geometries, steps=5)
    sets = loss_sets(dice, 32)
    clean = {name: dice.loss(sequences, per_position=True) for name, sequences in sets.items()}
    return blocks, pd.DataFrame(ablation_rows(dice, blocks, sets, clean))


def test_the_search_keeps_v_outside_its_probes_span_and_searches_on_the_evaluation_ood_tasks(dice, measured):
    """The study's search: on the evaluation set's OOD tasks, V and the random controls outside the
    search probe's span (E1: no token directions); the earlier span is S alone (rank K - 1 = 3)."""
    blocks, _ = measured
    assert dice.search_set() == "eval-ood" and dice.search_set(protocol("v-searched-on-minors")) == "minor"
    assert dice.search_set(protocol("v-searched-on-ood")) == "ood"
    for block in blocks:
        assert block.place.site == "resid_mid" and block.geometry.probe.shape == (16, 3)
        span = block.geometry.search_probe.basis
        assert block.geometry.avoided.shape[1] == span.shape[1]
        for directions in (block.v, *block.controls):
            assert (directions.T.double() @ span).abs().max() < 1e-5
        assert block.geometry.avoid(protocol("v-avoids-major-span")).shape[1] == 3
        with_tokens = block.geometry.avoid(protocol("v-avoids-tokens"))
        assert with_tokens.shape[1] == span.shape[1] + block.geometry.token_directions.shape[1]


def test_each_blocks_v_search_is_stored_with_its_steps_and_the_starts_weight(measured):
    """The rows ``v_search.*`` of each block: the steps run (at most the 5 asked), the best step before
    them, the random start's weight in the kept average 0.995 ** (best step + 1) (the study's average),
    the rank V avoids (E1: the search probe's span) and the width it leaves, on the search's own set."""
    blocks, rows = measured
    search = rows[rows["batch"] == "search"]
    assert set(search["set"]) == {"eval-ood"} and len(search) == 5 * len(blocks)
    for block in blocks:
        found = search[search["layer"] == block.place.layer].set_index("metric")["value"]
        assert 1 <= found["v_search.steps"] <= 5 and 0 <= found["v_search.best_step"] < found["v_search.steps"]
        assert found["v_search.start_weight"] == pytest.approx(0.995 ** (found["v_search.best_step"] + 1), rel=1e-12)
        avoided = block.geometry.avoided.shape[1]
        assert (found["v_search.avoided_rank"], found["v_search.free_dims"]) == (avoided, block.v.shape[0] - avoided)


def test_the_eval_ood_search_draws_its_batches_from_the_evaluation_sets_ood_tasks(dice, monkeypatch):
    """The study's default target (``v_search_set="eval-ood"``): the search's every step draws its batch
    from the 30 tasks of the evaluation set's OOD sequences, exactly; batches differ between steps."""
    from taskgeom.analysis.reading.heldout import stream

    chosen = protocol()
    evaluated = dice.heldout("ood", 256, split="loss").batch.params
    tasks = torch.unique(evaluated, dim=0)
    assert dice.search_set(chosen) == "eval-ood" and len(tasks) == chosen.loss_ood_tasks
    assert torch.equal(
        torch.unique(dice.family.ood_task_params(chosen.loss_ood_tasks, dice.seed, 0, stream("loss", "ood")), dim=0),
        tasks,
    )
    drawn, sample_among = [], dice.family.sample_among

    def spy(params, *args):
        drawn.append(sample_among(params, *args))
        return drawn[-1]

    monkeypatch.setattr(dice.family, "sample_among", spy)
    geometry = next(iter(dice.geometries(dice.heldout("major", 64, split="geometry"), block_places(dice)[:1])))
    (search,) = dice.orthogonal_search([(geometry, 1)], steps=3, protocol=chosen)
    assert search.steps == 3 and len(drawn) == 3 and len({batch.tokens.sum().item() for batch in drawn}) > 1
    for batch in drawn:
        assert len(batch.task) == chosen.search_batch
        assert all(any(torch.equal(row, task) for task in tasks) for row in batch.params)


def test_the_gram_solution_is_the_pseudo_inverse_at_the_single_precision_cut():
    """``gram_solution`` from X^T X and X^T H equals numpy's pseudo-inverse of X in double precision,
    cut at eps32 * max(rows, columns) of the largest singular value: a direction of X 10 times above
    the cut is kept, one 10 times below is dropped."""
    from taskgeom.analysis.measures.task_probe import gram_solution

    rng = np.random.default_rng(0)
    m, n = 400, 9
    u, _ = np.linalg.qr(rng.standard_normal((m, n)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    cut = np.finfo(np.float32).eps * m
    s = np.array([3.0, 2.0, 1.5, 1.0, 0.5, 0.2, 0.1, 30 * cut, 0.3 * cut])  # the cut is relative to 3
    x, h = (u * s) @ v.T, rng.standard_normal((m, 5))
    solution = gram_solution(torch.tensor(x.T @ x), torch.tensor(x.T @ h), m).numpy()
    expected = np.linalg.pinv(x, rcond=cut) @ h
    np.testing.assert_allclose(solution, expected, rtol=1e-6, atol=1e-9)
    kept = np.linalg.pinv(x, rcond=cut / 100) @ h  # the smallest direction too: a different solution
    assert np.abs(kept - expected).max() > 1e3 * np.abs(solution - expected).max()


def test_e1_s_search_probe_is_the_study_s_coin_probe_over_every_pool_task_by_hand(dice):
    """The search probe of a tiny E1 run with minors (k = 2), by a plain implementation of the study's
    ``optimal_orth.py`` fit (``_fit_coin_probe`` without ``n_major``): the probe's 5,056 major sequences,
    the whole-sequence posterior over every pool task (its last column dropped: it sums to one), the
    token and position one-hots less their last columns, positions 100/128 of the context to its end,
    80% of a permutation of its own stream, the pseudo-inverse at the single-precision cut (in double
    precision, the "gram" solver's), the rank cut 1e-6 of W_task's singular values."""
    run, place = dice, (1, "resid_mid")
    geometry = run.geometry(run.heldout("major", 64, split="geometry"), place)
    family, pool, T = run.family, run.pool, run.config.task.seq_len
    n_tasks, V, n = pool.n_major + pool.n_minor, family.vocab_size, STUDY.probe_sequences
    assert pool.n_minor > 0
    tokens = family.sample(pool, n, T, run.seed, 0, "probe", "major").tokens
    captured = []
    handle = run.model.site(*place).register_forward_hook(lambda module, inputs, output: captured.append(output))
    with torch.no_grad():
        run.model(tokens)
    handle.remove()
    posterior = torch.cat([family.log_posterior(chunk, pool).exp()[:, -1] for chunk in tokens.split(500)]).numpy()
    first = round(100 / 128 * T)
    rows = torch.randperm(n, generator=generator(run.seed, 0, "search-probe-split"))[: int(0.8 * n)]
    design, targets = [], []
    for i in rows.tolist():
        for t in range(first, T):
            token, position = np.zeros(V - 1), np.zeros(T - first - 1)
            if tokens[i, t] < V - 1:
                token[tokens[i, t]] = 1
            if t - first < T - first - 1:
                position[t - first] = 1
            design.append(np.concatenate([posterior[i, :-1], token, position, [1.0]]))
            targets.append(captured[0][i, t].double().numpy())
    design = np.array(design)
    solution = np.linalg.pinv(design, rcond=np.finfo(np.float32).eps * max(design.shape)) @ np.array(targets)
    weights = np.concatenate([solution[: n_tasks - 1], np.zeros((1, solution.shape[1]))])
    _, s, vt = np.linalg.svd(weights, full_matrices=False)
    basis = vt[s > 1e-6 * s[0]].T
    fit = geometry.search_probe
    assert fit.dropped and fit.weights.shape[0] == n_tasks and fit.basis.shape == basis.shape
    np.testing.assert_allclose(fit.weights.numpy(), weights, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(fit.basis.numpy() @ fit.basis.numpy().T, basis @ basis.T, atol=1e-6)


def test_under_the_search_probe_v_and_the_controls_avoid_its_span(dice):
    """The study's span (``v_span="search-probe"``): V and the random controls lie outside the search
    probe's span, which is what the search avoids (E1: no token span) and exceeds S's rank at k > -1;
    E3's search probe fits positions 100-190 of 192."""
    from taskgeom.analysis.measures.task_vectors import fraction_window
    from taskgeom.tasks.markov import Markov

    chosen = protocol()
    geometries = list(dice.geometries(dice.heldout("major", 64, split="geometry"), block_places(dice)))
    for block in find_blocks(dice, geometries, steps=3, protocol=chosen):
        span = block.geometry.search_probe.basis
        assert block.geometry.avoid(chosen).shape[1] == span.shape[1] > block.geometry.probe.shape[1]
        for directions in (block.v, *block.controls):
            assert (directions.T.double() @ span).abs().max() < 1e-5
    assert fraction_window(192, Markov.search_probe.window) == slice(100, 191)


def test_e3_s_v_avoids_the_token_directions_too(tmp_path_factory):
    """E3's V avoids a probe's task span and its W_tok's 90% span: the search probe's (the study's) or,
    under ``v-avoids-major-span``, the ablations' probe's S (rank K - 1 = 3) and token directions."""
    run = tiny_run(tmp_path_factory, "markov")
    geometries = list(run.geometries(run.heldout("major", 64, split="geometry"), block_places(run)))
    for chosen in (protocol(), protocol("v-avoids-major-span")):
        for block in find_blocks(run, geometries, steps=3, protocol=chosen):
            g = block.geometry
            fit = g.search_probe if chosen.v_span == "search-probe" else g.task_probe
            task, tokens = fit.basis, g._token_span(fit)
            assert tokens.shape[1] >= 1 and g.avoid(chosen).shape[1] == task.shape[1] + tokens.shape[1]
            assert (block.v.T.double() @ task).abs().max() < 1e-5
            assert (block.v.T.double() @ tokens.double()).abs().max() < 1e-5
        assert chosen.v_span == "search-probe" or task.shape[1] == 3


def test_the_summary_is_the_mean_of_the_per_block_rows_and_the_control_their_largest(measured):
    blocks, rows = measured
    rows = rows[rows["batch"] == "loss"]  # the searches' rows are per block only
    assert set(rows["set"]) == {"major", "minor", "ood"}
    for (metric, set_name), group in rows.groupby(["metric", "set"]):
        per_block, summary = group[group["layer"].notna()], group[group["layer"].isna()]
        assert list(per_block["layer"]) == list(range(len(blocks))), metric
        if metric.startswith("gain_removed_random_draw"):
            assert summary.empty
            continue
        assert len(summary) == 1 and summary["site"].iloc[0] == "resid_mid"
        over_blocks = (
            per_block["value"].max() if metric == "gain_removed_random" else per_block["value"].mean()
        )  # the study's band: the largest
        np.testing.assert_allclose(summary["value"].iloc[0], over_blocks, rtol=1e-9, atol=1e-9, err_msg=metric)


def _ood_losses_by_hand(
    run: StudyRun, tokens: torch.Tensor, layer: int | None = None, directions: torch.Tensor | None = None
) -> np.ndarray:
    """[P] the cross-entropy of each prediction on the OOD tokens: [N, T], averaged over the
    sequences, with h <- h - h V V^T written at ``layer``'s resid_mid by a forward hook when given."""
    handle = None
    if layer is not None:
        v = directions.float()
        handle = run.model.site(layer, "resid_mid").register_forward_hook(lambda module, inputs, h: h - (h @ v) @ v.T)
    with torch.no_grad():
        logits = run.model(tokens).double()
    if handle is not None:
        handle.remove()
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return per_token.mean(0).numpy()


def test_the_random_control_is_the_study_s_band_by_hand(dice, measured):
    """The study's random band (``rand_acc``, ``trial_stats`` and ``_rand_q75_norm`` of its
    ``optimal_orth`` code) by a plain loop over the tiny dice run's blocks and draws: each random
    direction's signed change of the OOD cross-entropy averaged over every prediction, the first
    too; over the OOD gain L_0 - L (E1's L: every prediction, the study's coin code), times 100;
    the 75th percentile over the five draws (numpy's linear interpolation); the largest over blocks,
    which the claim reads."""
    blocks, rows = measured
    rows = rows.assign(diversity=2, step=np.nan)
    tokens = loss_sets(dice, 32)["ood"].batch.tokens
    clean = _ood_losses_by_hand(dice, tokens)
    gain = clean[0] - clean.mean()  # E1: L over every prediction, the first included
    ood = rows[rows["set"] == "ood"]
    assert ood[ood["metric"] == "gain_removed_ablate_S"]["gain"].iloc[0] == pytest.approx(gain, rel=1e-5)
    bands = []
    for layer, block in enumerate(blocks):
        shares = [
            100 * (_ood_losses_by_hand(dice, tokens, layer, d).mean() - clean.mean()) / gain for d in block.controls
        ]
        stored = [
            ood[(ood["metric"] == f"gain_removed_random_draw{i}") & (ood["layer"] == layer)]["value"].iloc[0]
            for i in range(STUDY.random_controls)
        ]
        np.testing.assert_allclose(stored, shares, rtol=1e-4, atol=1e-4)
        bands.append(float(np.percentile(shares, 75)))  # signed: the 4th smallest of 5
        at = ood[(ood["metric"] == "gain_removed_random") & (ood["layer"] == layer)]
        assert at["value"].iloc[0] == pytest.approx(bands[-1], rel=1e-4, abs=1e-4)
    control = {c.id: c for c in ablation_claims(rows, "e1", 2)}["e1.random_control"]
    assert control.value == pytest.approx(max(bands), rel=1e-4, abs=1e-4)
    assert control.parts["ood_block_max"] == control.value and "ood_block1" in control.parts
    assert control_statistic([1.0, None]) is None


def test_the_claims_read_the_block_mean_and_carry_each_block(measured):
    blocks, rows = measured
    rows = rows.assign(diversity=2, step=np.nan)
    claims = {c.id: c for c in ablation_claims(rows, "e1", 2)}
    for ablation, set_name in (("ablate_S", "major"), ("ablate_S", "ood"), ("ablate_V", "ood"), ("ablate_V", "major")):
        claim = claims[f"e1.{ablation}_{set_name}"]
        at = rows[(rows["metric"] == f"gain_removed_{ablation}") & (rows["set"] == set_name)]
        mean = at[at["layer"].isna()]["value"].iloc[0]
        assert claim.value == claim.parts["block_mean"] == mean
        assert [claim.parts[f"block{layer}"] for layer in range(len(blocks))] == list(at[at["layer"].notna()]["value"])


def test_a_block_with_no_room_for_v_gives_null_v_rows_with_the_reason_and_v_s_claims_are_not_applicable(
    dice, monkeypatch
):
    """Where the span V avoids fills the width at a block (here block 0, by a span of every
    direction), that block has no search and no control, its V and control rows are null with the
    reason, the summary over blocks is null with it, and V's claims and the control are n/a with it;
    S is measured at every block as before, and the other block keeps its search."""
    from taskgeom.analysis.geometry import Geometry

    real = Geometry.avoid
    monkeypatch.setattr(
        Geometry,
        "avoid",
        lambda self, protocol=None: torch.eye(16) if self.place.layer == 0 else real(self, protocol),
    )
    geometries = list(dice.geometries(dice.heldout("major", 64, split="geometry"), block_places(dice)))
    blocks = find_blocks(dice, geometries, steps=3)
    assert blocks[0].search is None and blocks[0].controls == () and "leaves 0 free directions" in blocks[0].no_room
    assert blocks[1].search is not None and len(blocks[1].controls) == STUDY.random_controls
    with pytest.raises(AnalysisError, match="no V at"):
        blocks[0].v
    sets = loss_sets(dice, 32)
    clean = {name: dice.loss(sequences, per_position=True) for name, sequences in sets.items()}
    rows = pd.DataFrame(ablation_rows(dice, blocks, sets, clean)).assign(diversity=2, step=np.nan)
    v_rows = rows[rows["metric"].isin(["gain_removed_ablate_V", "gain_removed_random"]) & (rows["batch"] == "loss")]
    for layer in (0.0, None):
        at = v_rows[v_rows["layer"].isna()] if layer is None else v_rows[v_rows["layer"] == layer]
        assert len(at) == 6 and at["value"].isna().all() and (at["reason"] == blocks[0].no_room).all()
    assert v_rows[v_rows["layer"] == 1.0]["value"].notna().all()
    s_rows = rows[rows["metric"] == "gain_removed_ablate_S"]
    assert len(s_rows) == 9 and s_rows["value"].notna().all()
    search = rows[rows["batch"] == "search"].set_index(["metric", "layer"])["value"]
    assert search[("v_search.free_dims", 0.0)] == 0 and pd.isna(search[("v_search.steps", 0.0)])
    claims = {c.id: c for c in ablation_claims(rows, "e1", 2)}
    for name in ("ablate_V_ood", "ablate_V_major", "random_control"):
        assert claims[f"e1.{name}"].status == "n/a" and claims[f"e1.{name}"].reason == blocks[0].no_room
    assert all(claims[f"e1.ablate_S_{name}"].reason != blocks[0].no_room for name in ("major", "ood"))


def test_a_claim_whose_only_applicable_seed_is_unreliable_is_not_applicable(measured):
    """A seed whose OOD gain is below MIN_RELIABLE_GAIN counts neither way: with another seed whose
    share is null the claim is n/a; beside a reliable seed the verdict is that seed's alone."""
    _, rows = measured
    rows = rows.assign(diversity=2, step=np.nan)
    ood = rows["set"] == "ood"
    unreliable = rows.assign(unreliable=rows["unreliable"].where(~ood, True), gain=rows["gain"].where(~ood, 0.01))
    null = rows.assign(
        value=rows["value"].where(~(ood & rows["metric"].str.startswith("gain_removed"))),
        reason=rows["reason"].where(~ood, "the in-context gain L_0 - L = -0.01 is not positive"),
    )
    reliable = rows.assign(unreliable=rows["unreliable"].where(~ood, False), gain=rows["gain"].where(~ood, 1.0))
    claim_of = lambda table: next(c for c in ablation_claims(table, "e1", 2) if c.id == "e1.ablate_V_ood")  # noqa: E731

    seed0 = claim_of(unreliable)
    assert seed0.status == "n/a" and "below 0.05 nats" in seed0.reason and "unreliable" in seed0.reason
    assert over_seeds([(0, seed0), (1, claim_of(null))])[0].status == "n/a"
    judged = over_seeds([(0, seed0), (1, claim_of(reliable))])[0]
    assert judged.status == claim_of(reliable).status != "n/a" and judged.value == claim_of(reliable).value
    assert [s["status"] for s in judged.seeds] == ["n/a", claim_of(reliable).status]


def test_control_statistic_by_hand():
    assert control_statistic([-4.0, 1.0, 2.0, -3.0, 0.5]) == pytest.approx(1.0)  # signed, sorted -4, -3, 0.5, 1, 2
    assert control_statistic([1.0, 2.0]) == pytest.approx(1.75)


def test_the_sensitivity_summary_judges_each_claim_over_the_runs():
    from taskgeom.experiments.sensitivity import summarise

    def line(run, variant, value, status):
        return {
            "run": run,
            "diversity": 8,
            "claim": "e1.ablate_V_ood",
            "variant": variant,
            "value": value,
            "status": status,
            "place": "mean over blocks",
        }

    rows = pd.DataFrame(
        [
            line("a", "protocol", 60.0, "pass"),
            line("b", "protocol", 40.0, "fail"),
            line("c", "protocol", 70.0, "pass"),
            line("a", "v-best-block", 80.0, "pass"),
            line("b", "v-best-block", float("nan"), "n/a"),
        ]
    )
    summary = summarise(rows).set_index("variant")
    assert summary.loc["protocol", ["median", "min", "max", "verdict", "runs"]].tolist() == [
        60.0,
        40.0,
        70.0,
        "unstable",
        3,
    ]
    assert summary.loc["v-best-block", ["median", "verdict", "runs"]].tolist() == [
        80.0,
        "pass",
        2,
    ]  # an n/a run counts neither way


def test_sensitivity_measures_the_protocol_again_as_the_claims_did(tiny_reproduction):
    """On a reproduction's runs at the highest k, with the thread count its sweep analysed them with
    (timings.json), the protocol's rows that ``sensitivity`` measures again are claims.json's values
    bit for bit, seed by seed."""
    import json
    import re

    from conftest import SMOKE

    from taskgeom.experiments.sensitivity import sensitivity

    claims = {
        c["id"]: {s["seed"]: s["value"] for s in c["seeds"]}
        for c in json.loads((tiny_reproduction / "claims.json").read_text())
    }
    stages = json.loads((tiny_reproduction / "timings.json").read_text())["stages"]
    threads = {m[1]: int(m[2]) for s in stages if (m := re.match(r"analyse (\S+) \((\d+) threads\)", s["stage"]))}
    runs = [
        Run.open(p) for p in sorted((tiny_reproduction / "runs").glob("e1-*")) if (p / "model.safetensors").exists()
    ]
    top = max(r.config.task.diversity for r in runs)
    compared = []
    for run in (r for r in runs if r.config.task.diversity == top):
        table = sensitivity([run.path], ("s-with-mean",), threads=threads[run.path.name], profile=SMOKE)
        for line in table[table["variant"] == "protocol"].itertuples():
            expected = claims[line.claim][run.config.train.seed]
            assert (line.value == expected) or (expected is None and np.isnan(line.value)), (
                line.claim,
                line.value,
                expected,
            )
            compared.append(line.claim)
    ablations = {
        f"e1.{name}" for name in ("ablate_S_major", "ablate_S_ood", "ablate_V_ood", "ablate_V_major", "random_control")
    }
    assert all(compared.count(claim) == 2 for claim in ablations)  # measured again on each of the two seeds


def test_the_protocol_probe_and_its_token_span_are_the_study_s_on_major_sequences_only_by_hand(tmp_path_factory):
    """The ablations' S of a tiny trained E3 model with minors in its pool (k = 2), by a plain
    implementation of the study's ``remove_task.py`` steps: 5,000 major sequences in batches of 64
    (79 batches, 5,056 sequences) only (no anchoring
    sequences), the states at the block's resid_mid by a forward hook, the pool's posterior
    restricted to the majors, the model's logits, the token and position one-hots less their last
    columns, positions 100/192 of the context to its end, 80% of a permutation, ``_fit_ols`` in
    single precision, and the rank cut 1e-6 of W_task's singular values."""
    run = tiny_run(tmp_path_factory, "markov")
    geometry = run.geometry(run.heldout("major", 64, split="geometry"), (1, "resid_mid"))
    family, pool, T = run.family, run.pool, run.config.task.seq_len
    K, V = pool.n_major, family.vocab_size
    assert pool.n_minor > 0
    n = 79 * 64
    tokens = family.sample(pool, n, T, run.seed, 0, "probe", "major").tokens
    captured = []
    handle = run.model.site(1, "resid_mid").register_forward_hook(
        lambda module, inputs, output: captured.append(output.detach())
    )
    with torch.no_grad():
        logits = run.model(tokens)
    handle.remove()
    posterior = torch.cat([family.log_posterior(chunk, pool).exp()[..., :K] for chunk in tokens.split(500)])
    first = round(100 / 192 * T)
    rows = torch.randperm(n, generator=generator(run.seed, 0, "probe-split"))[: int(0.8 * n)]
    design, targets = [], []
    for i in rows.tolist():
        for t in range(first, T):
            pi = posterior[i, t].numpy()
            token = np.zeros(V - 1)
            if tokens[i, t] < V - 1:
                token[tokens[i, t]] = 1
            position = np.zeros(T - first - 1)
            if t - first < T - first - 1:
                position[t - first] = 1
            design.append(np.concatenate([pi, token, logits[i, t].numpy(), position, [1.0]]))
            targets.append(captured[0][i, t].numpy())
    design = np.array(design)
    assert np.abs(design[:, :K].sum(1) - 1).max() > 1e-4  # minors hold posterior mass: pi keeps all K columns
    solution = ols_single_precision(design, np.array(targets)).astype(np.float64)
    _, s, vt = np.linalg.svd(solution[:K], full_matrices=False)
    basis = vt[s > 1e-6 * s[0]].T
    assert geometry.probe.shape == basis.shape
    np.testing.assert_allclose(geometry.probe.numpy() @ geometry.probe.numpy().T, basis @ basis.T, atol=1e-3)
    # the token span V avoids, as the study's svd_basis(W_tok, 0.9): W_tok's rows (a zero row for the last
    # token), uncentred, the fewest right singular directions whose squared singular values reach 90%
    w_tok = np.concatenate([solution[K : K + V - 1], np.zeros((1, solution.shape[1]))])
    _, s, vt = np.linalg.svd(w_tok, full_matrices=False)
    s = s[s > 1e-6 * s[0]]
    energy = np.cumsum(s**2)
    tokens = vt[: int((energy < 0.9 * energy[-1]).sum()) + 1].T
    assert geometry.token_directions.shape == tokens.shape
    np.testing.assert_allclose(
        geometry.token_directions.double().numpy() @ geometry.token_directions.double().numpy().T,
        tokens @ tokens.T,
        atol=2e-3,
    )


def test_the_transition_reads_the_training_mixture(dice):
    """The predictor transition's sequences are the study's ``mode="train"`` draw: tasks by the
    pool's prior, so the minors' share is p_minor (0.1; 1,024 sequences: a standard error of 0.009),
    and the same arguments give the same sequences."""
    mixture = dice.heldout("mixture", STUDY.transition_sequences, split="transition").batch
    minor_share = float((mixture.task >= dice.pool.n_major).double().mean())
    assert dice.config.task.p_minor == 0.1 and 0.07 < minor_share < 0.13
    assert torch.equal(
        mixture.tokens, dice.heldout("mixture", STUDY.transition_sequences, split="transition").batch.tokens
    )

"""P2 as the study's figure plots it (docs/protocol.md, "P2"): r2_additive of a tiny trained model
against a plain implementation of its steps given the fitted vectors (loops over positions, the
sum-to-one fit by its Lagrangian, the simplex projection by sorting), E3's states read after the
next block's LayerNorm, the claim's window and the variant p2-task-only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taskgeom.analysis.measures.variants import protocol as variant_protocol
from taskgeom.analysis.study import StudyRun
from taskgeom.hooks import Place, capture
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import build_config
from taskgeom.training.train import train


def project_to_simplex(v: np.ndarray) -> np.ndarray:
    """The Euclidean projection of v: [K] onto the simplex, by sorting (Held, Wolfe and Crowder)."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u)
    rho = max(j for j in range(len(u)) if u[j] + (1 - cumulative[j]) / (j + 1) > 0)
    return np.maximum(v + (1 - cumulative[rho]) / (rho + 1), 0)


def sum_to_one_fit(y: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """argmin |y - beta theta|^2 subject to sum beta = 1, from the Lagrangian's linear system."""
    K = theta.shape[0]
    system = np.block([[2 * theta @ theta.T, np.ones((K, 1))], [np.ones((1, K)), np.zeros((1, 1))]])
    return np.linalg.solve(system, np.concatenate([2 * theta @ y, [1.0]]))[:K]


@pytest.fixture(scope="module")
def markov(tmp_path_factory) -> StudyRun:
    config = build_config(
        {
            "name": "tiny-p2",
            "task": {"family": "markov", "seq_len": 32, "vocab_size": 4},
            "model": {"n_layers": 4, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 32, "final_norm": False},
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
    run = Run.create(config, tmp_path_factory.mktemp("p2"))
    train(run)
    return StudyRun(Run.open(run.path))


def test_e3_r2_additive_is_the_study_s_steps_by_hand_after_the_next_layernorm(markov):
    place = Place(1, "resid_post")
    major = markov.heldout("major", 96, split="measure")
    additive = markov.geometry(major, place).p2_additive
    assert additive.post_layernorm
    with torch.no_grad(), capture(markov.model, [place]) as store:
        markov.model(major.batch.tokens)
        h = (
            markov.model.blocks[2].ln_attn(store[tuple(place)]).double()
        )  # the next block's LayerNorm (post_layernorm=True)
    normed = markov.geometry(major, place)  # the vectors fitted on the normalised states, as the package fits them
    fitted = type(normed)(markov, place, major, h.float(), normed.window, 0)
    theta, nu, mu = fitted.task_vectors.numpy(), fitted.token_effects.numpy(), fitted.mu.numpy()
    tokens, states = major.batch.tokens.numpy(), h.numpy()
    T = states.shape[1]
    by_hand = []
    for p in range(T):
        residual = total = 0.0
        mean_p = states[:, p].mean(0)
        for n in range(states.shape[0]):
            y = states[n, p] - mu[p] - nu[tokens[n, p]]  # h' = h - nu(a) - mean_p: the token effect counts as explained
            beta = project_to_simplex(sum_to_one_fit(y, theta))
            residual += ((y - beta @ theta) ** 2).sum()
            total += ((states[n, p] - mean_p) ** 2).sum()
        by_hand.append(1 - residual / total)
    np.testing.assert_allclose(additive.by_position.numpy(), by_hand, rtol=1e-6, atol=1e-9)
    window = range(
        round(T * 180 / 192), round(T * 190 / 192)
    )  # the last ten of the study's evaluation positions 0-189, as fractions
    assert (additive.positions.start, additive.positions.stop) == (window.start, window.stop) == (30, 32)
    assert additive.value == pytest.approx(np.mean([by_hand[p] for p in window]), rel=1e-9)
    plain = markov.geometry(
        major, Place(3, "resid_post")
    ).p2_additive  # the last block: no LayerNorm follows (final_norm False)
    assert not plain.post_layernorm


def test_p2_reads_r2_additive_and_the_variant_reads_r2_task(markov):
    from taskgeom.analysis.stored.m1 import place_rows, trajectory_rows
    from taskgeom.claims.m1 import claim_values

    major = markov.heldout("major", 64, split="measure")
    geometry = markov.geometry(major, Place(1, "resid_post"))
    rows = place_rows(geometry, per_position=False)
    rows += [{**rows[0], "metric": label, "value": 1.0} for label in ("place.m1", "place.p3")]
    rows += [
        {**rows[0], "metric": m, "value": 0.5}
        for m in (
            "p3.tv_mean_beta",
            "p3.tv_last_quarter",
            "p3.tv_first_uncertain",
            "p3.tv_last_uncertain",
            "p3.uncertain_positions",
        )
    ]
    rows += trajectory_rows(markov.trajectories([Place(1, "resid_post")], per_task=8))
    protocol, earlier = claim_values(rows), claim_values(rows, variant_protocol("p2-task-only"))
    assert protocol["P2"].value == pytest.approx(geometry.p2_additive.value, rel=1e-12)
    random = float(geometry.p2_additive.random.mean())  # P2.vs_random: the partial R^2 beyond it
    assert protocol["P2.vs_random"].value == pytest.approx(
        (geometry.p2_additive.value - random) / (1 - random), rel=1e-9
    )
    assert (
        earlier["P2"].value == pytest.approx(geometry.p2.r2_task, rel=1e-12)
        and protocol["P2"].parts["r2_task"] == earlier["P2"].value
    )
    assert protocol["P2"].value != pytest.approx(earlier["P2"].value, rel=1e-3)  # the two quantities differ


def test_e2_r2_additive_fits_the_task_simplex_first_then_x_by_hand(tmp_path_factory):
    """E2's r2_additive as the study's ``task_subspace_r2_at_position``: at each analysed position
    the task simplex fitted to h - mu_t as it is (x_t's effect left in; the sum-to-one fit, then the
    projection), then one linear map of x_t, no intercept, fitted by least squares to what the
    simplex leaves; R^2 against the scatter of h - mu_t about its mean. Plain loops and numpy."""
    config = build_config(
        {
            "name": "tiny-p2-e2",
            "task": {"family": "regression", "d": 2, "n_examples": 8},
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
    run = Run.create(config, tmp_path_factory.mktemp("p2-e2"))
    train(run)
    study = StudyRun(Run.open(run.path))
    place = Place(1, "resid_post")
    major = study.heldout("major", 96, split="measure")
    geometry = study.geometry(major, place)
    additive = geometry.p2_additive
    states = geometry.states.double().numpy()  # [N, P, D] at the analysed positions (the x tokens)
    theta, mu, x = (
        geometry.task_vectors.double().numpy(),
        geometry.mu.double().numpy(),
        major.inputs.current.double().numpy(),
    )
    by_hand = []
    for p in range(states.shape[1]):
        centred = states[:, p] - mu[p]
        left = np.stack([y - project_to_simplex(sum_to_one_fit(y, theta)) @ theta for y in centred])
        weights = np.linalg.lstsq(x[:, p], left, rcond=None)[0]
        by_hand.append(1 - ((left - x[:, p] @ weights) ** 2).sum() / ((centred - centred.mean(0)) ** 2).sum())
    np.testing.assert_allclose(additive.by_position.numpy(), by_hand, rtol=1e-6, atol=1e-8)
    assert additive.value == pytest.approx(
        np.mean([by_hand[p] for p in range(additive.positions.start, additive.positions.stop)]), rel=1e-9
    )

"""P3 as the study's trajectory figure computes it (docs/protocol.md, "P3"): the package's value on a
tiny trained model against a plain implementation of ``traj_averaging_projection_plot``'s steps
(task means by loops over sequences and positions 40-59, the per-position mean over the majors,
the sum-to-one fit by its Lagrangian, the mean over task 0's sequences projected by sorting), and
the claim reading it under the protocol and the earlier reading under p3-late-window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import two_block_run
from test_p2_additive import project_to_simplex, sum_to_one_fit

from taskgeom.analysis.measures.variants import protocol as variant_protocol
from taskgeom.analysis.study import StudyRun
from taskgeom.hooks import Place, capture

PER_TASK = 40


@pytest.fixture(scope="module")
def dice(tmp_path_factory) -> StudyRun:
    return two_block_run(tmp_path_factory.mktemp("dice"), "dice", 64)


def trajectory_by_hand(run: StudyRun, place: Place) -> tuple[float, np.ndarray]:
    """(the mean TV over plotted positions 45-59, [60] the TV at each of 0-59) of task 0."""
    sequences = run.heldout_tasks("major", PER_TASK, split="trajectory")
    with torch.no_grad(), capture(run.model, [place]) as store:
        run.model(sequences.batch.tokens)
        h = store[tuple(place)].double().numpy()
    task, alpha, K = sequences.batch.task.numpy(), sequences.alpha.double().numpy(), run.pool.n_major
    means = np.zeros((K, h.shape[2]))
    for k in range(K):
        parts = [h[n, t] for n in range(len(task)) if task[n] == k for t in range(40, 60)]
        means[k] = np.mean(parts, 0)
    theta = means - means.mean(0)  # estimate_task_vectors_by_averaging: centred task means, tokens kept
    tv = np.zeros(60)
    for t in range(60):
        mu_t = np.mean([h[task == k, t].mean(0) for k in range(K)], 0)  # the mean over the majors at t
        betas = [sum_to_one_fit(h[n, t] - mu_t, theta) for n in range(len(task)) if task[n] == 0]
        beta = project_to_simplex(np.mean(betas, 0))
        tv[t] = 0.5 * np.abs(beta - alpha[task == 0, t].mean(0)).sum()
    return float(tv[45:60].mean()), tv


def test_p3_is_the_study_s_trajectory_by_hand(dice):
    places = [Place(0, "resid_post"), Place(1, "resid_post")]
    measured = dice.trajectories(places, per_task=PER_TASK)
    for place in places:
        value, curve = trajectory_by_hand(dice, place)
        found = measured[place]
        assert (found.positions, found.estimation, found.tasks) == (tuple(range(60)), tuple(range(40, 60)), (0,))
        np.testing.assert_allclose(found.tv[0].numpy(), curve, rtol=1e-7, atol=1e-10)
        assert found.value == pytest.approx(value, rel=1e-9)


def test_a_short_context_takes_the_same_fractions():
    from taskgeom.analysis.protocol import STUDY
    from taskgeom.analysis.reading.trajectory import study_positions

    assert study_positions(STUDY.trajectory_estimation, 64) == tuple(range(40, 60))
    assert study_positions(STUDY.trajectory_plotted, 16) == tuple(range(16))
    assert study_positions(STUDY.trajectory_estimation, 16) == tuple(range(10, 16))  # E2 at 16 examples


def test_the_claim_reads_the_trajectory_and_the_variant_the_late_window(dice):
    from taskgeom.analysis.stored.m1 import analyze
    from taskgeom.claims.m1 import claim_values

    result = analyze(dice, n_sequences=48, n_random=0, per_cell=8)
    trajectory = dice.trajectories([result.p3_place])[result.p3_place]
    protocol, earlier = claim_values(result.rows), claim_values(result.rows, variant_protocol("p3-late-window"))
    assert protocol["P3"].value == trajectory.value
    assert (protocol["P3"].parts["first"], protocol["P3"].parts["last"], protocol["P3"].parts["estimation_first"]) == (
        0,
        59,
        40,
    )
    assert (
        earlier["P3"].value
        == protocol["P3"].parts["late_window_all_tasks"]
        == result.summary["p3.tv_mean_beta"]
        != trajectory.value
    )

"""P0 and P1 on the study's forced-token cells (docs/protocol.md, "P0, P1 on forced-token cells"):
the package's values on a tiny trained model against a plain implementation of the steps of the
study's ``compute_hiddens_token_conditioned_coin`` and its two-way layout (loops over cells, the
whole sequence run through the model with a hook, the balanced layout's closed form), and the
claims reading them under the protocol and the natural cells under the variant natural-cells."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import two_block_run
from test_p2_additive import project_to_simplex, sum_to_one_fit

from taskgeom.analysis.measures.variants import protocol as variant_protocol
from taskgeom.analysis.study import StudyRun
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, capture
from taskgeom.rng import generator

PER_CELL = 24


@pytest.fixture(scope="module")
def markov(tmp_path_factory) -> StudyRun:
    return two_block_run(tmp_path_factory.mktemp("markov"), "markov", 16)


def values_by_hand(run: StudyRun, position: int, stream: str = "m1-cells") -> list[int]:
    """Steps 1-2: the token values seen at ``position`` over PER_CELL natural sequences of every task."""
    family, majors, K = run.family, run.pool.subset("major"), run.pool.n_major
    task = torch.arange(K).repeat_interleave(PER_CELL)
    natural = family.make_batch(
        majors.params[task], task, position + 1, generator(run.seed, position, f"{stream}/tokens")
    ).tokens
    return sorted(set(natural[:, position].tolist()))


def cells_by_hand(run: StudyRun, place: Place, position: int, values: list[int], stream: str = "m1-cells") -> dict:
    """Steps 3-4: {(task k, value a): [N, D]} fresh sequences of task k, the token at ``position``
    overwritten by a, the whole sequence run with a hook, the state read there."""
    family, majors, K = run.family, run.pool.subset("major"), run.pool.n_major
    task = torch.arange(K).repeat_interleave(PER_CELL)
    cells = {}
    for a in values:
        batch = family.make_batch(
            majors.params[task], task, position + 1, generator(run.seed, position, f"{stream}/token-{a}")
        ).tokens
        for k in range(K):
            tokens = batch[task == k].clone()
            tokens[:, position] = a
            with torch.no_grad(), capture(run.model, [place]) as store:
                run.model(tokens)
                cells[(k, a)] = store[tuple(place)][:, position].double().numpy()
    return cells


def shares_by_hand(run: StudyRun, place: Place, position: int) -> tuple[float, float, int]:
    """(P0, P1, token values) at ``position``: the study's steps, one cell at a time."""
    K, values = run.pool.n_major, values_by_hand(run, position)
    cells = cells_by_hand(run, place, position, values)
    states = np.concatenate(list(cells.values()))
    grand = states.mean(0)
    total = ((states - grand) ** 2).sum()
    means = {cell: h.mean(0) for cell, h in cells.items()}
    within = sum(((h - means[cell]) ** 2).sum() for cell, h in cells.items())
    task_mean = {
        k: np.mean([means[(k, a)] for a in values], 0) for k in range(K)
    }  # balanced cells: the additive fit in closed form
    token_mean = {a: np.mean([means[(k, a)] for k in range(K)], 0) for a in values}
    interaction = sum(
        PER_CELL * ((means[(k, a)] - task_mean[k] - token_mean[a] + grand) ** 2).sum() for (k, a) in cells
    )
    return 1 - within / total, 1 - interaction / (total - within), len(values)


def test_p0_and_p1_are_the_study_s_forced_cells_by_hand(markov):
    places = markov.places()
    position = markov.config.task.seq_len - 2  # the last position the study reads
    cells = markov.forced_cells(places, per_cell=PER_CELL)
    assert cells.position == position
    for place in places:
        p0, p1, n_values = shares_by_hand(markov, place, position)
        layout = cells.layout(place)
        assert cells.states[place].shape == (n_values, markov.pool.n_major, PER_CELL, 16)
        assert layout.cell_r2 == pytest.approx(p0, rel=1e-9)
        assert layout.additive_share == pytest.approx(p1, rel=1e-9)


def p2_by_hand(run: StudyRun, place: Place, estimation: range, window: range, norm) -> float:
    """P2 as the study's plot_averaging_r2_coin computes it on its cells: theta and nu from the cell
    means at the estimation positions (each position's means less their mean, averaged over the
    positions), then at each window position r2_additive of h - nu(a) - mu_p against the simplex fit on
    theta; the mean over the window."""
    values = sorted(set().union(*(values_by_hand(run, p, "m1-cells-p2") for p in [*estimation, *window])))
    K = run.pool.n_major
    cells = {
        p: {cell: norm(h) for cell, h in cells_by_hand(run, place, p, values, "m1-cells-p2").items()}
        for p in {*estimation, *window}
    }
    pooled = {}
    for p in estimation:
        means = {cell: h.mean(0) for cell, h in cells[p].items()}
        mu_p = np.mean(list(means.values()), 0)
        for cell, m in means.items():
            pooled[cell] = pooled.get(cell, 0) + (m - mu_p) / len(estimation)
    grand = np.mean(list(pooled.values()), 0)
    theta = np.stack([np.mean([pooled[(k, a)] for a in values], 0) - grand for k in range(K)])
    nu = {a: np.mean([pooled[(k, a)] for k in range(K)], 0) - grand for a in values}
    scores = []
    for p in window:
        mu = np.concatenate(list(cells[p].values())).mean(0)
        residual = total = 0.0
        for (k, a), h in cells[p].items():
            for state in h:
                y = state - nu[a] - mu
                beta = project_to_simplex(sum_to_one_fit(y, theta))
                residual += ((y - beta @ theta) ** 2).sum()
                total += ((state - mu) ** 2).sum()
        scores.append(1 - residual / total)
    return float(np.mean(scores))


def test_p2_is_the_study_s_averaging_r2_on_its_cells_by_hand(markov):
    from taskgeom.analysis.measures.task_vectors import fraction_window

    T, family = markov.config.task.seq_len, markov.family
    estimation, window = (
        range(w.start, w.stop) for w in (fraction_window(T, family.vector_window), fraction_window(T, family.p2_window))
    )
    places = [Place(0, "resid_post"), Place(1, "resid_post")]
    measured = markov.cell_p2(places, per_cell=PER_CELL, n_random=0)
    norm = markov.model.blocks[1].ln_attn  # E3's P2 reads block 0's output after the next block's LayerNorm

    def after_norm(h):
        with torch.no_grad():
            return norm(torch.from_numpy(h).float()).double().numpy()

    assert measured[places[0]].post_layernorm and not measured[places[1]].post_layernorm
    for place, normalise in zip(places, (after_norm, lambda h: h)):
        assert measured[place].value == pytest.approx(
            p2_by_hand(markov, place, estimation, window, normalise), rel=1e-6
        )


def test_forcing_the_token_moves_the_states(markov):
    """The cells differ from the same prefixes with their natural token: the overwrite is in force."""
    place, position = Place(1, "resid_post"), 5
    cells = markov.forced_cells([place], position=position, per_cell=PER_CELL)
    a = int(cells.tokens[0])
    family, majors, K = markov.family, markov.pool.subset("major"), markov.pool.n_major
    task = torch.arange(K).repeat_interleave(PER_CELL)
    tokens = family.make_batch(
        majors.params[task], task, position + 1, generator(markov.seed, position, f"m1-cells/token-{a}")
    ).tokens
    with torch.no_grad(), capture(markov.model, [place]) as store:
        markov.model(tokens)
        natural = store[tuple(place)][:, position].reshape(K, PER_CELL, -1)
    forced = cells.states[place][0]
    changed = tokens[:, position] != a
    assert changed.any()
    assert not torch.allclose(forced.reshape(K * PER_CELL, -1)[changed], natural.reshape(K * PER_CELL, -1)[changed])
    assert torch.equal(forced.reshape(K * PER_CELL, -1)[~changed], natural.reshape(K * PER_CELL, -1)[~changed])


def test_the_claims_read_the_forced_cells_and_the_variant_the_natural_ones(markov):
    from taskgeom.analysis.stored.m1 import cell_rows, place_rows, trajectory_rows
    from taskgeom.claims.m1 import claim_values

    place = Place(1, "resid_post")
    major = markov.heldout("major", 64, split="measure")
    geometry = markov.geometry(major, place)
    cells = markov.forced_cells([place], per_cell=PER_CELL)
    marks = [
        {
            "metric": label,
            "value": 1.0,
            "layer": 1,
            "site": "resid_post",
            "batch": "measure",
            "position": None,
            "task": None,
        }
        for label in ("place.m1", "place.p3")
    ]
    p3 = [
        {
            "metric": m,
            "value": 0.5,
            "layer": 1,
            "site": "resid_post",
            "batch": "measure",
            "position": None,
            "task": None,
        }
        for m in (
            "p3.uncertain_positions",
            "p3.tv_first_uncertain",
            "p3.tv_last_uncertain",
            "p3.tv_mean_beta",
            "p3.tv_last_quarter",
        )
    ]
    natural_rows = (
        place_rows(geometry, per_position=False)
        + marks
        + p3
        + trajectory_rows(markov.trajectories([place], per_task=8))
    )
    p2 = markov.cell_p2([place], per_cell=PER_CELL)
    rows = natural_rows + cell_rows(cells, p2)
    layout = cells.layout(place)
    protocol = claim_values(rows)
    assert protocol["P0"].value == layout.cell_r2 and protocol["P1"].value == layout.additive_share
    assert protocol["P2"].value == p2[place].value and protocol["P2"].parts["cells"] == "forced"
    random = float(p2[place].random.mean())  # P2.vs_random, the partial R^2 beyond the random subspace
    assert protocol["P2.vs_random"].value == pytest.approx((p2[place].value - random) / (1 - random))
    assert protocol["P0"].parts["position"] == 14 and protocol["P0"].parts["per_cell"] == PER_CELL
    assert protocol["P0"].parts["natural_late_median"] == geometry.p0
    natural = claim_values(rows, variant_protocol("natural-cells"))
    assert natural["P0"].value == geometry.p0 and natural["P1"].value == geometry.p1
    assert natural["P2"].value == geometry.p2_additive.value
    assert claim_values(natural_rows)["P0"].value == geometry.p0  # no cells (E2): its layout on natural states


def test_bad_cells_are_refused(markov):
    with pytest.raises(AnalysisError, match="position 16 is not in the context"):
        markov.forced_cells(markov.places(), position=16)
    with pytest.raises(AnalysisError, match="per_cell"):
        from taskgeom.analysis.stored.m1 import check_request

        check_request(markov, per_cell=1)

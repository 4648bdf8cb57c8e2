"""Causal steering (docs/protocol.md) against computations by hand: KL of one law to another,
the per-position task vectors, steered positions against a plain forward hook (one position per
pass), the readout at a vertex of the simplex, E2's RMSE, the positions' clipping, the stored rows
and the claim."""

from __future__ import annotations

import math

import pytest
import torch

from taskgeom.analysis.measures.variants import protocol
from taskgeom.analysis.protocol import STUDY
from taskgeom.analysis.reading.steering import (
    KINDS,
    Steering,
    TokenReadout,
    clip_positions,
    kl_rows,
    position_task_vectors,
    random_edit,
    steering_place,
)
from taskgeom.analysis.stored.m1 import steering_rows
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.m1 import steering_claim
from taskgeom.errors import AnalysisError
from taskgeom.hooks import Place, capture
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import build_config
from taskgeom.tasks import make

N = 24  # held-out sequences: 8 per major task

READ_PLACE = protocol("steer-at-read-site")  # the earlier construction


def kl_by_hand(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def study_run(tmp_path, family: str, **task) -> StudyRun:
    """An untrained 4-block model on a fresh run of ``family`` (its weights scaled up so that
    edits move its outputs visibly); the steering place, block 2, has blocks after it, so an edit
    at one position reaches the later ones."""
    length = {"seq_len": 32} if family != "regression" else {}
    raw = {
        "name": f"steer-{family}",
        "task": {"family": family, **length, **task},
        "model": {"n_layers": 4, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 32},
        "train": {"steps": 1, "threads": 1},
    }
    run = Run.create(build_config(raw), tmp_path)
    model = run.new_model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20.0)
    return StudyRun(run, model)


def hooked_outputs(run: StudyRun, place: Place, tokens: torch.Tensor, position: int, change) -> torch.Tensor:
    """The whole model's outputs with a plain forward hook at ``place`` that replaces the state
    at model ``position`` by change(state [B, D])."""

    def hook(_module, _inputs, output):
        output = output.clone()
        output[:, position] = change(output[:, position])
        return output

    handle = run.model.site(*place).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return run.model(tokens)
    finally:
        handle.remove()


def states_by_hand(run: StudyRun, place: Place, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), capture(run.model, [place]) as store:
        run.model(tokens)
    return store[tuple(place)].double()


def test_kl_rows_is_kl_of_the_model_to_the_target():
    p, q = [0.7, 0.2, 0.1], [0.2, 0.3, 0.5]
    kl = kl_rows(torch.tensor(p).log(), torch.tensor(q))
    assert kl.dtype == torch.float64
    assert float(kl) == pytest.approx(kl_by_hand(p, q), rel=1e-6)
    assert float(kl) != pytest.approx(kl_by_hand(q, p), rel=1e-3)  # not the reverse direction
    far = float(kl_rows(torch.tensor(p, dtype=torch.float64).log(), torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)))
    assert math.isfinite(far) and far > 10  # where the target has no mass: large but finite


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_token_readout_mixes_the_tasks_next_token_laws(family):
    """q_a = sum_k a_k p_k(next | context): for dice the mixed face probabilities, for markov the
    mixed rows of the current state; only the positions asked for, of the sequences asked for."""
    V, K = 3, 2
    fam = make(family, vocab_size=V)
    pool = fam.sample_pool(K, 0, seed=3)
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    a = torch.tensor([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    sequence = torch.tensor([1, 0, 1])
    q = TokenReadout(fam, tokens, pool.params).mixture(sequence, a, (2, 5))
    assert q.shape == (3, 2, V)
    params = pool.params.tolist()
    for m in range(3):
        for i, t in enumerate((2, 5)):
            law = [params[k] if family == "dice" else params[k][tokens[sequence[m], t]] for k in range(K)]
            assert q[m, i].tolist() == pytest.approx(
                [sum(a[m, k].item() * law[k][v] for k in range(K)) for v in range(V)], rel=1e-12
            )


def test_per_position_task_vectors_by_hand():
    gen = torch.Generator().manual_seed(0)
    h, task = torch.randn(10, 4, 5, generator=gen), torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1, 2])
    theta = position_task_vectors(h, task, 3)
    assert theta.shape == (3, 4, 5) and theta.dtype == torch.float64
    for p in range(4):
        means = [sum(h[n, p].double() for n in range(10) if task[n] == k) / int((task == k).sum()) for k in range(3)]
        centre = sum(means) / 3
        for k in range(3):
            torch.testing.assert_close(theta[k, p], means[k] - centre, rtol=0, atol=1e-12)
    with pytest.raises(AnalysisError, match=r"no sequences of tasks \[3\]"):
        position_task_vectors(h, task, 4)


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_each_steered_position_equals_its_own_pass_under_a_plain_hook(tmp_path, family):
    """The variant steer-at-read-site (the earlier construction): E1 (dice: h - theta_k(p) + a
    theta(p)) and E3 (markov: h - (h - mu_p) P_S + a theta, the layout's task vectors), edited at two
    positions where they are read: each position's steered KL is that of a separate forward pass
    of the whole model whose hook edits that position alone, computed here by hand; unsteered and
    mode likewise."""
    run = study_run(tmp_path, family)
    place = steering_place(run.family, 4)
    assert place == (2, "resid_post")
    major = run.heldout("major", N, split="measure")
    geometry = run.geometry(major, place)
    positions = (26, 29) if family == "dice" else (0, 7)
    result = geometry.steer("dirichlet", positions=positions, protocol=READ_PLACE)
    assert (
        result.positions == positions
        and result.form == ("task" if family == "dice" else "subspace")
        and result.place == place
    )
    a, tokens, task = result.a, major.batch.tokens, major.batch.task
    assert a.shape == (N, 3) and torch.equal(result.sequence, torch.arange(N))
    h = states_by_hand(run, place, tokens)
    params = run.pool.subset("major").params.double()

    def edit_by_hand(p: int):
        if family == "dice":  # theta_k(p): task means at p minus their mean
            means = torch.stack([h[task == k, p].mean(0) for k in range(3)])
            theta = means - means.mean(0)
            return lambda state: (state.double() - theta[task] + a @ theta).float()
        theta, basis = geometry.task_vectors, geometry.basis
        mu = torch.stack([h[task == k, p].mean(0) for k in range(3)]).mean(0)  # mu_p: the mean of the task means at p
        return lambda state: (state.double() - (state.double() - mu) @ basis @ basis.T + a @ theta).float()

    def law(k: int, n: int, t: int) -> torch.Tensor:
        return params[k] if family == "dice" else params[k, tokens[n, t]]

    with torch.no_grad():
        plain = torch.softmax(run.model(tokens).double(), -1)
    steered, unsteered, mode = [], [], []
    for p in positions:
        edited = torch.softmax(hooked_outputs(run, place, tokens, p, edit_by_hand(p)).double(), -1)
        targets = [sum(a[n, k] * law(k, n, p) for k in range(3)) for n in range(N)]
        steered.append([kl_by_hand(edited[n, p].tolist(), targets[n].tolist()) for n in range(N)])
        unsteered.append([kl_by_hand(plain[n, p].tolist(), targets[n].tolist()) for n in range(N)])
        mode.append([kl_by_hand(law(int(a[n].argmax()), n, p).tolist(), targets[n].tolist()) for n in range(N)])
    mean = lambda rows: torch.tensor(rows, dtype=torch.float64).mean(0)  # noqa: E731  over the positions
    torch.testing.assert_close(result.unsteered, mean(unsteered), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(result.steered, mean(steered), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.mode, mean(mode), rtol=1e-9, atol=1e-12)
    assert (result.steered - result.unsteered).abs().max() > 1e-3  # the edit acts
    assert result.random.shape == (N,) and not torch.allclose(result.random, result.steered)


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_the_protocol_steers_as_the_study_s_injection_by_hand(tmp_path, family):
    """The study's ``intervene_averaging_injection``, step by step in plain loops: natural states at
    resid_post of 1,024 (here 64) sequences of each major task (split ``steering``); E1 per-position
    task means minus their mean over tasks, E3 the task means over positions 25-39 minus their mean,
    their span by SVD (rank cut 1e-6) and mu_p the mean of the task means at p; the edit written by a
    hook at resid_mid of the same block, one position per pass; KL(model || q_a) against the
    mixture of the major tasks' next-token laws. A change of the write site, the estimation window
    or the overwritten quantity changes these values."""
    small = STUDY.changed({"steering_estimation_per_task": 64})
    run = study_run(tmp_path, family)
    place = steering_place(run.family, 4)
    major = run.heldout("major", N, split="measure")
    positions = (26, 29) if family == "dice" else (0, 27)
    result = run.geometry(major, place).steer("dirichlet", positions=positions, protocol=small)
    assert result.place == (2, "resid_mid") and result.positions == positions
    a, tokens, task = result.a, major.batch.tokens, major.batch.task
    estimation = run.heldout_tasks("major", 64, split="steering")
    h = states_by_hand(run, place, estimation.batch.tokens)  # [3 * 64, T, D] at resid_post
    by_task = [h[estimation.batch.task == k] for k in range(3)]
    params = run.pool.subset("major").params.double()

    def edit_by_hand(p: int):
        if family == "dice":
            means = [x[:, p].mean(0) for x in by_task]
            centre = sum(means) / 3
            theta = torch.stack([m - centre for m in means])
            return lambda state: (state.double() - theta[task] + a @ theta).float()
        T = h.shape[1]  # 32: positions 25-39 do not fit, so the same fractions of the edited span 0-39 ([ours])
        window = range(25, 40) if T > 39 else sorted({min(t * T // 40, T - 1) for t in range(25, 40)})
        assert T == 32 and window == list(range(20, 32))
        means = [torch.cat([x[:, t] for t in window]).mean(0) for x in by_task]  # pooled over the window
        centre = sum(means) / 3
        theta = torch.stack([m - centre for m in means])
        _, singular, vh = torch.linalg.svd(theta)
        span = vh[: int((singular > 1e-6 * singular[0]).sum())]
        projector = span.T @ span
        mu = sum(x[:, p].mean(0) for x in by_task) / 3
        return lambda state: (state.double() - (state.double() - mu) @ projector + a @ theta).float()

    def law(k: int, n: int, t: int) -> torch.Tensor:
        return params[k] if family == "dice" else params[k, tokens[n, t]]

    with torch.no_grad():
        plain = torch.softmax(run.model(tokens).double(), -1)
    steered, unsteered = [], []
    for p in positions:
        edited = torch.softmax(
            hooked_outputs(run, Place(place.layer, "resid_mid"), tokens, p, edit_by_hand(p)).double(), -1
        )
        targets = [sum(a[n, k] * law(k, n, p) for k in range(3)) for n in range(N)]
        steered.append([kl_by_hand(edited[n, p].tolist(), targets[n].tolist()) for n in range(N)])
        unsteered.append([kl_by_hand(plain[n, p].tolist(), targets[n].tolist()) for n in range(N)])
    mean = lambda rows: torch.tensor(rows, dtype=torch.float64).mean(0)  # noqa: E731  over the positions
    torch.testing.assert_close(result.unsteered, mean(unsteered), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(result.steered, mean(steered), rtol=1e-4, atol=1e-7)
    assert (result.steered - result.unsteered).abs().max() > 1e-3  # the edit acts
    at_read_site = run.geometry(major, place).steer("dirichlet", positions=positions, protocol=READ_PLACE)
    assert at_read_site.place == place and not torch.allclose(at_read_site.steered, result.steered)


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_steering_in_chunks_reads_what_one_pass_reads(tmp_path, family, monkeypatch):
    """``steer`` runs ``CHUNK`` pairs at a time: every readout (the random control's too, its directions
    drawn for all pairs first) is the same, bit for bit, with chunks of 5 pairs as in one pass."""
    import taskgeom.analysis.reading.steering as steering

    run = study_run(tmp_path, family)
    geometry = run.geometry(run.heldout("major", N, split="measure"), steering_place(run.family, 4))
    protocols = (STUDY.changed({"steering_estimation_per_task": 64}), READ_PLACE)
    whole = [geometry.steer("dirichlet", positions=(26, 29), protocol=p) for p in protocols]
    monkeypatch.setattr(steering, "CHUNK", 5)
    chunked = [geometry.steer("dirichlet", positions=(26, 29), protocol=p) for p in protocols]
    for one, other in zip(whole, chunked):
        for kind in KINDS:
            assert torch.equal(getattr(other, kind), getattr(one, kind)), kind


@pytest.mark.parametrize("k", [0, 2])
def test_the_readout_at_a_vertex_is_the_kl_to_that_tasks_law(tmp_path, k):
    run = study_run(tmp_path, "markov")
    place = steering_place(run.family, 4)
    major = run.heldout("major", N, split="measure")
    vertex = torch.eye(3, dtype=torch.float64)[k]
    result = run.geometry(major, place).steer(to=vertex, positions=[3], protocol=READ_PLACE)
    tokens, params = major.batch.tokens, run.pool.subset("major").params.double()
    with torch.no_grad():
        plain = torch.softmax(run.model(tokens).double(), -1)
    expected = [kl_by_hand(plain[n, 3].tolist(), params[k, tokens[n, 3]].tolist()) for n in range(N)]
    torch.testing.assert_close(result.unsteered, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-9)
    assert torch.equal(result.mode, torch.zeros(N, dtype=torch.float64))  # the mode task is task k itself
    assert torch.equal(result.a, vertex.expand(N, 3))


@pytest.mark.parametrize("layout", ["separator", "pair"])
def test_e2_steering_is_the_rmse_to_the_mixtures_prediction_by_hand(tmp_path, layout):
    """E2 under steer-at-read-site: h - (h - mu_p) P_S + a theta at the position where y_i is read, one example per pass;
    the RMSE over the examples of the model's y against y_a = sum_j a_j x_i . w_j, and of the
    argmax task's prediction (mode)."""
    run = study_run(tmp_path, "regression", d=2, n_examples=8, layout=layout)
    place = steering_place(run.family, 4)
    assert place == (2, "resid_post")  # block 10 of 16 at the relative depth of 4 blocks
    major = run.heldout("major", N, split="measure")
    geometry = run.geometry(major, place)
    examples = (1, 6)
    result = geometry.steer("dirichlet", positions=examples, protocol=READ_PLACE)
    assert result.measure == "rmse" and result.form == "subspace"
    a, batch, w = result.a, major.batch, run.pool.subset("major").params.double()
    read = run.family.prediction_positions(8)
    h = states_by_hand(run, place, batch.tokens)
    theta, basis = geometry.task_vectors, geometry.basis
    y_a = torch.stack([sum(a[:, j] * (batch.x[:, i].double() @ w[j]) for j in range(3)) for i in examples], 1)  # [N, 2]
    with torch.no_grad():
        plain = run.model(batch.tokens)[..., 0].double()
    steered = []
    for i, example in enumerate(examples):
        where = int(read[example])
        mu = h[:, where].mean(0)  # the paired batch gives every task the same number of sequences
        out = hooked_outputs(
            run,
            place,
            batch.tokens,
            where,
            lambda s: (s.double() - (s.double() - mu) @ basis @ basis.T + a @ theta).float(),
        )
        steered.append(out[:, where, 0].double())
    steered = torch.stack(steered, 1)
    mode_y = torch.stack([(batch.x[torch.arange(N), i].double() * w[a.argmax(-1)]).sum(-1) for i in examples], 1)
    rmse = lambda y: ((y - y_a) ** 2).mean(1).sqrt()  # noqa: E731
    torch.testing.assert_close(result.unsteered, rmse(plain[:, read[list(examples)]]), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.steered, rmse(steered), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.mode, rmse(mode_y), rtol=1e-9, atol=1e-12)


def test_points_per_sequence_repeat_each_sequence_with_its_own_draws(tmp_path):
    run = study_run(tmp_path, "markov")
    geometry = run.geometry(run.heldout("major", N, split="measure"), steering_place(run.family, 4))
    result = geometry.steer("dirichlet", points=3, positions=[2])
    assert result.n_points == 3 * N and result.n_sequences == N
    assert torch.equal(result.sequence, torch.arange(N).repeat_interleave(3))
    assert not torch.equal(result.a[0], result.a[1])
    single = geometry.steer("dirichlet", positions=[2])  # the draws are the run seed's: the first N of the same stream
    assert torch.equal(single.a, result.a[:N])
    with pytest.raises(AnalysisError, match="1 for a chosen point"):
        geometry.steer([0.2, 0.3, 0.5], points=2)
    with pytest.raises(AnalysisError, match="sum to one"):
        geometry.steer(to=[0.6, 0.3, 0.3])
    with pytest.raises(AnalysisError, match="unknown steering form 'all'"):
        geometry.steer(form="all")


def test_positions_beyond_the_context_are_moved_to_its_last():
    assert clip_positions(range(25, 40), 64) == tuple(range(25, 40))
    assert clip_positions(range(25, 40), 30) == (25, 26, 27, 28, 29)
    assert clip_positions(range(25, 40), 16) == (15,)  # a short context keeps its last position
    assert clip_positions(range(0, 40), 16) == tuple(range(16))
    with pytest.raises(AnalysisError, match="non-empty"):
        clip_positions([], 16)


def test_the_random_control_moves_each_state_as_far_as_the_edit():
    gen = torch.Generator().manual_seed(2)
    shift = torch.randn(4, 1, 6, generator=gen)
    h = torch.randn(4, 1, 6, generator=gen)
    directions = torch.randn(4, 1, 6, generator=gen)
    control = random_edit(lambda s, rows: s + shift[rows], directions)(h, slice(0, 4))
    torch.testing.assert_close((control - h).norm(dim=-1), shift.norm(dim=-1))
    assert not torch.allclose(control, h + shift)
    unit = (control - h) / (control - h).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(unit, directions / directions.norm(dim=-1, keepdim=True))  # along its own direction
    torch.testing.assert_close(
        random_edit(lambda s, rows: s + shift[rows], directions)(h[2:], slice(2, 4)), control[2:]
    )


def fabricated(measure: str, unsteered: list[float], steered: list[float], mode: list[float]) -> Steering:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    n = len(unsteered)
    return Steering(
        torch.full((n, 3), 1 / 3, dtype=torch.float64),
        torch.arange(n),
        (25, 26, 27),
        t(unsteered),
        t(steered),
        t(mode),
        t([1.0] * n),
        measure,
        "KL" if measure == "kl" else "RMSE",
        "task",
        Place(3, "resid_post"),
        n,
    )


def test_steering_rows_are_means_with_quartile_bands_and_what_was_steered():
    steering = fabricated("kl", [0.9, 0.1, 0.5, 0.7, 0.3], [0.01, 0.2, 0.05, 0.04, 0.02], [0.6, 0.8, 0.4, 1.0, 0.2])
    rows = {r["metric"]: r for r in steering_rows(steering)}
    assert list(rows) == [
        "steering.kl_unsteered",
        "steering.kl_steered",
        "steering.kl_mode",
        "steering.kl_random",
        "steering.n_sequences",
        "steering.n_points",
        "steering.position_first",
        "steering.position_last",
        "steering.n_positions",
    ]
    assert rows["steering.kl_unsteered"]["value"] == pytest.approx(0.5) and rows["steering.kl_unsteered"][
        "band"
    ] == pytest.approx([0.3, 0.7])
    assert rows["steering.kl_steered"]["value"] == pytest.approx(0.064) and rows["steering.kl_mode"][
        "value"
    ] == pytest.approx(0.6)
    assert [
        rows[f"steering.{m}"]["value"]
        for m in ("n_sequences", "n_points", "position_first", "position_last", "n_positions")
    ] == [5, 5, 25, 27, 3]
    assert all(
        (r["layer"], r["site"], r["batch"], r["position"]) == (3, "resid_post", "measure", None) for r in rows.values()
    )


@pytest.mark.parametrize(
    "measure, unsteered, steered, mode, value, status",
    [
        ("kl", 0.75, 0.25, 0.5, 1.0, "pass"),  # exactly a third of unsteered, below the mode task's
        ("kl", 0.75, 0.26, 0.5, 1.04, "fail"),  # more than a third
        ("kl", 0.75, 0.125, 0.1, 1.25, "fail"),  # a sixth of unsteered, but above the mode task's
        ("rmse", 0.75, 0.375, 0.5, 1.0, "pass"),  # E2: half of unsteered passes
        ("rmse", 0.75, 0.25, 0.5, 2 / 3, "pass"),
        ("rmse", 0.75, 0.5, 0.75, 4 / 3, "fail"),
    ],
)
def test_the_claim_passes_at_most_a_third_of_unsteered_and_below_the_mode_task(
    measure, unsteered, steered, mode, value, status
):
    claim = steering_claim(fabricated(measure, [unsteered] * 2, [steered] * 2, [mode] * 2), "e1")
    assert claim.value == pytest.approx(value, rel=1e-12) and claim.status == status and claim.threshold == 1.0
    assert claim.parts == {
        "unsteered": unsteered,
        "steered": steered,
        "mode": mode,
        "random": 1.0,
        "layer": 3,
        "site": "resid_post",
        "position_first": 25,
        "position_last": 27,
        "n_positions": 3,
        "n_sequences": 2,
        "n_points": 2,
        "form": "task",
    }

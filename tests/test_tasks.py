"""E1 and E3: exact Bayes quantities against brute force and closed forms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from taskgeom import tasks

FAMILIES = [("dice", 4), ("markov", 3)]


def family(name: str, **settings) -> tasks.TaskFamily:
    """``tasks.make`` with dice's majors drawn from the prior, like the minors (so the pools below are generic)."""
    return tasks.make(name, **({"majors": "prior"} if name == "dice" else {}), **settings)


def brute_log_likelihood(name: str, seq: list[int], params: torch.Tensor) -> float:
    """log p(seq | task) by a plain loop."""
    V = params.shape[-1]
    if name == "dice":
        return sum(math.log(params[x]) for x in seq)
    return -math.log(V) + sum(math.log(params[a, b]) for a, b in zip(seq, seq[1:]))


@pytest.mark.parametrize("name,V", FAMILIES)
def test_posterior_and_predictive_match_brute_force(name, V):
    fam = family(name, vocab_size=V)
    pool = fam.sample_pool(n_major=2, n_minor=3, p_minor=0.2, seed=1)
    batch = fam.sample(pool, batch_size=5, seq_len=7, seed=3, step=2)
    logpost = fam.log_posterior(batch.tokens, pool)
    pred = fam.predict_id(batch.tokens, pool)
    for b in range(5):
        seq = batch.tokens[b].tolist()
        for t in range(7):
            joint = torch.tensor(
                [
                    math.log(pool.weights[k]) + brute_log_likelihood(name, seq[: t + 1], pool.params[k])
                    for k in range(pool.size)
                ],
                dtype=torch.float64,
            )
            expected = joint - torch.logsumexp(joint, 0)
            torch.testing.assert_close(logpost[b, t], expected, rtol=0, atol=1e-10)
            # predictive by enumerating the next token: p(x_{t+1} = v | x_{:t+1}) = p(seq + [v]) / p(seq)
            nxt = torch.tensor(
                [
                    torch.logsumexp(
                        torch.tensor(
                            [
                                math.log(pool.weights[k])
                                + brute_log_likelihood(name, seq[: t + 1] + [v], pool.params[k])
                                for k in range(pool.size)
                            ],
                            dtype=torch.float64,
                        ),
                        0,
                    )
                    for v in range(V)
                ],
                dtype=torch.float64,
            )
            torch.testing.assert_close(pred[b, t], (nxt - torch.logsumexp(joint, 0)).exp(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,V", FAMILIES)
def test_ood_evidence_is_the_dirichlet_multinomial_closed_form(name, V):
    alpha = 0.7
    fam = family(name, vocab_size=V, alpha=alpha)
    batch = fam.sample_ood(batch_size=6, seq_len=9, seed=0)
    evidence = fam.log_marginal_ood(batch.tokens)[:, -1]

    def log_dm(counts: torch.Tensor) -> float:  # Dirichlet-multinomial evidence of an ordered sequence
        n = counts.sum()
        return (
            math.lgamma(V * alpha)
            - math.lgamma(V * alpha + n)
            + sum(math.lgamma(alpha + c) - math.lgamma(alpha) for c in counts.tolist())
        )

    for b in range(6):
        seq = batch.tokens[b]
        if name == "dice":
            expected = log_dm(torch.bincount(seq, minlength=V).double())
        else:  # uniform first state, then one Dirichlet-multinomial per row of the transition matrix
            pairs = torch.bincount(seq[:-1] * V + seq[1:], minlength=V * V).view(V, V).double()
            expected = -math.log(V) + sum(log_dm(row) for row in pairs)
        assert evidence[b].item() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("name,V", FAMILIES)
def test_every_predictive_sums_to_one(name, V):
    fam = family(name, vocab_size=V)
    pool = fam.sample_pool(3, 16, 0.1, seed=0)
    batch = fam.sample(pool, 32, 20, seed=0)
    for probs in (
        fam.predict_id(batch.tokens, pool),
        fam.predict_ood(batch.tokens),
        fam.predict_task(batch.tokens, batch.params),
    ):
        assert probs.shape == (32, 20, V)
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(32, 20, dtype=torch.float64))


def test_ood_predictor_is_add_alpha_counting_for_dice():
    fam = tasks.make("dice", vocab_size=3, alpha=2.0, majors="prior")
    tokens = torch.tensor([[0, 0, 2, 1]])
    expected = torch.tensor([[3, 2, 2], [4, 2, 2], [4, 2, 3], [4, 3, 3]], dtype=torch.float64)
    torch.testing.assert_close(fam.predict_ood(tokens)[0], expected / expected.sum(-1, keepdim=True))


def test_markov_ood_predictor_counts_transitions_from_the_current_state():
    fam = tasks.make("markov", vocab_size=2, alpha=1.0)
    tokens = torch.tensor([[0, 1, 0, 0]])  # transitions 0->1, 1->0, 0->0
    expected = torch.tensor([[1, 1], [1, 1], [1, 2], [2, 2]], dtype=torch.float64)
    torch.testing.assert_close(fam.predict_ood(tokens)[0], expected / expected.sum(-1, keepdim=True))


def test_pool_weights_and_diversity():
    weights = tasks.pool_weights(3, 8, 0.1)
    torch.testing.assert_close(weights[:3], torch.full((3,), 0.3, dtype=torch.float64))
    torch.testing.assert_close(weights[3:], torch.full((8,), 0.1 / 8, dtype=torch.float64))
    torch.testing.assert_close(tasks.pool_weights(3, 0, 0.1), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert [tasks.n_minor_for_diversity(k) for k in (-1, 0, 3)] == [0, 1, 8]
    with pytest.raises(ValueError, match="p_minor"):
        tasks.pool_weights(3, 2, 1.0)


def test_disjoint_dice_majors():
    fam = tasks.make("dice", vocab_size=6, majors="disjoint", floor=0.02)
    pool = fam.sample_pool(3, 0, seed=0)
    dominant = pool.params.argsort(-1, descending=True)[:, :2].sort(-1).values
    assert dominant.tolist() == [[0, 1], [2, 3], [4, 5]]
    torch.testing.assert_close(pool.params.sum(-1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("name,V", FAMILIES)
def test_sampling_is_a_pure_function_of_seed_step_stream(name, V):
    fam = family(name, vocab_size=V)
    pool = fam.sample_pool(3, 4, seed=0)
    a = fam.sample(pool, 16, 12, seed=5, step=3)
    b = fam.sample(pool, 16, 12, seed=5, step=3)
    c = fam.sample(pool, 16, 12, seed=5, step=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.task, b.task)
    assert not torch.equal(a.tokens, c.tokens)
    assert not torch.equal(fam.sample_ood(16, 12, seed=5).tokens, fam.sample_ood(16, 12, seed=6).tokens)
    assert (fam.sample(pool, 16, 12, subset="minor").task >= 3).all()
    assert (fam.sample(pool, 16, 12, subset="major").task < 3).all()


@pytest.mark.parametrize("name,V", FAMILIES)
def test_sampled_frequencies_match_the_task(name, V):
    """Empirical unigram (dice) or transition (markov) frequencies converge to the task."""
    fam = family(name, vocab_size=V)
    pool = fam.sample_pool(1, 0, seed=2)
    tokens = fam.sample(pool, 400, 200, seed=0).tokens
    if name == "dice":
        freq = torch.bincount(tokens.flatten(), minlength=V).double() / tokens.numel()
        torch.testing.assert_close(freq, pool.params[0], atol=0.01, rtol=0)
    else:
        pairs = torch.bincount((tokens[:, :-1] * V + tokens[:, 1:]).flatten(), minlength=V * V).view(V, V).double()
        torch.testing.assert_close(pairs / pairs.sum(-1, keepdim=True), pool.params[0], atol=0.02, rtol=0)
        first = torch.bincount(tokens[:, 0], minlength=V).double() / 400
        torch.testing.assert_close(first, torch.full((V,), 1 / V, dtype=torch.float64), atol=0.08, rtol=0)


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="unknown task family 'dices'"):
        tasks.make("dices")


@pytest.mark.parametrize("name,V,T", [("dice", 3, 3), ("markov", 2, 4), ("markov", 3, 3)])
def test_bayes_posterior_brute_force_over_all_short_sequences(name, V, T):
    """For every sequence of length T: the posterior after each prefix equals prior x product of
    likelihoods (a plain loop over tokens, no tensor code of the family), normalised; and the chain
    of Bayes predictives gives each whole sequence the pool mixture's probability sum_k w_k p_k(seq)."""
    fam = family(name, vocab_size=V)
    pool = fam.sample_pool(2, 2, 0.3, seed=0)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=T)))  # all V**T sequences
    post = fam.log_posterior(seqs, pool).exp()  # [V**T, T, K]
    pred = fam.predict_id(seqs, pool)  # [V**T, T, V]
    weights, params = pool.weights.tolist(), pool.params.tolist()

    def likelihood(seq: list[int], k: int) -> float:
        if name == "dice":
            return math.prod(params[k][x] for x in seq)
        return (1 / V) * math.prod(params[k][a][b] for a, b in zip(seq, seq[1:]))

    total = 0.0
    for i, seq in enumerate(seqs.tolist()):
        for t in range(T):
            joint = [weights[k] * likelihood(seq[: t + 1], k) for k in range(pool.size)]
            expected = [j / sum(joint) for j in joint]
            assert post[i, t].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15), (seq, t)
        first = sum(
            weights[k] * likelihood(seq[:1], k) for k in range(pool.size)
        )  # no predictive before the first token
        chain = first * math.prod(pred[i, t, seq[t + 1]].item() for t in range(T - 1))
        mixture = sum(weights[k] * likelihood(seq, k) for k in range(pool.size))
        assert chain == pytest.approx(mixture, rel=1e-12), seq
        total += mixture
    assert total == pytest.approx(1.0, abs=1e-12)


# ---- E1 at the study's settings (docs/protocol.md#the-studys-settings-the-paper-profile): V = 16, Dirichlet(1) majors from a fixed seed -----
def test_e1_majors_are_the_same_in_every_run_and_the_minors_are_drawn_per_run(tmp_path):
    """The recipe's majors do not depend on the run seed or the diversity; its minors depend on the seed."""
    from taskgeom.runs.folders import Run
    from taskgeom.settings.recipes import load_recipe

    def pool(seed: int, k: int) -> tasks.TaskPool:
        return Run(tmp_path, load_recipe("e1", "quick", [f"train.seed={seed}", f"task.diversity={k}"])).pool

    first = pool(0, -1).params
    assert first.shape == (3, 16) and (first > 0).all()
    torch.testing.assert_close(first.sum(-1), torch.ones(3, dtype=torch.float64))
    for seed, k in ((1, -1), (2, 0), (0, 4), (5, 10)):
        assert torch.equal(pool(seed, k).params[:3], first), (seed, k)
    assert not torch.equal(pool(0, 4).params[3:], pool(1, 4).params[3:])
    assert not torch.equal(pool(0, 0).params[3:], pool(2, 0).params[3:])
    other = tasks.make("dice", vocab_size=16, majors="dirichlet", major_seed=7).sample_pool(3, 0).params
    assert not torch.equal(other, first)
    prior = tasks.make("dice", vocab_size=16, majors="prior")  # majors="prior" still draws them per run
    assert not torch.equal(prior.sample_pool(3, 0, seed=0).params, prior.sample_pool(3, 0, seed=1).params)


def test_e1_bayes_at_v16_with_dirichlet_majors_matches_a_plain_loop():
    """Posterior over the pool (majors, then minors) as prior x product of face probabilities, the
    ID predictive as the posterior mixture and the OOD one as add-one counts, each by a plain loop."""
    fam = tasks.make("dice", vocab_size=16, alpha=1.0, majors="dirichlet", major_seed=42)
    pool = fam.sample_pool(3, 8, 0.1, seed=3)
    batch = fam.sample(pool, 6, 40, seed=1)
    logpost, pred_id, pred_ood = (
        fam.log_posterior(batch.tokens, pool),
        fam.predict_id(batch.tokens, pool),
        fam.predict_ood(batch.tokens),
    )
    weights, params = pool.weights.tolist(), pool.params.tolist()
    for b, seq in enumerate(batch.tokens.tolist()):
        joint = list(map(math.log, weights))
        counts = [1.0] * 16
        for t, x in enumerate(seq):
            joint = [j + math.log(params[k][x]) for k, j in enumerate(joint)]
            top = max(joint)
            post = [math.exp(j - top) for j in joint]
            post = [p / sum(post) for p in post]
            torch.testing.assert_close(
                logpost[b, t].exp(), torch.tensor(post, dtype=torch.float64), rtol=1e-10, atol=1e-13
            )
            mixture = [sum(post[k] * params[k][v] for k in range(pool.size)) for v in range(16)]
            torch.testing.assert_close(
                pred_id[b, t], torch.tensor(mixture, dtype=torch.float64), rtol=1e-10, atol=1e-13
            )
            counts[x] += 1
            torch.testing.assert_close(
                pred_ood[b, t], torch.tensor([c / sum(counts) for c in counts], dtype=torch.float64)
            )

"""E4, planted Dyck: the sampler and the exact Bayes quantities against brute-force enumeration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from taskgeom import tasks
from taskgeom.rng import generator
from taskgeom.tasks.base import TaskPool
from taskgeom.tasks.dyck import OPEN, completion_counts, open_probability

torch.set_num_threads(1)


def dyck_words(n_pairs: int) -> list[tuple[int, ...]]:
    """Every balanced string of n_pairs pairs (0 = "(", 1 = ")"), by filtering all 2^(2n) strings."""
    words = []
    for code in range(2 ** (2 * n_pairs)):
        word = tuple((code >> (2 * n_pairs - 1 - i)) & 1 for i in range(2 * n_pairs))
        depths = [sum(1 - 2 * b for b in word[: i + 1]) for i in range(len(word))]
        if min(depths) >= 0 and depths[-1] == 0:
            words.append(word)
    return words


def brute_log_likelihood(fam, seq: list[int], word) -> list[float]:
    """log p(seq[t] | seq[:t], word) for each t, by a plain loop over the generative story."""
    out, placed = [], 0
    for x in seq:
        if x < fam.n_noise:
            out.append(math.log((1 - fam.p_bracket) / fam.n_noise) if placed < len(word) else -math.log(fam.n_noise))
        elif placed < len(word) and word[placed] == x - fam.n_noise:
            out.append(math.log(fam.p_bracket))
            placed += 1
        else:
            out.append(-math.inf)
    return out


def brute_predictive(fam, seq: list[int], word) -> list[float]:
    """The next-token distribution of one task after seq."""
    placed = sum(x >= fam.n_noise for x in seq)
    if placed >= len(word):
        return [1 / fam.n_noise] * fam.n_noise + [0.0, 0.0]
    probs = [(1 - fam.p_bracket) / fam.n_noise] * fam.n_noise + [0.0, 0.0]
    probs[fam.n_noise + word[placed]] = fam.p_bracket
    return probs


def brute_mixture(fam, seq: list[int], words, prior) -> list[float] | None:
    """Posterior-weighted predictive over ``words`` after seq; None if no word is consistent."""
    post = [w * math.exp(sum(brute_log_likelihood(fam, seq, word))) for word, w in zip(words, prior)]
    total = sum(post)
    if total == 0:
        return None
    preds = [brute_predictive(fam, seq, word) for word in words]
    return [sum(p * pred[v] for p, pred in zip(post, preds)) / total for v in range(fam.vocab_size)]


@pytest.mark.parametrize("n_pairs", [1, 2, 3, 4, 5, 6])
def test_completion_counts_are_ballot_numbers(n_pairs):
    table = completion_counts(n_pairs)
    assert table[2 * n_pairs, 0] == math.comb(2 * n_pairs, n_pairs) // (n_pairs + 1)  # Catalan
    for r in range(2 * n_pairs + 1):
        for d in range(r + 1):  # ballot formula: paths of length r from d to 0 staying >= 0
            up = (r - d) // 2
            expected = (
                math.comb(r, up) - math.comb(r, up - 1) if (r - d) % 2 == 0 and up >= 1 else float((r - d) % 2 == 0)
            )
            assert table[r, d] == expected, (r, d)


def test_sampler_is_uniform_over_dyck_words():
    fam = tasks.make("dyck", n_pairs=4)
    words = dyck_words(4)
    assert len(words) == 14
    draws = fam.sample_params(14_000, generator(0, 0, "test"))
    index = {w: i for i, w in enumerate(words)}
    observed = torch.zeros(len(words))
    for row in draws.tolist():
        observed[index[tuple(row)]] += 1  # a KeyError here would mean an unbalanced draw
    result = scipy.stats.chisquare(observed.numpy())
    assert result.pvalue > 1e-3, (observed, result)


def test_tokens_plant_the_string_in_order():
    fam = tasks.make("dyck", n_pairs=10)
    params = fam.sample_params(64, generator(1, 0, "p"))
    tokens = fam.sample_tokens(params, 169, generator(1, 0, "t"))
    assert tokens.min() >= 0 and tokens.max() < fam.vocab_size
    for row, word in zip(tokens.tolist(), params.tolist()):
        brackets = [x - fam.n_noise for x in row if x >= fam.n_noise]
        assert brackets == word[: len(brackets)]
    # brackets are emitted at rate p_bracket while the string is unfinished
    pending = fam.bracket_count(tokens)[:, :-1] < fam.length
    rate = (tokens[:, 1:] >= fam.n_noise)[pending].double().mean()
    assert abs(rate - 0.25) < 0.015


def test_planted_and_depth_match_loops():
    fam = tasks.make("dyck", n_pairs=5)
    pool = fam.sample_pool(3, 4, seed=2)
    tokens = fam.sample(pool, 6, 40, seed=2).tokens
    depth = fam.depth(tokens)
    for back in (1, 2, 3, 7):
        got = fam.planted(tokens, back)
        for b, row in enumerate(tokens.tolist()):
            for t in range(len(row)):
                seen = [x - fam.n_noise for x in row[: t + 1] if x >= fam.n_noise]
                assert got[b, t] == (seen[-back] if len(seen) >= back else -1)
                if back == 1:
                    assert depth[b, t] == sum(1 - 2 * s for s in seen)


@pytest.mark.parametrize(
    "n_noise", [6, 7]
)  # 6: the study's vocabulary of 8 (docs/protocol.md#the-studys-settings-the-paper-profile)
def test_id_posterior_and_predictive_match_brute_force(n_noise):
    fam = tasks.make("dyck", n_pairs=3, n_noise=n_noise)
    words = dyck_words(3)  # 5 words: the pool holds all of them, so every sequence is consistent
    pool = TaskPool(torch.tensor(words), torch.tensor([0.4, 0.1, 0.2, 0.05, 0.25], dtype=torch.float64), 2)
    batch = fam.sample(pool, 8, 14, seed=5)
    logpost, pred = fam.log_posterior(batch.tokens, pool), fam.predict_id(batch.tokens, pool)
    for b, row in enumerate(batch.tokens.tolist()):
        for t in range(len(row)):
            seq = row[: t + 1]
            post = torch.tensor(
                [
                    w * math.exp(sum(brute_log_likelihood(fam, seq, word)))
                    for word, w in zip(words, pool.weights.tolist())
                ],
                dtype=torch.float64,
            )
            torch.testing.assert_close(logpost[b, t].exp(), post / post.sum(), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(
                pred[b, t], torch.tensor(brute_mixture(fam, seq, words, pool.weights.tolist()), dtype=torch.float64)
            )
    torch.testing.assert_close(pred.sum(-1), torch.ones(pred.shape[:2], dtype=torch.float64))


def test_step_log_likelihood_matches_brute_force():
    fam = tasks.make("dyck", n_pairs=3)
    words = dyck_words(3)
    params = torch.tensor(words)
    batch = fam.sample_ood(6, 30, seed=4)
    ll = fam.step_log_likelihood(batch.tokens, params)
    for b, row in enumerate(batch.tokens.tolist()):
        for k, word in enumerate(words):  # cumulative: after a mismatch only -inf is meaningful
            expected = torch.tensor(brute_log_likelihood(fam, row, word), dtype=torch.float64).cumsum(0)
            torch.testing.assert_close(ll[b, :, k].cumsum(0), expected, rtol=1e-12, atol=0)


def test_posterior_of_inconsistent_contexts_keeps_the_last_defined_one():
    """A pool that lacks the sequence's string: the posterior is exact while some task agrees,
    then frozen (the prior if no task ever agreed); never NaN."""
    fam = tasks.make("dyck", n_pairs=4)
    words = dyck_words(4)
    pool = TaskPool(torch.tensor(words[:3]), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), 3)
    batch = fam.sample(
        TaskPool(torch.tensor(words[3:]), torch.full((11,), 1 / 11, dtype=torch.float64), 11), 16, 40, seed=7
    )
    logpost = fam.log_posterior(batch.tokens, pool)
    pred = fam.predict_id(batch.tokens, pool)
    assert torch.isfinite(pred).all() and not logpost.isnan().any()
    frozen = 0
    for b, row in enumerate(batch.tokens.tolist()):
        last = pool.weights
        for t in range(len(row)):
            post = torch.tensor(
                [
                    w * math.exp(sum(brute_log_likelihood(fam, row[: t + 1], word)))
                    for word, w in zip(words[:3], pool.weights.tolist())
                ],
                dtype=torch.float64,
            )
            if post.sum() > 0:
                last = post / post.sum()
            else:
                frozen += 1
            torch.testing.assert_close(logpost[b, t].exp(), last, rtol=1e-9, atol=1e-12)
    assert frozen > 0


@pytest.mark.parametrize("n_noise", [6, 7])
def test_ood_predictive_matches_enumeration_of_consistent_words(n_noise):
    fam = tasks.make("dyck", n_pairs=4, n_noise=n_noise)
    words = dyck_words(4)
    uniform = [1 / len(words)] * len(words)
    batch = fam.sample_ood(6, 48, seed=9)
    pred = fam.predict_ood(batch.tokens)
    for b, row in enumerate(batch.tokens.tolist()):
        for t in range(len(row)):
            expected = brute_mixture(fam, row[: t + 1], words, uniform)
            torch.testing.assert_close(pred[b, t], torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(pred.sum(-1), torch.ones(pred.shape[:2], dtype=torch.float64))


@pytest.mark.parametrize("n_noise", [6, 7])
def test_ood_marginal_matches_enumeration(n_noise):
    fam = tasks.make("dyck", n_pairs=3, n_noise=n_noise)
    words = dyck_words(3)
    batch = fam.sample_ood(4, 20, seed=11)
    got = fam.log_marginal_ood(batch.tokens)
    for b, row in enumerate(batch.tokens.tolist()):
        for t in range(len(row)):
            marginal = sum(math.exp(sum(brute_log_likelihood(fam, row[: t + 1], w))) for w in words) / len(words)
            assert got[b, t].item() == pytest.approx(math.log(marginal), rel=1e-9)


def ballot(r: int, d: int) -> int:
    """N[r, d] in exact integers: strings of length r taking depth d to 0 without going below 0."""
    if d < 0 or d > r or (r - d) % 2:
        return 0
    up = (r - d) // 2
    return math.comb(r, up) - (math.comb(r, up - 1) if up >= 1 else 0)


def test_open_probability_is_the_ratio_of_ballot_numbers():
    """Against the float64 count table where it is finite, and against exact integers at n_pairs =
    600, where the table overflows (Catalan(600) ~ 1e357)."""
    for n_pairs in (1, 3, 8, 40):
        table, length = completion_counts(n_pairs), 2 * n_pairs
        r, d = torch.meshgrid(torch.arange(length + 1), torch.arange(-2, length + 3), indexing="ij")
        got = open_probability(r, d)
        for i, j in zip(r.flatten().tolist(), d.flatten().tolist()):
            total = table[i, j].item() if 1 <= i and 0 <= j <= length else 0.0
            expected = table[i - 1, j + 1].item() / total if total > 0 else 0.5
            assert got[i, j + 2].item() == pytest.approx(expected, rel=1e-14, abs=0), (n_pairs, i, j)
    for r, d in ((1200, 0), (1199, 1), (1000, 2), (900, 40), (600, 598), (3, 1), (1, 1)):
        expected = ballot(r - 1, d + 1) / ballot(r, d)  # exact ints; the division rounds once
        assert open_probability(torch.tensor(r), torch.tensor(d)).item() == pytest.approx(expected, rel=1e-15)


def _old_predict_ood(fam, tokens: torch.Tensor) -> torch.Tensor:
    """predict_ood as it was computed from the float64 count table (finite for n_pairs < 518)."""
    counts = completion_counts(fam.n_pairs)
    depth = fam.depth(tokens)
    remaining = (fam.length - fam.bracket_count(tokens)).clamp(1, fam.length)
    valid = (depth.cummin(dim=1).values >= 0) & (depth <= remaining)
    d = depth.clamp(0, fam.length - 1)
    total = counts[remaining, d]
    p_open = torch.where(valid & (total > 0), counts[remaining - 1, d + 1] / total.clamp_min(1), 0.5)
    return fam._predictive(tokens, p_open)


@pytest.mark.parametrize("n_pairs", [2, 10, 80])
def test_ood_predictive_equals_the_count_table_where_that_is_finite(n_pairs):
    fam = tasks.make("dyck", n_pairs=n_pairs, p_bracket=0.7)
    seq_len = 2 * n_pairs + 30
    tokens = torch.cat(
        [
            fam.sample_ood(16, seq_len, seed=3).tokens,  # Dyck prefixes, and finished words
            torch.randint(0, fam.vocab_size, (16, seq_len), generator=generator(3, 0, "junk")),
        ]
    )  # invalid ones too
    old = _old_predict_ood(fam, tokens)
    assert torch.isfinite(old).all()
    torch.testing.assert_close(fam.predict_ood(tokens), old, rtol=0, atol=1e-10)


def test_bayes_losses_are_finite_for_600_pairs():
    """n_pairs = 600 overflowed the count table: the prior drew unbalanced words and the OOD-Bayes
    loss was NaN. Words must be Dyck words, every Bayes quantity finite, the first steps exact."""
    fam = tasks.make("dyck", n_pairs=600, p_bracket=0.9)
    pool = fam.sample_pool(2, 2, seed=0)
    words = pool.params
    depths = (1 - 2 * words).cumsum(dim=1)
    assert (depths.min(dim=1).values >= 0).all() and (depths[:, -1] == 0).all()
    draws = fam.sample_params(2000, generator(0, 0, "big"))  # the overflowing sampler always opened here
    share = (draws[:, 1] == OPEN).double().mean().item()
    assert abs(share - 1797 / 2398) < 5 * math.sqrt(0.75 * 0.25 / 2000), share  # N[1198, 2] / N[1199, 1]
    batch = fam.sample(pool, 4, 1400, seed=1)  # long enough to place all 1200 brackets
    assert (fam.bracket_count(batch.tokens)[:, -1] == fam.length).all()
    bayes_id, bayes_ood = fam.reference_predictions(batch, pool)
    for probs in (bayes_id, bayes_ood):
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2], dtype=torch.float64))
    nll = -bayes_ood[:, :-1].log().gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    assert torch.isfinite(nll).all() and torch.isfinite(fam.log_marginal_ood(batch.tokens)).all()
    # after "(" the next bracket of a uniform 600-pair word is "(" with chance N[1198, 2] / N[1199, 1]
    tokens = torch.tensor([[fam.n_noise + OPEN]])
    expected = ballot(1198, 2) / ballot(1199, 1)
    assert fam.predict_ood(tokens)[0, 0, fam.n_noise + OPEN].item() == pytest.approx(0.9 * expected, rel=1e-14)


def test_family_rejects_bad_settings():
    with pytest.raises(ValueError, match="p_bracket"):
        tasks.make("dyck", p_bracket=1.0)
    with pytest.raises(ValueError, match="n_pairs"):
        tasks.make("dyck", n_pairs=0)


def test_e4_recipe_builds_the_family(tmp_path):
    from taskgeom.runs.folders import Run
    from taskgeom.settings.recipes import load_recipe

    for profile, seq_len in (
        ("quick", 96),
        ("paper", 192),
    ):  # the study's vocabulary of 8 in every profile (docs/protocol.md#the-studys-settings-the-paper-profile)
        config = load_recipe("e4", profile)
        assert config.task.family == "dyck" and config.task.n_pairs == 10 and config.task.n_noise == 6
        assert config.task.seq_len == seq_len
    run = Run(tmp_path, load_recipe("e4", "quick", ["task.diversity=3"]))
    assert run.family.vocab_size == 8 and run.pool.size == 3 + 8


def test_within_shares_are_zero_for_token_cells_of_the_embedding_and_one_for_a_single_cell():
    """At layer 0's input (token embedding, rotary positions add nothing) the state is a function
    of the current token, so (anything, token) cells hold no variance; one cell holds all of it."""
    from taskgeom.analysis.reading.states import collect
    from taskgeom.models import Transformer
    from taskgeom.settings.config import ModelConfig
    from taskgeom.studies.e4.experiment import within_shares

    fam = tasks.make("dyck", n_pairs=4)
    tokens = fam.sample_ood(32, 24, seed=1).tokens
    model = Transformer(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_mlp=32, max_len=24), fam.vocab_size)
    mask = fam.bracket_count(tokens) >= 2
    task = torch.arange(32)[:, None].expand_as(tokens) % 3
    zeros = torch.zeros_like(tokens)
    states = list(collect(model, tokens, [(0, "resid_pre"), (0, "resid_post")]).values())
    by_token = within_shares(states, task, tokens, 3, fam.vocab_size, mask)
    assert by_token[0] == pytest.approx(0.0, abs=1e-12) and 0.0 < by_token[1] < 1.0
    assert within_shares(states, zeros, zeros, 1, 1, mask) == pytest.approx([1.0, 1.0])


def test_within_share_is_the_median_over_late_positions_of_each_position_s_layout():
    """P0 per position (as for E1-E3): at each late position, SS_within / SS_total over the cells of
    the masked sequences there, by numpy; the claim's number is their median (positions with fewer
    than two masked sequences left out)."""
    from taskgeom.studies.e4.experiment import within_share

    gen = torch.Generator().manual_seed(0)
    N, T, D = 60, 8, 5
    h = torch.randn(N, T, D, generator=gen, dtype=torch.float64)
    a, b = torch.randint(0, 2, (N, T), generator=gen), torch.randint(0, 3, (N, T), generator=gen)
    mask = torch.rand(N, T, generator=gen) < 0.5
    mask[:, -1] = False
    mask[0, -1] = True  # one masked sequence at the last position: left out
    shares = []
    for t in range(T - 2, T):  # the late window of 8 positions: the last 2
        keep = mask[:, t].numpy()
        if keep.sum() < 2:
            continue
        x, cells = h[keep, t].numpy(), (a[keep, t] * 3 + b[keep, t]).numpy()
        within = sum(((x[cells == c] - x[cells == c].mean(0)) ** 2).sum() for c in set(cells))
        shares.append(within / ((x - x.mean(0)) ** 2).sum())
    assert len(shares) == 1
    assert within_share(h, a, b, 2, 3, mask) == pytest.approx(float(np.median(shares)), rel=1e-12)

"""The HMM plugin family: its forward algorithm against brute-force enumeration of hidden paths,
its samplers against its own probabilities, exact Bayes over a pool, the OOD predictor against the
exact continuous-prior predictive (enumerated with Dirichlet moments), its registration, and the
plain ``taskgeom`` command end to end on the recipe's ``tiny`` profile."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hmm_family import HMM

from taskgeom.settings.config import ConfigError
from taskgeom.settings.recipes import load_config
from taskgeom.tasks import TaskPool
from taskgeom.tasks.registry import build_family

RECIPE = Path(__file__).resolve().parents[1] / "hmm.yaml"
H, V = 2, 3  # tiny sizes: brute force sums over H**T hidden paths
T = 5
ALPHA = 1.0  # the Dirichlet concentration of every row

torch.set_num_threads(1)


def small_family(ood_bank: int = 2048) -> HMM:
    return HMM(vocab_size=V, n_hidden=H, alpha_transition=ALPHA, alpha_emission=ALPHA, ood_bank=ood_bank)


def hidden_paths(length: int) -> torch.Tensor:
    """[H**length, length] every hidden-state path."""
    return torch.tensor(list(itertools.product(range(H), repeat=length)), dtype=torch.long)


def path_sum(tokens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """[B, K] p_k(tokens) by brute force: the sum over every hidden path of
    (1/H) prod_t A[z_{t-1}, z_t] prod_t E[z_t, x_t]; tokens: [B, L], params: [K, H, H + V]."""
    paths = hidden_paths(tokens.shape[1])
    A, E = params[..., :H], params[..., H:]
    transitions = A[:, paths[:, :-1], paths[:, 1:]].prod(-1)  # [K, P]
    emissions = E[:, paths[None], tokens[:, None]].prod(-1)  # [K, B, P]
    return (emissions * transitions[:, None]).sum(-1).T / H


def extended(tokens: torch.Tensor, t: int) -> torch.Tensor:
    """[B * V, t + 2] each prefix tokens[:, :t+1] followed by every token v (b-major)."""
    B = tokens.shape[0]
    prefix = tokens[:, : t + 1].repeat_interleave(V, dim=0)
    return torch.cat([prefix, torch.arange(V).repeat(B)[:, None]], dim=1)


def brute_predictive(tokens: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_k(x_<=t) [B, T, K], p_k(x_{t+1} = v | x_<=t) [B, T, K, V]) by brute force."""
    B, K = tokens.shape[0], params.shape[0]
    prefix = torch.stack([path_sum(tokens[:, : t + 1], params) for t in range(tokens.shape[1])], dim=1)
    joint = torch.stack(
        [path_sum(extended(tokens, t), params).view(B, V, K).transpose(1, 2) for t in range(tokens.shape[1])], dim=1
    )
    return prefix, joint / prefix[..., None]


def dirichlet_log_moment(counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """[...] log E[prod_i p_i ** counts_i] for p ~ Dirichlet(alpha, ..., alpha); counts: [..., n]."""
    n, counts = counts.shape[-1], counts.double()
    return (
        math.lgamma(n * alpha)
        - torch.lgamma(n * alpha + counts.sum(-1))
        + (torch.lgamma(alpha + counts) - math.lgamma(alpha)).sum(-1)
    )


def prior_marginal(tokens: torch.Tensor) -> torch.Tensor:
    """[B] p(tokens) under the continuous prior, exactly: given a hidden path the prior expectation
    factorises into one Dirichlet moment per transition row and per emission row."""
    paths = hidden_paths(tokens.shape[1])  # [P, L]
    trans_counts = F.one_hot(paths[:, :-1] * H + paths[:, 1:], H * H).sum(1).view(-1, H, H)  # [P, H, H]
    emit_counts = (
        F.one_hot(paths[None] * V + tokens[:, None], H * V).sum(2).view(tokens.shape[0], -1, H, V)
    )  # [B, P, H, V]
    log_path = dirichlet_log_moment(trans_counts, ALPHA).sum(-1) + dirichlet_log_moment(emit_counts, ALPHA).sum(
        -1
    )  # [B, P]
    return log_path.exp().sum(-1) / H


@pytest.fixture(scope="module")
def family() -> HMM:
    return small_family()


@pytest.fixture(scope="module")
def draws(family):
    """(params [4, H, H + V], tokens [6, T]): tasks from the prior, and sequences of those tasks
    beside uniformly random ones (which visit unlikely tokens too)."""
    gen = torch.Generator().manual_seed(11)
    params = family.sample_params(4, gen)
    tokens = torch.cat([family.sample_tokens(params[:3], T, gen), torch.randint(0, V, (3, T), generator=gen)])
    return params, tokens


# ---- 1. the forward algorithm against brute force ------------------------------------------
def test_sequence_likelihood_matches_path_enumeration(family, draws):
    params, tokens = draws
    forward = family.step_log_likelihood(tokens, params).cumsum(dim=1)  # [B, T, K]
    brute = torch.stack([path_sum(tokens[:, : t + 1], params) for t in range(T)], dim=1).log()
    torch.testing.assert_close(forward, brute, rtol=0, atol=1e-10)


def test_next_token_predictive_matches_path_enumeration(family, draws):
    params, tokens = draws
    _, brute = brute_predictive(tokens, params)  # [B, T, K, V]
    for k in range(params.shape[0]):
        onehot = F.one_hot(torch.full(tokens.shape, k), params.shape[0]).double()
        torch.testing.assert_close(family.mix_predictive(tokens, params, onehot), brute[:, :, k], rtol=0, atol=1e-10)


# ---- 2. sampling --------------------------------------------------------------------------------
def test_sequences_follow_the_models_own_probabilities(family, draws):
    """Frequencies of every length-3 sequence of one task over N draws against its probability
    under the forward algorithm (checked above): each within 5 binomial standard errors,
    sqrt(p (1 - p) / N). This covers the first token, the emissions and two transitions."""
    params, N, L = draws[0][:1], 60_000, 3
    tokens = family.sample_tokens(params.expand(N, -1, -1), L, torch.Generator().manual_seed(5))
    counts = torch.bincount((tokens * torch.tensor([V * V, V, 1])).sum(-1), minlength=V**L).double()
    every = torch.tensor(list(itertools.product(range(V), repeat=L)))
    p = family.step_log_likelihood(every, params).sum(1).squeeze(-1).exp()  # [V**L]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert ((counts / N - p).abs() <= 5 * (p * (1 - p) / N).sqrt()).all()


def test_prior_draws_are_dirichlet_rows(family):
    """Rows sum to one; the mean of each entry over n draws is 1/H (transitions) or 1/V
    (emissions) within 5 standard errors, sqrt((1/m)(1 - 1/m) / (m ALPHA + 1) / n) for
    Dirichlet(ALPHA) rows of length m."""
    n = 20_000
    params = family.sample_params(n, torch.Generator().manual_seed(2))
    assert params.shape == (n, H, H + V) and params.dtype == torch.float64
    for rows, m in ((params[..., :H], H), (params[..., H:], V)):
        torch.testing.assert_close(rows.sum(-1), torch.ones(n, H, dtype=torch.float64))
        sd = math.sqrt((1 / m) * (1 - 1 / m) / (m * ALPHA + 1) / n)
        assert ((rows.mean(0) - 1 / m).abs() <= 5 * sd).all()


def test_seeded_sampling_is_reproducible(family):
    pool = family.sample_pool(3, 4, 0.1, seed=0)
    assert torch.equal(pool.params, family.sample_pool(3, 4, 0.1, seed=0).params)
    first, again, other = (family.sample(pool, 8, 12, seed=s, step=2) for s in (3, 3, 4))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.task, again.task)
    assert not torch.equal(first.tokens, other.tokens)
    ood, ood_again = family.sample_ood(8, 12, seed=1), family.sample_ood(8, 12, seed=1)
    assert torch.equal(ood.tokens, ood_again.tokens) and torch.equal(ood.params, ood_again.params)
    assert torch.equal(family.bank, small_family().bank)  # the OOD bank: one for every construction


# ---- 3. exact Bayes over a pool ----------------------------------------------------------------
def test_pool_posterior_predictive_matches_brute_force_mixture(family):
    pool = family.sample_pool(3, 2, 0.1, seed=4)  # unequal prior: majors 0.3 each, minors 0.05
    tokens = family.sample(pool, 6, T, seed=1).tokens
    prefix, next_token = brute_predictive(tokens, pool.params)  # [B, T, K], [B, T, K, V]
    posterior = prefix * pool.weights
    posterior = posterior / posterior.sum(-1, keepdim=True)
    torch.testing.assert_close(family.log_posterior(tokens, pool).exp(), posterior, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        family.predict_id(tokens, pool), (posterior[..., None] * next_token).sum(2), rtol=0, atol=1e-10
    )


# ---- 4. the OOD predictor ----------------------------------------------------------------------
def test_ood_predictor_is_exact_bayes_over_its_bank():
    """600 draws: three chunks of the forward pass (256, 256, 88), combined by their evidence."""
    family = small_family(ood_bank=600)
    tokens = family.sample_ood(5, 12, seed=3).tokens
    bank = TaskPool(family.bank, torch.full((600,), 1 / 600, dtype=torch.float64), n_major=600)
    ood = family.predict_ood(tokens)
    torch.testing.assert_close(ood, family.predict_id(tokens, bank), rtol=0, atol=1e-12)
    torch.testing.assert_close(ood.sum(-1), torch.ones(5, 12, dtype=torch.float64))


def exact_prior_predictive(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, V] p(x_{t+1} = v | x_<=t) under the continuous prior, exactly."""
    return torch.stack(
        [
            prior_marginal(extended(tokens, t)).view(-1, V) / prior_marginal(tokens[:, : t + 1])[:, None]
            for t in range(tokens.shape[1])
        ],
        dim=1,
    )


def test_ood_predictor_estimates_the_continuous_prior_predictive(family):
    """Against p(x_{t+1} | x_<=t) under the continuous prior, computed exactly by enumeration:
    each value within 5 standard errors of the self-normalised importance-sampling estimate,
    sqrt(sum_k w_k**2 (f_k - f_hat)**2), from the same bank (w_k the normalised posterior
    weights, f_k the bank task's predictive, both by brute force)."""
    tokens = family.sample_ood(6, T, seed=7).tokens
    ood = family.predict_ood(tokens)  # [B, T, V]
    exact = exact_prior_predictive(tokens)
    torch.testing.assert_close(exact.sum(-1), torch.ones(6, T, dtype=torch.float64))
    prefix, next_token = brute_predictive(tokens, family.bank)  # [B, T, M], [B, T, M, V]
    w = prefix / prefix.sum(-1, keepdim=True)
    torch.testing.assert_close(ood, (w[..., None] * next_token).sum(2), rtol=0, atol=1e-10)
    se = ((w[..., None] * (next_token - ood[:, :, None])) ** 2).sum(2).sqrt()
    assert ((ood - exact).abs() <= 5 * se).all(), ((ood - exact).abs() / se).max()


def test_ood_predictor_error_shrinks_with_the_bank(family):
    """Monte Carlo error against the exact predictive falls as 1/sqrt(M): from M = 64 to 4096 by 8
    in expectation; the mean absolute error must fall by at least 2."""
    tokens = family.sample_ood(6, T, seed=8).tokens
    exact = exact_prior_predictive(tokens)
    small, large = ((small_family(M).predict_ood(tokens) - exact).abs().mean() for M in (64, 4096))
    assert large < small / 2, (small, large)


# ---- the recipe and the registry ---------------------------------------------------------------
def test_recipe_builds_the_family_through_the_registry():
    config = load_config(RECIPE, "tiny")
    family = build_family(config.task)
    assert isinstance(family, HMM) and config.task.family == "hmm"
    assert (family.vocab_size, family.n_hidden, family.bank.shape) == (8, 3, (2048, 3, 11))
    with pytest.raises(ConfigError, match="n_hiden"):
        load_config(RECIPE, "tiny", ["task.n_hiden=4"])
    with pytest.raises(ConfigError, match="n_hidden"):
        load_config(RECIPE, "tiny", ["task.n_hidden=1"])


# ---- 5. the plain taskgeom command ------------------------------------------------------------
def taskgeom(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """``taskgeom ARGS`` as a user types it (the venv's script), in ``cwd``."""
    command = shutil.which("taskgeom", path=str(Path(sys.executable).parent)) or shutil.which("taskgeom")
    assert command, "the taskgeom command is not installed"
    env = {**os.environ, "TASKGEOM_DEBUG": "1"}  # a failure shows its traceback in the assertion
    return subprocess.run([command, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def check(result: subprocess.CompletedProcess, codes: tuple[int, ...] = (0,)) -> None:
    """The command exited with one of ``codes``; else fail with the end of its output."""
    assert result.returncode in codes, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of the tiny profile: train prints its run directory last."""
    root = tmp_path_factory.mktemp("hmm-cli")
    result = taskgeom("train", RECIPE, "--profile", "tiny", "--out", "runs", "--device", "cpu", cwd=root)
    check(result)
    run = root / result.stdout.strip().splitlines()[-1]
    assert run.parent == root / "runs" and run.name.startswith("hmm-")
    return run


def test_cli_train(trained):
    assert (trained / "run.json").is_file() and (trained / "model.safetensors").is_file()
    steps = [json.loads(line).get("step") for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert 30 in steps  # the tiny profile's last step was reached and logged


def test_cli_eval_and_analyze(trained):
    check(taskgeom("eval", trained, cwd=trained.parent))
    table = pd.read_json(trained / "analysis" / "eval.json")
    assert {"loss", "bayes_id_loss", "bayes_ood_loss"} <= set(table["metric"]) and table["value"].notna().all()
    check(taskgeom("analyze", trained, cwd=trained.parent))
    assert (trained / "analysis" / "m1.json").is_file() and len(pd.read_json(trained / "analysis" / "m1.json")) > 0


def test_cli_sweep_on_two_workers(tmp_path):
    """Two worker processes: each must find the plugin through its entry point."""
    result = taskgeom(
        "sweep",
        RECIPE,
        "--profile",
        "tiny",
        "--diversity",
        "-1,1",
        "--seeds",
        "0",
        "--workers",
        "2",
        "--device",
        "cpu",
        "--out",
        "sweep",
        cwd=tmp_path,
    )
    check(result)
    table = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    assert sorted(zip(table["recipe"], table["diversity"], table["status"])) == [("hmm", -1, "ok"), ("hmm", 1, "ok")]


def test_cli_sweep_on_ray(tmp_path):
    """Ray tasks run in Ray's own worker processes: each must find the plugin through its entry point."""
    pytest.importorskip("ray")
    result = taskgeom(
        "sweep",
        RECIPE,
        "--profile",
        "tiny",
        "--diversity",
        "-1",
        "--seeds",
        "0",
        "--executor",
        "ray",
        "--workers",
        "1",
        "--cpus-per-run",
        "1",
        "--device",
        "cpu",
        "--out",
        "sweep",
        cwd=tmp_path,
    )
    check(result)
    table = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    assert list(zip(table["recipe"], table["diversity"], table["status"])) == [("hmm", -1, "ok")]


def test_cli_reproduce_only_this_recipe(tmp_path):
    """Exit 0 or 1: tiny models may fail claims (exit 1 is "the work ran and some claims failed"),
    so the runs themselves are checked: every sweep run ok. Every claim is the recipe's own, each
    experiment of its study section gave some, and the report has its section."""
    result = taskgeom(
        "reproduce",
        "--recipe",
        RECIPE,
        "--only",
        "hmm",
        "--profile",
        "tiny",
        "--seeds",
        "0",
        "--device",
        "cpu",
        "--out",
        "results",
        cwd=tmp_path,
    )
    check(result, (0, 1))
    results = tmp_path / "results"
    claims = json.loads((results / "claims.json").read_text())
    assert claims and all(claim["id"].startswith("hmm.") for claim in claims)
    assert any(claim["status"] in ("pass", "fail", "unstable") for claim in claims)
    reproduction = json.loads((results / "reproduction.json").read_text())
    assert set(reproduction["claims"].values()) == {"bayes_optimum", "m1", "dual_modes"}
    sweep = pd.read_csv(results / "tables" / "sweep.csv")
    assert len(sweep) > 0 and set(sweep["recipe"]) == {"hmm"} and (sweep["status"] == "ok").all()
    assert "HMM: mixture of hidden Markov models" in (results / "report.html").read_text()

"""Quantities that had no test against an independent value: P3's per-position and per-quarter
medians, the predictor-transition statistic, the Theorem-2 quantities, the E4 claims and the exit
codes of ``reproduce``. Each is computed here by hand (plain loops, numpy, closed forms) on a
planted case and compared with what the package measures."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import taskgeom.experiments
from taskgeom.analysis.geometry import Alignment
from taskgeom.analysis.measures.task_vectors import late_window
from taskgeom.analysis.measures.theory import theorem2
from taskgeom.analysis.measures.transition import predict_generalising, reference_predictors, transition_statistic
from taskgeom.analysis.measures.variants import protocol
from taskgeom.analysis.protocol import STUDY
from taskgeom.analysis.stored.m1 import alignment_rows
from taskgeom.claims.catalog import spec
from taskgeom.claims.registry import Experiment
from taskgeom.claims.rules import check
from taskgeom.cli import app
from taskgeom.errors import EnvironmentRefused, TaskgeomError, TrainingDiverged
from taskgeom.experiments.base import Context
from taskgeom.settings.recipes import load_study
from taskgeom.tasks import TaskPool, make

# ---------------------------------------------------------------- P3: medians per position and per quarter


def _planted_alignment(N: int = 5, T: int = 12, K: int = 3):
    """beta, alpha: [N, T, K] Dirichlet draws; alpha uncertain at positions 0..7 and one-hot on the
    sequence's task from 8 on; TV grows with the position, so a wrong span changes every median."""
    gen = torch.Generator().manual_seed(7)
    task = torch.tensor([0, 1, 2, 0, 1])[:N]
    gamma = torch._standard_gamma(torch.full((N, T, K), 2.0, dtype=torch.float64), gen)
    alpha = gamma / gamma.sum(-1, keepdim=True)
    alpha[:, :8] = 0.6 * alpha[:, :8] + 0.4 / K  # max below 0.99
    alpha[:, 8:] = torch.nn.functional.one_hot(task, K).double()[:, None]
    noise = torch._standard_gamma(torch.ones(N, T, K, dtype=torch.float64), gen)
    weight = torch.linspace(0.05, 0.9, T, dtype=torch.float64)[None, :, None]
    beta = (1 - weight) * alpha + weight * noise / noise.sum(-1, keepdim=True)
    return beta, alpha, task


def test_p3_rows_are_medians_and_quartiles_over_the_stated_positions_and_sequences():
    beta, alpha, task = _planted_alignment()
    N, T, K = beta.shape
    window = late_window(T)
    assert (window.start, window.stop) == (9, 12)
    p3 = Alignment.of(beta.float(), beta, alpha, task, window)
    rows, shrink = alignment_rows((1, "resid_mid"), p3, task), p3.shrinkage
    b, al = beta.float().double().numpy(), alpha.numpy()
    tv = np.array([[0.5 * sum(abs(b[n, t, k] - al[n, t, k]) for k in range(K)) for t in range(T)] for n in range(N)])
    smooth = (b + STUDY.kl_floor / K) / (1 + STUDY.kl_floor)
    kl = np.array(
        [
            [
                sum(al[n, t, k] * math.log(al[n, t, k] / smooth[n, t, k]) for k in range(K) if al[n, t, k] > 0)
                for t in range(T)
            ]
            for n in range(N)
        ]
    )
    got = {(r["metric"], r["position"], r["task"]): r for r in rows}
    for metric, values in (("p3.tv", tv), ("p3.kl", kl)):
        for t in range(T):
            for k in (None, 0, 1, 2):
                chosen = values[:, t] if k is None else values[task.numpy() == k, t]
                med, low, high = np.percentile(chosen, [50, 25, 75])
                row = got[(metric, t, k)]
                assert row["value"] == pytest.approx(med, rel=1e-9, abs=1e-12), (metric, t, k)
                assert row["band"] == pytest.approx([low, high], rel=1e-9, abs=1e-12), (metric, t, k)
        for part, span in (("first_quarter", range(0, 3)), ("last_quarter", range(9, 12))):
            flat = values[:, list(span)].reshape(-1)
            med, low, high = np.percentile(flat, [50, 25, 75])
            row = got[(f"{metric}_{part}", None, None)]
            assert row["value"] == pytest.approx(med, rel=1e-9), (metric, part)
            assert row["band"] == pytest.approx([low, high], rel=1e-9), (metric, part)
    assert got[("p3.tv_last_quarter", None, None)]["value"] > got[("p3.tv_first_quarter", None, None)]["value"]
    # the claim: per task, the mean beta (on the simplex already) against the mean posterior
    k = task.numpy()
    mean_tv = np.array(
        [
            [0.5 * np.abs(beta.numpy()[k == m, t].mean(0) - al[k == m, t].mean(0)).sum() for t in range(T)]
            for m in range(K)
        ]
    )
    for t in range(T):
        assert got[("p3.tv_mean_beta", t, None)]["value"] == pytest.approx(mean_tv[:, t].mean(), rel=1e-9)
        for m in range(K):
            assert got[("p3.tv_mean_beta", t, m)]["value"] == pytest.approx(mean_tv[m, t], rel=1e-9)
    assert got[("p3.tv_mean_beta", None, None)]["value"] == pytest.approx(mean_tv[:, 9:12].mean(), rel=1e-9)
    # P3.shrinks on the mean curves: 8 uncertain positions (0..7), quarters of 2
    assert got[("p3.uncertain_positions", None, None)]["value"] == 8 and shrink.positions == list(range(8))
    assert got[("p3.tv_first_uncertain", None, None)]["value"] == pytest.approx(mean_tv[:, [0, 1]].mean(), rel=1e-9)
    assert got[("p3.tv_last_uncertain", None, None)]["value"] == pytest.approx(mean_tv[:, [6, 7]].mean(), rel=1e-9)
    assert all((r["batch"], r["set"], r["layer"], r["site"]) == ("measure", "major", 1, "resid_mid") for r in rows)
    assert len(rows) == 1 + (1 + K) * T + 2 * (4 * T + 2) + 3
    summary = alignment_rows((1, "resid_mid"), p3, task, per_position=False)
    assert [r for r in rows if r["position"] is None] == summary


# ---------------------------------------------------------------- the predictor transition


def test_transition_statistic_on_a_case_computed_by_hand():
    """Dice with two faces: majors A, B and one minor C (p_minor = 0.1). Memorising: Bayes over
    {A, B, C}; generalising: Bayes over {A, B, a new task with the uniform Beta prior}, whose
    evidence and prediction follow Laplace's rule. KL(model || reference) as the study's
    ``_kl_model_to_ref`` (both clamped at 1e-12), averaged over the positions that have a next
    token and then over the sequences."""
    params = [[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]]
    weights = [0.45, 0.45, 0.1]
    pool = TaskPool(torch.tensor(params, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64), n_major=2)
    family = make("dice", vocab_size=2, alpha=1.0, majors="prior")
    tokens = torch.tensor([[0, 0, 1, 0], [1, 1, 1, 0]])
    logits = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(0))
    model = torch.softmax(logits.double(), -1).tolist()

    def mixture(components: list[tuple[float, list[float]]]) -> list[float]:
        total = sum(w for w, _ in components)
        return [sum(w * p[v] for w, p in components) / total for v in range(2)]

    to_mem, to_gen = [], []
    for b, seq in enumerate(tokens.tolist()):
        for t in range(3):  # positions 0..T-2
            seen = seq[: t + 1]
            like = [math.prod(params[k][x] for x in seen) for k in range(3)]
            memorising = mixture([(weights[k] * like[k], params[k]) for k in range(3)])
            evidence = math.prod(
                (seen[:i].count(x) + 1) / (i + 2) for i, x in enumerate(seen)
            )  # Laplace's rule, sequentially
            laplace = [(seen.count(v) + 1) / (len(seen) + 2) for v in range(2)]
            generalising = mixture(
                [(0.45 * like[0], params[0]), (0.45 * like[1], params[1]), (0.1 * evidence, laplace)]
            )
            for reference, out in ((memorising, to_mem), (generalising, to_gen)):
                out.append(sum(m * math.log(m / r) for r, m in zip(reference, model[b][t])))
    kl_mem, kl_gen = sum(to_mem) / len(to_mem), sum(to_gen) / len(to_gen)
    references = reference_predictors(family, tokens, pool, p_new=0.1)
    stat = transition_statistic(logits, *references)
    assert stat["kl_to_memorising"] == pytest.approx(kl_mem, rel=1e-6)
    assert stat["kl_to_generalising"] == pytest.approx(kl_gen, rel=1e-6)
    assert stat["log_ratio"] == pytest.approx(math.log(kl_mem / kl_gen), rel=1e-5, abs=1e-7)
    assert abs(stat["log_ratio"]) > 1e-3  # the two predictors differ on this case

    # a model that is the generalising predictor itself: KL 0 to it
    exact = torch.tensor(
        [
            [
                mixture(
                    [(0.45 * math.prod(params[k][x] for x in seq[: t + 1]), params[k]) for k in range(2)]
                    + [
                        (
                            0.1 * math.prod((seq[:i].count(x) + 1) / (i + 2) for i, x in enumerate(seq[: t + 1])),
                            [(seq[: t + 1].count(v) + 1) / (t + 3) for v in range(2)],
                        )
                    ]
                )
                for t in range(4)
            ]
            for seq in tokens.tolist()
        ],
        dtype=torch.float64,
    )
    perfect = transition_statistic(exact.log().float(), *references)
    assert perfect["kl_to_generalising"] == pytest.approx(0.0, abs=1e-6)
    assert perfect["log_ratio"] > 5


def test_with_no_minor_mass_the_generalising_predictor_is_bayes_over_the_majors():
    family = make("dice", vocab_size=3, majors="prior")
    pool = family.sample_pool(3, 2, 0.0, seed=0)
    tokens = family.sample_ood(4, 6, seed=0).tokens
    expected = family.predict_id(tokens, pool.subset("major"))
    torch.testing.assert_close(predict_generalising(family, tokens, pool, 0.0), expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- Theorem 2 on a linear readout


def test_theorem2_quantities_of_a_linear_isometric_readout():
    """The readout h -> h @ W^T with W = Q + 1 b^T: its centred logits are Q h, where Q [4, 3] has
    orthonormal columns summing to zero, so the readout is an isometry onto the centred logits
    (L = 1). With S = span(e1) through mu and OOD-optimal CLR vectors Q z*: c = the distance of
    z* - mu from span(e1), delta = |z* - h|, distance = the distance of h - mu from span(e1). The
    prior predictions' CLR vectors are Q (+-2 e1), Q (+-1 e2): participation ratio (4 + 1)^2 / (16 + 1)."""
    Q = torch.tensor(
        [
            [1 / math.sqrt(2), 1 / math.sqrt(6), 1 / math.sqrt(12)],
            [-1 / math.sqrt(2), 1 / math.sqrt(6), 1 / math.sqrt(12)],
            [0.0, -2 / math.sqrt(6), 1 / math.sqrt(12)],
            [0.0, 0.0, -3 / math.sqrt(12)],
        ]
    )
    assert torch.allclose(Q.T @ Q, torch.eye(3), atol=1e-6) and torch.allclose(Q.sum(0), torch.zeros(3), atol=1e-6)
    W = Q + torch.ones(4, 1) * torch.tensor([[0.7, -1.3, 2.0]])
    readout = lambda h: h @ W.T + 0.25  # noqa: E731
    gen = torch.Generator().manual_seed(4)
    N = 5
    h, mu, z = (torch.randn(N, 3, generator=gen) for _ in range(3))
    basis = torch.tensor([[1.0], [0.0], [0.0]])
    ood_optimal = torch.softmax((z @ Q.T).double(), -1)
    prior = torch.softmax(torch.tensor([[2.0, 0, 0], [-2.0, 0, 0], [0, 1.0, 0], [0, -1.0, 0]]) @ Q.T, -1).double()
    result = theorem2(readout, h, mu, basis, readout(h), ood_optimal, prior)

    off_s = lambda v: v[:, 1:].norm(dim=-1)  # noqa: E731  distance from span(e1)
    c, delta, distance = off_s(z - mu), (z - h).norm(dim=-1), off_s(h - mu)
    assert result["k_star"] == 1
    assert result["d0"] == pytest.approx(25 / 17, rel=1e-5)
    assert result["lipschitz"] == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(result["c"], c, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(result["delta"], delta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result["distance"], distance, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result["bound"], c - delta, atol=1e-4, rtol=1e-4)
    assert (result["distance"] >= result["bound"] - 1e-4).all()  # the triangle inequality the theorem rests on

    # doubling the readout's slope doubles L and every gap, and halves nothing else
    steep = lambda v: 2 * readout(v)  # noqa: E731
    doubled = theorem2(steep, h, mu, basis, steep(h), torch.softmax((2 * z @ Q.T).double(), -1), prior)
    assert doubled["lipschitz"] == pytest.approx(2.0, rel=1e-5)
    torch.testing.assert_close(doubled["c"], 2 * c, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(doubled["bound"], c - delta, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- the E4 claims


def _probe(site: str, layer: int, target: str, score: float, control: float, which: str = "pool") -> dict:
    return {
        "set": which,
        "site": site,
        "layer": layer,
        "target": target,
        "metric": "accuracy",
        "score": score,
        "control": control,
    }


@pytest.mark.parametrize("e4_shares, status", [((0.3, 0.12), "pass"), ((0.3, 0.08), "fail")])
def test_e4_claims_read_planted_shares_and_probes_at_the_m1_block(tmp_path, monkeypatch, e4_shares, status):
    """e4.P0_failure = the median over brackets of E4's residual variance ratio at resid_mid of its
    M1 block (block 1 of 2: the study's block 3 of 6; ``studies.e4.variance``), divided by the
    larger of E1's and E3's 1 - P0 (their M1 claims'); the earlier construction's ratio beside it
    (E4's share on natural states at resid_post, the smaller of its two groupings, over the larger
    reference share at theirs). e4.prefix_probe = the smallest over prefix lengths of the study's
    probe's accuracy minus its shuffled-label control's (block 1 of 2, the study's block 5 of 6), the
    earlier construction's value (the weakest linear probe at resid_post of the M1 block) beside it.
    Other layers and sites hold numbers that would give other answers."""
    e4 = importlib.import_module("taskgeom.studies.e4.experiment")
    residual = torch.tensor(
        [[0.9, 0.9, 0.9, 0.9], [0.9, e4_shares[1] - 0.01, 0.01, e4_shares[1] + 0.01]], dtype=torch.float64
    )  # layer 1's median: e4_shares[1]
    within = {"e1": 0.02, "e3": 0.03}
    references = {
        "e1": {"resid_mid": [0.05, 0.9], "resid_post": [0.5, 0.02]},
        "e3": {"resid_mid": [0.04, 0.9], "resid_post": [0.4, 0.03]},
    }
    dyck = {
        "resid_post": {
            "token_due": [0.001, e4_shares[0]],
            "last3_due": [0.001, e4_shares[1]],
            "token_late": [0.9, 0.9],
            "last3_late": [0.9, 0.9],
        },
        "resid_mid": {
            "token_due": [0.001, 0.001],
            "last3_due": [0.001, 0.001],
            "token_late": [0.001, 0.001],
            "last3_late": [0.001, 0.001],
        },
    }
    trained_rows = {
        "pool": [
            _probe("resid_post", 1, "back_1", 0.9, 0.5),
            _probe("resid_post", 1, "depth", 0.35, 0.1),  # depth, 0.25: the weakest
            _probe("resid_post", 0, "back_1", 0.55, 0.5),
            _probe("resid_post", 0, "depth", 0.9, 0.1),  # another layer: not read
            _probe("resid_mid", 1, "depth", 0.1, 0.1),
            _probe("resid_mid", 1, "back_1", 0.5, 0.5),
        ],  # another site: not read
        "ood": [_probe("resid_post", 1, "back_1", 0.5, 0.5, "ood"), _probe("resid_post", 1, "depth", 0.0, 0.0, "ood")],
    }
    untrained_rows = [
        _probe("resid_post", 1, "back_1", 0.6, 0.5),
        _probe("resid_post", 1, "depth", 0.08, 0.01),
        _probe("resid_post", 0, "back_1", 0.5, 0.5),
        _probe("resid_post", 0, "depth", 0.0, 0.0),
    ]
    study_probe = {
        "probe": SimpleNamespace(
            accuracy={2: 0.95, 3: 0.6, 4: 0.7},
            loss={2: 0.1, 3: 0.9, 4: 0.8},
            best_epoch=1990,
            epochs=2000,
            reached=4,
            kept_lengths=(2, 3, 4),
            chance={2: 0.5, 3: 0.3, 4: 0.25},
        ),
        "control": SimpleNamespace(
            accuracy={2: 0.7, 3: 0.4, 4: 0.25},
            loss={2: 0.6, 3: 1.1, 4: 1.4},
            best_epoch=10,
            epochs=2000,
            reached=3,
            kept_lengths=(2,),
            chance={2: 0.5, 3: 0.3, 4: 0.25},
        ),
    }  # the lengths the kept probe trained, 2-4: l = 2 the weakest, 0.95 against the control's 0.7 (its kept
    # snapshot trained l = 2 only), l = 3 and 4 against their chance levels 0.3 and 0.25
    trained, untrained = object(), object()
    runs = {}

    def fake_trained(self, recipe, overrides=(), seed=0):
        runs[(recipe, overrides)] = run = SimpleNamespace(
            recipe=recipe,
            config=SimpleNamespace(model=SimpleNamespace(n_layers=2)),
            family=SimpleNamespace(m1_block=(3, 6)),
            load_model=lambda: trained,
            new_model=lambda: untrained,
        )
        return run

    monkeypatch.setattr(Context, "trained", fake_trained)
    monkeypatch.setattr(e4, "study_p0", lambda run: residual)
    monkeypatch.setattr(e4, "reference_within", lambda run: within[run.recipe])
    monkeypatch.setattr(e4, "plot_p0_positions", lambda *a, **k: None)
    monkeypatch.setattr(e4, "reference_p0", lambda run: references[run.recipe])
    monkeypatch.setattr(e4, "dyck_p0", lambda run: dyck)
    monkeypatch.setattr(
        e4,
        "prefix_probes",
        lambda run, model, which, **kw: (
            trained_rows[which]
            if model is trained
            else untrained_rows
            if which == "pool"
            else [{**r, "set": "ood", "score": r["control"] + 0.5} for r in untrained_rows]
        ),
    )
    monkeypatch.setattr(e4, "plot_p0_comparison", lambda *a, **k: None)
    monkeypatch.setattr(e4, "plot_prefix_probes", lambda *a, **k: None)
    monkeypatch.setattr(e4, "study_prefix_probe", lambda run: study_probe)
    monkeypatch.setattr(e4, "plot_study_probe", lambda *a, **k: None)

    ctx = Context(tmp_path, "quick")
    e4.measure_study(ctx, load_study("e4"), ("e1", "e3"))
    claims = {c.id: c for _, c in ctx.measured}
    assert list(claims) == ["e4.P0_failure", "e4.prefix_probe"]
    p0 = claims["e4.P0_failure"]
    median = e4_shares[1]
    assert p0.value == pytest.approx(median / 0.03, rel=1e-12)
    assert p0.parts == {
        "e4_share": pytest.approx(median, rel=1e-12),
        "reference_share": 0.03,
        "layer": 1,
        "site": "resid_mid",
        "brackets": 4,
        "e1_share": 0.02,
        "e3_share": 0.03,
        "natural_cells_ratio": pytest.approx(e4_shares[1] / 0.03, rel=1e-12),
    }
    assert (p0.threshold, p0.comparison, p0.status) == (spec("e4", "P0_failure").threshold, ">=", status)
    probe = claims["e4.prefix_probe"]
    assert probe.value == pytest.approx(0.25, rel=1e-12) and probe.status == "pass"
    assert probe.parts == {
        "lengths": "2,3,4",
        "lengths_trained": "2,3,4",
        "lengths_not_read_chance_above_0.9": "",
        "controls_at_chance": "3,4",
        "finished": True,
        "diversity": 10,
        "length": 2,
        "accuracy": 0.95,
        "control": 0.7,
        "curriculum_reached": 4,
        "layer": 1,
        "site": "resid_mid",
        "linear_probe_gain": pytest.approx(0.25, rel=1e-12),
    }
    assert (probe.threshold, probe.comparison) == (spec("e4", "prefix_probe").threshold, ">=")
    assert set(runs) == {
        ("e4", ("task.diversity=-1",)),
        ("e4", ("task.diversity=10",)),  # the top of quick's grid
        ("e1", ("task.diversity=-1",)),
        ("e3", ("task.diversity=-1",)),
    }
    written = json.loads((tmp_path / "analysis" / "e4.json").read_text())
    assert {row.pop("seed") for name in ("p0", "probes", "probes_ood") for row in written[name]} == {0}
    for site in ("resid_mid", "resid_post"):
        series = {
            "e1": references["e1"][site],
            "e3": references["e3"][site],
            **{f"e4_{k}": v for k, v in dyck[site].items()},
        }
        at = [row for row in written["p0"] if row["site"] == site]
        assert {(r["series"], r["layer"]): r["value"] for r in at} == {
            (name, layer): v for name, values in series.items() for layer, v in enumerate(values)
        }
    assert written["probes"] == trained_rows["pool"] and written["probes_ood"] == trained_rows["ood"]
    assert {(r["probe"], r["metric"], r["length"]): r["value"] for r in written["prefix_probe"]} == {
        (name, f"prefix_probe.{metric}", length): value
        for name, result in study_probe.items()
        for metric, values in (("accuracy", result.accuracy), ("loss", result.loss))
        for length, value in values.items()
    }
    assert {(r["layer"], r["site"]) for r in written["prefix_probe"]} == {(1, "resid_mid")}
    assert {(r["layer"], r["bracket"]): r["value"] for r in written["p0_brackets"]} == {
        (layer, j): float(residual[layer, j]) for layer in range(2) for j in range(4)
    }
    assert {r["series"]: r["value"] for r in written["p0_references"]} == within


# ---------------------------------------------------------------- reproduce's exit codes


def _raiser(error: Exception):
    def experiment(ctx: Context) -> None:
        ctx.claim(0, check("x.ok", "x", "a claim before the error", 1.0, ">=", 0.5))
        raise error

    return experiment


@pytest.mark.parametrize(
    "options, message",
    [
        (["--profile", "huge"], "unknown profile 'huge'"),
        (["--only", "e9"], "--only: unknown experiments or recipes ['e9']"),
        (["--executor", "dask"], "unknown executor 'dask'"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_reproduce_exits_2_on_bad_input_before_writing(tmp_path, monkeypatch, options, message):
    ran = []
    monkeypatch.setattr(taskgeom.experiments, "declared", lambda studies, profile: {"fake": ran.append})
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path / "out"), *options])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not ran and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "error, code",
    [
        (TaskgeomError("recipe e1: task.seq_len must be positive"), 2),
        (EnvironmentRefused("no space left on device: results/runs"), 3),
        (TrainingDiverged("training diverged at step 7: the loss is nan"), 1),
    ],
)
def test_reproduce_exit_code_says_what_stopped_it(tmp_path, monkeypatch, error, code):
    """The contract of issue 12: 2 bad input, 3 the environment refused, 1 the work ran and failed;
    one line naming the problem, no traceback."""
    monkeypatch.setattr(
        taskgeom.experiments, "declared", lambda studies, profile: {"fake": Experiment("fake", (), _raiser(error))}
    )
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == code, result.output
    assert str(error) in result.output and "Traceback" not in result.output
    # exit codes 0 and 1 from the claims themselves: tests/test_claims.py


# ---------------------------------------------------------------- the M1 claims' values under the protocol and each variant


def test_claim_values_read_each_claim_at_its_place_under_the_protocol_and_the_variants():
    """Planted m1.json rows: every metric's value encodes (metric, layer, site), so a value read at
    the wrong place or from the wrong metric shows. E2-like: P3 reads its own block (9 of 16)."""
    from taskgeom.analysis.stored.rows import row
    from taskgeom.claims.m1 import claim_values

    metrics = [
        "p0.cell_r2",
        "p0.cell_r2_pooled",
        "p1.additive_share",
        "p1.additive_share_pooled",
        "p1.additive_share_last",
        "p2.r2_task",
        "p2.r2_random",
        "p2.r2_additive",
        "p2.r2_additive_random",
        "p2.post_layernorm",
        "p3.tv_mean_beta",
        "p3.tv_last_quarter",
        "p3.tv_first_uncertain",
        "p3.tv_last_uncertain",
    ]
    cells = [
        "p0.cell_r2_forced",
        "p0.within_share_forced",
        "p1.additive_share_forced",
        "cells.position",
        "cells.per_cell",
        "cells.tokens",
        "p2.r2_additive_forced",
        "p2.r2_additive_forced_random",
    ]
    trajectory = [
        "p3.tv_trajectory",
        "p3.trajectory_first",
        "p3.trajectory_last",
        "p3.trajectory_estimation_first",
        "p3.trajectory_estimation_last",
    ]
    every = metrics + cells + trajectory
    code = lambda metric, layer, site: every.index(metric) + layer / 100 + (0.001 if site == "resid_mid" else 0.0)  # noqa: E731
    batch = {
        **dict.fromkeys(metrics, "measure"),
        **dict.fromkeys(cells, "cells"),
        **dict.fromkeys(trajectory, "trajectory"),
    }
    rows = [
        row(metric, code(metric, layer, site), place=(layer, site), batch=batch[metric], set="major")
        for metric in every
        for layer in range(4)
        for site in ("resid_mid", "resid_post")
    ]
    rows += [
        row("p3.uncertain_positions", 7 if layer == 2 else 3, place=(layer, site), batch="measure", set="major")
        for layer in range(4)
        for site in ("resid_mid", "resid_post")
    ]
    rows += [
        row("place.m1", 1.0, place=(3, "resid_post"), batch="measure", set="major"),
        row("place.p3", 1.0, place=(2, "resid_post"), batch="measure", set="major"),
        row("place.selected", 0.9, place=(1, "resid_mid"), batch="select", set="major"),
        row(
            "p0.cell_r2", -1.0, place=(3, "resid_post"), batch="select", set="major"
        ),  # the selection batch: never read
        row("p0.cell_r2", -1.0, place=(3, "resid_post"), batch="measure", set="major", position=5),
    ]  # a curve: never read
    post, p3_post = (
        (3, "resid_post"),
        (2, "resid_post"),
    )  # the claims' places; the third entry: which P0/P1 rows are read
    cases = {
        None: (post, p3_post, "_forced"),
        "selected-place": ((1, "resid_mid"), (1, "resid_mid"), "_forced"),
        "site-mid": ((3, "resid_mid"), (2, "resid_mid"), "_forced"),
        "pooled-anova": (post, p3_post, "_pooled"),
        "p2-task-only": (post, p3_post, "_forced"),
        "natural-cells": (post, p3_post, ""),
        "p3-late-window": (post, p3_post, "_forced"),
    }
    for variant, (place, p3, kind) in cases.items():
        # None: the study's; P3.shrinks and P2.vs_random in their earlier forms, which read the planted codes as
        # they are (no trajectory curves here, codes above 1); the protocol's forms: tests/test_claim_forms.py
        earlier_forms = {"p3_shrinks_form": "mean-curves", "p2_random_form": "difference"}
        values = claim_values(rows, replace(protocol(variant), **earlier_forms))
        assert values["P0"].value == code(f"p0.cell_r2{kind}", *place), (
            variant
        )  # the forced cells, or the variant's reading
        assert values["P1"].value == code(f"p1.additive_share{kind}", *place), variant
        if variant == "p2-task-only":  # the earlier quantity: R^2_task, and against a random subspace's
            assert values["P2"].value == code("p2.r2_task", *place)
            assert values["P2.vs_random"].value == pytest.approx(
                code("p2.r2_task", *place) - code("p2.r2_random", *place)
            )
        else:  # the study's r2_additive on the forced cells (natural-cells: on natural states), R^2_task beside
            additive = "p2.r2_additive" + ("" if variant == "natural-cells" else "_forced")
            assert values["P2"].value == code(additive, *place) and values["P2"].parts["r2_task"] == code(
                "p2.r2_task", *place
            ), variant
            assert values["P2.vs_random"].value == pytest.approx(
                code(additive, *place) - code(f"{additive}_random", *place)
            ), variant
        p3_metric = "p3.tv_mean_beta" if variant == "p3-late-window" else "p3.tv_trajectory"
        assert values["P3"].value == code(p3_metric, *p3), variant
        assert all(
            (values[c].parts["layer"], values[c].parts["site"]) == place for c in ("P0", "P1", "P2", "P2.vs_random")
        ), variant
        assert (values["P3"].parts["layer"], values["P3"].parts["site"]) == p3, variant
        shrinks = values["P3.shrinks"]
        if p3[0] == 2:  # 7 uncertain positions: applies
            assert shrinks.reason is None
            assert shrinks.value == pytest.approx(
                code("p3.tv_last_uncertain", *p3) / code("p3.tv_first_uncertain", *p3)
            )
        else:  # 3 < 5: n/a, with the reason
            assert math.isnan(shrinks.value) and "at 3 position(s) only" in shrinks.reason

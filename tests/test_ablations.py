"""The S and V ablations of PAPER.md section 7 against independent computations: the probe's S
against a least-squares fit by hand, the block mean against the per-block rows, the search's V
against the spans it must avoid, and the random control's statistic by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from taskgeom.analysis.ablations import N_RANDOM_CONTROLS, ablation_rows, block_places, control_statistic, find_blocks
from taskgeom.analysis.dual import loss_sets
from taskgeom.analysis.probe import probe_basis
from taskgeom.analysis.study import StudyRun
from taskgeom.config import build_config
from taskgeom.errors import AnalysisError
from taskgeom.experiments.dual_modes import ablation_claims
from taskgeom.runs import Run
from taskgeom.train import train


def projector(basis: np.ndarray) -> np.ndarray:
    q, _ = np.linalg.qr(basis)
    return q @ q.T


@pytest.mark.parametrize("vocab", [5, None])
def test_the_probe_s_is_the_row_space_of_a_least_squares_fit_by_hand(vocab):
    """Planted h = pi W + onehot(x) A + b + noise (E2: x A with continuous x): S is the row space
    of W_task of numpy's least-squares fit of the same design (collinear: its minimum-norm solution)."""
    gen = torch.Generator().manual_seed(0)
    N, P, K, D = 40, 8, 3, 12
    alpha = torch._standard_gamma(torch.ones(N, P, K, dtype=torch.float64), gen)
    alpha = alpha / alpha.sum(-1, keepdim=True)
    current = torch.randint(0, vocab, (N, P), generator=gen) if vocab else torch.randn(N, P, 2, generator=gen, dtype=torch.float64)
    width = vocab or 2
    w, a, b = (torch.randn(n, D, generator=gen, dtype=torch.float64) for n in (K, width, 1))
    tokens = torch.nn.functional.one_hot(current, vocab).double() if vocab else current
    states = alpha @ w + tokens @ a + b + 0.01 * torch.randn(N, P, D, generator=gen, dtype=torch.float64)
    window = slice(4, 8)

    basis = probe_basis(states.float(), alpha, current, vocab, window)

    rows = lambda x: x[:, 4:8].reshape(-1, x.shape[-1]).numpy()  # noqa: E731
    design = np.concatenate([rows(alpha), rows(tokens), np.ones((N * 4, 1))], 1)
    fitted = np.linalg.lstsq(design, rows(states.float().double()), rcond=None)[0][:K]  # [K, D] W_task by hand
    assert basis.shape == (D, K)
    np.testing.assert_allclose(basis.T.numpy() @ basis.numpy(), np.eye(K), atol=1e-10)
    np.testing.assert_allclose(basis.numpy() @ basis.numpy().T, projector(fitted.T), atol=1e-6)
    # the fit recovers the planted task effects up to the one row the collinear design leaves free
    np.testing.assert_allclose(fitted - fitted.mean(0), (w - w.mean(0)).numpy(), atol=0.05)


def test_a_probe_whose_task_weights_collapse_is_refused():
    N, P, K, D = 10, 4, 3, 6
    alpha = torch.full((N, P, K), 1 / K, dtype=torch.float64)  # one posterior everywhere: no task effect to fit
    states = torch.randn(N, P, D)
    with pytest.raises(AnalysisError, match="span fewer than 3 directions"):
        probe_basis(states, alpha, torch.zeros(N, P, dtype=torch.long), 4, slice(0, 4))


def tiny_run(tmp_path_factory, family: str) -> StudyRun:
    """A 2-block model trained for 40 steps on a pool with minors (seconds)."""
    config = build_config({
        "name": f"tiny-{family}", "task": {"family": family, "seq_len": 16, "diversity": 2},
        "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 16},
        "train": {"steps": 40, "batch_size": 8, "eval_every": 20, "checkpoint_every": 20, "eval_batch": 16, "lr": 3e-3, "threads": 1}})
    run = Run.create(config, tmp_path_factory.mktemp(family))
    train(run)
    return StudyRun(Run.open(run.path))


@pytest.fixture(scope="module")
def dice(tmp_path_factory) -> StudyRun:
    return tiny_run(tmp_path_factory, "dice")


@pytest.fixture(scope="module")
def measured(dice):
    """(blocks, rows) of the ablations of the tiny dice run, with a short search."""
    geometries = list(dice.geometries(dice.heldout("major", 64, split="geometry"), block_places(dice)))
    blocks = find_blocks(dice, geometries, steps=5)
    sets = loss_sets(dice, 32)
    clean = {name: dice.loss(sequences, per_position=True) for name, sequences in sets.items()}
    return blocks, pd.DataFrame(ablation_rows(dice, blocks, sets, clean))


def test_the_search_keeps_v_outside_the_probe_s_and_searches_on_minor_sequences(dice, measured):
    blocks, _ = measured
    assert dice.search_set() == "minor" and dice.search_set("v-searched-on-ood") == "ood"
    for block in blocks:
        assert block.place.site == "resid_mid" and block.geometry.probe.shape == (16, 3)
        assert block.geometry.avoided.shape[1] == 3  # E1: S only, no token directions
        assert (block.v.T.double() @ block.geometry.probe).abs().max() < 1e-5
        for control in block.controls:
            assert (control.T.double() @ block.geometry.probe).abs().max() < 1e-5
        with_tokens = block.geometry.avoid("v-avoids-tokens")
        assert with_tokens.shape[1] == 3 + block.geometry.token_directions.shape[1]


def test_e3_s_v_avoids_the_token_directions_too(tmp_path_factory):
    run = tiny_run(tmp_path_factory, "markov")
    geometries = list(run.geometries(run.heldout("major", 64, split="geometry"), block_places(run)))
    for block in find_blocks(run, geometries, steps=3):
        tokens = block.geometry.token_directions
        assert tokens.shape[1] >= 1 and block.geometry.avoided.shape[1] == 3 + tokens.shape[1]
        assert (block.v.T.double() @ block.geometry.probe).abs().max() < 1e-5
        assert (block.v.T.double() @ tokens.double()).abs().max() < 1e-5


def test_the_block_mean_is_the_mean_of_the_per_block_rows(measured):
    blocks, rows = measured
    assert set(rows["set"]) == {"major", "minor", "ood"}
    for (metric, set_name), group in rows.groupby(["metric", "set"]):
        per_block, summary = group[group["layer"].notna()], group[group["layer"].isna()]
        assert list(per_block["layer"]) == list(range(len(blocks))), metric
        if metric.startswith("gain_removed_random_draw"):
            assert summary.empty
            continue
        assert len(summary) == 1 and summary["site"].iloc[0] == "resid_mid"
        np.testing.assert_allclose(summary["value"].iloc[0], per_block["value"].mean(), rtol=1e-9, atol=1e-9, err_msg=metric)


def test_the_random_control_is_the_75th_percentile_of_the_draws_by_hand(measured):
    blocks, rows = measured
    rows = rows.assign(diversity=2, step=np.nan)
    stats = {}
    for set_name in ("major", "minor", "ood"):
        at = rows[rows["set"] == set_name]
        per_block = []
        for layer in range(len(blocks)):
            draws = [at[(at["metric"] == f"gain_removed_random_draw{i}") & (at["layer"] == layer)]["value"].iloc[0]
                     for i in range(N_RANDOM_CONTROLS)]
            by_hand = float(np.percentile(np.abs(draws), 75))  # numpy's linear interpolation: the 4th smallest of 5
            assert by_hand == sorted(np.abs(draws))[3]
            stored = at[(at["metric"] == "gain_removed_random") & (at["layer"] == layer)]
            assert stored["value"].iloc[0] == pytest.approx(by_hand, rel=1e-12)
            assert stored["band"].iloc[0] == [min(draws), max(draws)]
            per_block.append(by_hand)
        stats[set_name] = float(np.mean(per_block))
    claims = {c.id: c for c in ablation_claims(rows, "e1", 2, "quick")}
    control = claims["e1.random_control"]
    assert control.value == pytest.approx(max(stats["major"], stats["ood"]), rel=1e-12)  # the claim's sets: major and OOD
    assert control.parts["ood_block_mean"] == pytest.approx(stats["ood"], rel=1e-12) and "ood_block1" in control.parts
    assert control_statistic([1.0, None]) is None


def test_the_claims_read_the_block_mean_and_carry_each_block(measured):
    blocks, rows = measured
    rows = rows.assign(diversity=2, step=np.nan)
    claims = {c.id: c for c in ablation_claims(rows, "e1", 2, "quick")}
    for ablation, set_name in (("ablate_S", "major"), ("ablate_S", "ood"), ("ablate_V", "ood"), ("ablate_V", "major")):
        claim = claims[f"e1.{ablation}_{set_name}"]
        at = rows[(rows["metric"] == f"gain_removed_{ablation}") & (rows["set"] == set_name)]
        mean = at[at["layer"].isna()]["value"].iloc[0]
        assert claim.value == claim.parts["block_mean"] == mean
        assert [claim.parts[f"block{layer}"] for layer in range(len(blocks))] == list(at[at["layer"].notna()]["value"])


def test_control_statistic_by_hand():
    assert control_statistic([-4.0, 1.0, 2.0, -3.0, 0.5]) == pytest.approx(3.0)  # |.| sorted 0.5, 1, 2, 3, 4
    assert control_statistic([1.0, 2.0]) == pytest.approx(1.75)


def test_the_sensitivity_summary_judges_each_claim_over_the_runs():
    from taskgeom.analysis.sensitivity import summarise

    def line(run, variant, value, status):
        return {"run": run, "diversity": 8, "claim": "e1.ablate_V_ood", "variant": variant, "value": value, "status": status,
                "place": "mean over blocks"}

    rows = pd.DataFrame([line("a", "protocol", 60.0, "pass"), line("b", "protocol", 40.0, "fail"), line("c", "protocol", 70.0, "pass"),
                         line("a", "v-best-block", 80.0, "pass"), line("b", "v-best-block", float("nan"), "n/a")])
    summary = summarise(rows).set_index("variant")
    assert summary.loc["protocol", ["median", "min", "max", "verdict", "runs"]].tolist() == [60.0, 40.0, 70.0, "unstable", 3]
    assert summary.loc["v-best-block", ["median", "verdict", "runs"]].tolist() == [80.0, "pass", 2]  # an n/a run counts neither way

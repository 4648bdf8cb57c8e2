"""`taskgeom analyze` on a tiny trained run: the tidy table, the figures, and clear errors."""

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from taskgeom.analysis.measures.variants import protocol
from taskgeom.cli import app
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe
from taskgeom.training.train import train

TINY = [
    "task.seq_len=24",
    "model.max_len=24",
    "model.d_model=16",
    "model.d_mlp=32",
    "train.steps=20",
    "train.eval_every=20",
    "train.checkpoint_every=20",
    "train.eval_batch=32",
    "train.threads=1",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Run:
    run = Run.create(load_recipe("e1", "quick", TINY), tmp_path_factory.mktemp("runs"))
    train(run)
    return run


def invoke(*args: str):
    return CliRunner().invoke(app, ["analyze", *args])


def test_analyze_writes_tidy_rows_and_figures(trained):
    import numpy as np

    from taskgeom.analysis.measures.task_vectors import late_window
    from taskgeom.analysis.stored.keys import FORMATS
    from taskgeom.analysis.stored.rows import FIELDS
    from taskgeom.analysis.study import StudyRun
    from taskgeom.hooks import capture

    def p0_p1_by_hand(h: torch.Tensor, task: torch.Tensor, tokens: torch.Tensor, window: slice) -> tuple[float, float]:
        """(SS_within / SS_total over cells (task, current token), 1 - SS_interaction / SS_between) of
        the late-window states h: [N, T, D]: cells by a loop, the additive model by least squares on
        the observations."""
        x = h[:, window].double().reshape(-1, h.shape[-1]).numpy()
        k = task[:, None].expand(-1, tokens.shape[1])[:, window].reshape(-1).numpy()
        a = tokens[:, window].reshape(-1).numpy()
        total = ((x - x.mean(0)) ** 2).sum()
        within = 0.0
        for cell in set(zip(k.tolist(), a.tolist())):
            members = x[(k == cell[0]) & (a == cell[1])]
            within += ((members - members.mean(0)) ** 2).sum()
        design = np.concatenate([np.ones((len(x), 1)), np.eye(k.max() + 1)[k], np.eye(a.max() + 1)[a]], axis=1)
        residual = x - design @ np.linalg.lstsq(design, x, rcond=None)[0]
        interaction = (residual**2).sum() - within
        return within / total, 1 - interaction / (total - within)

    result = invoke(str(trained.path), "--sequences", "48")
    assert result.exit_code == 0, result.output
    table = pd.read_json(trained.path / "analysis" / "m1.json")
    assert set(table.columns) == set(FIELDS) and set(table["version"]) == {FORMATS["m1"]}
    assert set(table["batch"]) == {"select", "measure", "cells", "trajectory"} and set(table["set"]) == {"major"}
    for batch in ("select", "measure"):
        per_layer = table[table["position"].isna() & (table["batch"] == batch)]
        for metric in ("p0.within_share", "p0.cell_r2", "p1.additive_share", "p2.r2_task", "p2.r2_random"):
            rows = per_layer[per_layer["metric"] == metric]
            assert sorted(zip(rows["layer"], rows["site"])) == [
                (0, "resid_mid"),
                (0, "resid_post"),
                (1, "resid_mid"),
                (1, "resid_post"),
            ]
    for metric in ("p2.r2_task", "p0.cell_r2", "p1.additive_share"):
        per_position = table[(table["metric"] == metric) & table["position"].notna()]
        assert len(per_position) == 4 * 24 and set(per_position["batch"]) == {"measure"}
    # P0 and P1 recomputed from states captured on the same batches, by a plain loop over cells and
    # ordinary least squares on the observations: pooled over the late window (the pooled-anova
    # variant) and at each position (the protocol), whose median over the late window the rows hold
    model = trained.load_model()
    places = [(layer, site) for layer in range(2) for site in ("resid_mid", "resid_post")]
    late = late_window(24)
    for batch in ("select", "measure"):
        inputs = StudyRun(trained).heldout("major", 48, split=batch).inputs
        with torch.no_grad(), capture(model, places) as states:
            model(inputs.batch.tokens)
        rows = table[table["position"].isna() & (table["batch"] == batch)].set_index(["metric", "layer", "site"])[
            "value"
        ]
        curves = table[table["position"].notna() & (table["batch"] == batch)].set_index(
            ["metric", "layer", "site", "position"]
        )["value"]
        for place in places:
            within, additive = p0_p1_by_hand(states[place], inputs.batch.task, inputs.batch.tokens, late)
            assert rows[("p0.within_share_pooled", *place)] == pytest.approx(within, rel=1e-6, abs=1e-9), (batch, place)
            assert rows[("p0.cell_r2_pooled", *place)] == pytest.approx(1 - within, rel=1e-6, abs=1e-9), (batch, place)
            assert rows[("p1.additive_share_pooled", *place)] == pytest.approx(additive, rel=1e-6, abs=1e-9), (
                batch,
                place,
            )
            by_position = np.array(
                [
                    p0_p1_by_hand(states[place], inputs.batch.task, inputs.batch.tokens, slice(t, t + 1))
                    for t in range(24)
                ]
            )
            if batch == "measure":
                for t in range(24):
                    assert curves[("p0.cell_r2", *place, t)] == pytest.approx(
                        1 - by_position[t, 0], rel=1e-6, abs=1e-9
                    ), (place, t)
                    assert curves[("p1.additive_share", *place, t)] == pytest.approx(
                        by_position[t, 1], rel=1e-6, abs=1e-9
                    ), (place, t)
            assert rows[("p0.cell_r2", *place)] == pytest.approx(
                np.median(1 - by_position[late, 0]), rel=1e-6, abs=1e-9
            ), (batch, place)
            assert rows[("p1.additive_share", *place)] == pytest.approx(
                np.median(by_position[late, 1]), rel=1e-6, abs=1e-9
            ), (batch, place)
            assert rows[("p1.additive_share_last", *place)] == pytest.approx(by_position[-1, 1], rel=1e-6, abs=1e-9), (
                batch,
                place,
            )
    tv = table[(table["metric"] == "p3.tv") & table["position"].notna() & table["task"].isna()]
    assert sorted(tv["position"].astype(int)) == list(range(24))
    per_task = table[(table["metric"] == "p3.tv") & table["task"].notna()]
    assert sorted(zip(per_task["task"].astype(int), per_task["position"].astype(int))) == [
        (k, t) for k in range(3) for t in range(24)
    ]
    assert all(low <= value <= high for value, (low, high) in zip(tv["value"], tv["band"]))
    for name in ("simplex", "layers", "positions", "steering"):
        assert (trained.path / "figures" / f"m1_{name}.png").stat().st_size > 10_000


def test_unfinished_run_is_a_clear_error(tmp_path):
    run = Run.create(load_recipe("e1", "quick", TINY), tmp_path)
    result = invoke(str(run.path))
    assert result.exit_code == 2
    assert "no finished model" in result.output
    assert not (run.path / "analysis").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("--layer", "5"), "layers [5] do not exist; the model has layers 0..1"),
        (("--site", "resid_side"), "unknown sites ['resid_side']"),
        (("--layer", "0"), "the M1 claims read (layer, site) [(1, 'resid_post')]"),
        (("--site", "resid_mid"), "the M1 claims read (layer, site) [(1, 'resid_post')]"),
    ],
)
def test_bad_requests_exit_2_before_any_work(trained, tmp_path, args, message):
    """A bad request changes nothing an earlier analysis wrote: m1.json and the figures keep their bytes."""
    if not (trained.path / "analysis" / "m1.json").exists():  # this test alone: analyse once first
        assert invoke(str(trained.path), "--sequences", "48").exit_code == 0
    written = sorted(p for folder in ("analysis", "figures") for p in (trained.path / folder).iterdir())
    assert trained.path / "analysis" / "m1.json" in written
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in written}
    result = invoke(str(trained.path), *args)
    assert result.exit_code == 2
    assert message in result.output
    assert sorted(p for folder in ("analysis", "figures") for p in (trained.path / folder).iterdir()) == written
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in written} == before


def test_analyze_measures_at_the_sample_sizes_of_the_profile_it_is_given(trained, tmp_path):
    """``--profile smoke`` measures under the smoke profile's protocol (its ``measure:`` sample sizes), the
    default under the study's: the stored rows are keyed by that protocol's digest."""
    import json
    import shutil

    from taskgeom.analysis.protocol import STUDY
    from taskgeom.settings.recipes import load_measure, recipe_path

    smoke = load_measure(recipe_path("e1"), "smoke").analysis_protocol
    assert smoke != STUDY
    copy = tmp_path / trained.path.name
    shutil.copytree(trained.path, copy)
    for profile, expected in (("smoke", smoke), ("quick", STUDY)):
        assert invoke(str(copy), "--sequences", "48", "--profile", profile).exit_code == 0
        rows = json.loads((copy / "analysis" / "m1.json").read_text())
        assert {r["protocol"] for r in rows} == {expected.digest()}, profile


def test_missing_run_directory_exits_2(tmp_path):
    result = invoke(str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert "not a taskgeom run directory" in result.output


def test_the_claims_read_the_studys_block_and_each_variant_reads_its_own(trained):
    from taskgeom.analysis.reading.steering import KINDS
    from taskgeom.analysis.stored.m1 import analyze
    from taskgeom.analysis.study import StudyRun
    from taskgeom.claims.catalog import spec
    from taskgeom.claims.m1 import claim_values
    from taskgeom.claims.m1 import claims as m1_claims
    from taskgeom.errors import AnalysisError

    result = analyze(StudyRun(trained), n_sequences=48, n_random=2)
    claims = {c.id: c for c in m1_claims(result)}
    assert list(claims) == ["e1.P0", "e1.P1", "e1.P2", "e1.P2.vs_random", "e1.P3", "e1.P3.shrinks", "e1.steering"]
    assert result.place == result.p3_place == (1, "resid_post")  # study block 3 of 6 in 2 blocks: ceil(4 * 2 / 6) - 1
    assert all(
        (c.parts["layer"], c.parts["site"]) == (1, "resid_post") for c in claims.values() if c.id != "e1.steering"
    )
    table = pd.DataFrame(result.rows)
    per_place = table[table["position"].isna() & table["task"].isna()]
    measured = per_place[per_place["batch"] == "measure"].set_index(["metric", "layer", "site"])["value"]
    at = measured.xs((1, "resid_post"), level=("layer", "site"))
    cells = (
        per_place[per_place["batch"] == "cells"]
        .set_index(["metric", "layer", "site"])["value"]
        .xs((1, "resid_post"), level=("layer", "site"))
    )
    assert (
        claims["e1.P0"].value == cells["p0.cell_r2_forced"]
        and claims["e1.P1"].value == cells["p1.additive_share_forced"]
    )
    assert (
        (claims["e1.P0"].parts["position"], claims["e1.P0"].parts["per_cell"])
        == (cells["cells.position"], 1024)
        == (22, 1024)
    )
    assert (
        claims["e1.P2"].value == cells["p2.r2_additive_forced"] and claims["e1.P2"].parts["r2_task"] == at["p2.r2_task"]
    )
    random = cells["p2.r2_additive_forced_random"]  # P2.vs_random: the partial R^2 beyond the random subspace
    assert claims["e1.P2.vs_random"].value == pytest.approx((cells["p2.r2_additive_forced"] - random) / (1 - random))
    # the variant natural-cells: the natural states' late-window medians, written beside the claims
    curve = table[
        (table["metric"] == "p0.cell_r2")
        & (table["layer"] == 1)
        & (table["site"] == "resid_post")
        & (table["position"] >= 18)
    ]
    natural = claim_values(result.rows, protocol("natural-cells"))
    assert (
        natural["P0"].value
        == at["p0.cell_r2"]
        == claims["e1.P0"].parts["natural_late_median"]
        == pytest.approx(curve["value"].median())
    )
    assert (
        natural["P1"].value == at["p1.additive_share"]
        and natural["P1"].parts["last_position"] == at["p1.additive_share_last"]
    )
    assert natural["P2"].value == at["p2.r2_additive"]
    trajectory = per_place[per_place["batch"] == "trajectory"].set_index(["metric", "layer", "site"])["value"]
    assert claims["e1.P3"].value == trajectory[("p3.tv_trajectory", 1, "resid_post")]
    assert claims["e1.P3"].parts["late_window_all_tasks"] == at["p3.tv_mean_beta"]
    assert (
        (claims["e1.P0"].threshold, claims["e1.steering"].threshold)
        == (spec("m1", "P0").threshold, spec("m1", "steering").threshold)
        == (0.9, 1.0)
    )
    # steering at the study's block (3 of 6 at the depth of 2 blocks: block 1), written at resid_mid, whatever was selected
    steering = per_place[
        (per_place["layer"] == 1) & (per_place["site"] == "resid_mid") & per_place["metric"].str.startswith("steering.")
    ]
    steering = steering.set_index("metric")["value"]
    assert result.steering.place == (1, "resid_mid") and result.steering.positions == (
        23,
    )  # 25-39 moved into a context of 24
    assert [steering[f"steering.kl_{kind}"] for kind in KINDS] == [result.steering.mean(kind) for kind in KINDS]
    assert (steering["steering.n_sequences"], steering["steering.n_points"]) == (
        10_000,
        10_000,
    )  # the study's B, whatever --sequences
    parts = claims["e1.steering"].parts
    assert claims["e1.steering"].value == pytest.approx(
        max(3 * parts["steered"] / parts["unsteered"], parts["steered"] / parts["mode"])
    )
    assert parts["steered"] == steering["steering.kl_steered"] and (parts["layer"], parts["site"]) == (1, "resid_mid")
    earlier = per_place[per_place["metric"].str.startswith("steering_at_read_site.")].set_index(
        "metric"
    )  # the variant, beside it
    assert set(earlier["site"]) == {"resid_post"} and earlier.loc["steering_at_read_site.n_sequences", "value"] == 48

    # the selected-place variant: the place of best R^2_task on the selection batch, measured apart
    selection = per_place[(per_place["batch"] == "select") & (per_place["metric"] == "p2.r2_task")].set_index(
        ["layer", "site"]
    )["value"]
    ranked = selection.sort_values(ascending=False).index.tolist()
    assert result.selected == ranked[0] and result.runner_up == ranked[1]
    forced = per_place[per_place["batch"] == "cells"].set_index(["metric", "layer", "site"])["value"]
    for variant, place, p0 in (
        ("selected-place", result.selected, "p0.cell_r2_forced"),
        ("site-mid", (1, "resid_mid"), "p0.cell_r2_forced"),
        ("pooled-anova", (1, "resid_post"), "p0.cell_r2_pooled"),
        ("v-best-block", (1, "resid_post"), "p0.cell_r2_forced"),
    ):
        values = claim_values(result.rows, protocol(variant))
        assert values["P0"].value == (forced if p0.endswith("_forced") else measured)[(p0, *place)], variant
        assert (values["P3"].parts["layer"], values["P3"].parts["site"]) == tuple(place), variant
        assert values["P3"].value == trajectory[("p3.tv_trajectory", *place)], variant
    assert (
        claim_values(result.rows, protocol("pooled-anova"))["P1"].value
        == measured[("p1.additive_share_pooled", 1, "resid_post")]
    )
    assert (
        claim_values(result.rows, protocol("p3-late-window"))["P3"].value
        == measured[("p3.tv_mean_beta", 1, "resid_post")]
    )
    with pytest.raises(AnalysisError, match="no variant of the measurement 'sideways'"):
        protocol("sideways")


def test_analyze_e2_regression_run(tmp_path):
    """E2: x_t is the current example's x, P3 uses the posterior at every model position, and
    steering reports the RMSE of the prediction of y_i; the m1 claims read them."""
    from taskgeom.analysis.stored.m1 import analyze
    from taskgeom.analysis.study import StudyRun
    from taskgeom.claims.m1 import claims as m1_claims
    from taskgeom.settings.recipes import build_config

    raw = {
        "name": "e2",
        "task": {"family": "regression", "d": 2, "n_examples": 4},
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 12},
        "train": {"steps": 2, "batch_size": 4, "eval_every": 2, "checkpoint_every": 2, "eval_batch": 8},
    }
    run = Run.create(build_config(raw), path=tmp_path / "reg")
    train(run)
    result = CliRunner().invoke(app, ["analyze", str(run.path), "--sequences", "48"])
    assert result.exit_code == 0, result.output
    assert (
        "steering at layer 0 (resid_mid), positions 0-3, mean RMSE(model's y, y_a) over 10000 target points"
        in result.output
    )
    table = pd.read_json(run.path / "analysis" / "m1.json")
    per_layer = table[table["position"].isna()]
    assert set(per_layer["metric"]) >= {
        "p0.cell_r2",
        "p1.additive_share",
        "p2.r2_task",
        "p2.r2_random",
        "steering.rmse_unsteered",
        "steering.rmse_steered",
        "steering.rmse_mode",
        "steering.rmse_random",
    }
    tv = table[(table["metric"] == "p3.tv") & table["position"].notna() & table["task"].isna()]
    assert sorted(tv["position"].astype(int)) == list(range(4))  # one per separator (example)
    for name in ("simplex", "layers", "positions", "steering"):
        assert (run.path / "figures" / f"m1_{name}.png").stat().st_size > 10_000

    analysed = analyze(StudyRun(run), n_sequences=48, n_random=2)
    assert analysed.alpha.shape == (48, 4, 3) and torch.allclose(analysed.alpha.sum(-1), torch.ones(48, 4))
    claims = {c.id: c for c in m1_claims(analysed)}
    assert list(claims) == ["e2.P0", "e2.P1", "e2.P2", "e2.P2.vs_random", "e2.P3", "e2.P3.shrinks", "e2.steering"]
    parts = claims["e2.steering"].parts
    assert claims["e2.steering"].value == pytest.approx(
        max(2 * parts["steered"] / parts["unsteered"], parts["steered"] / parts["mode"])
    )
    assert "linear map of x_t" in claims["e2.P0"].description
    at = pd.DataFrame(analysed.rows).query("batch == 'measure' and position.isna() and task.isna()", engine="python")
    at = at[(at["layer"] == 0) & (at["site"] == "resid_post")].set_index("metric")[
        "value"
    ]  # block 10 (and 9) of 16 in 1 block: 0
    assert claims["e2.P2"].value == at["p2.r2_additive"] and claims["e2.P2"].parts["r2_task"] == at["p2.r2_task"]


def test_unsupported_family_is_a_clear_error():
    from types import SimpleNamespace

    from taskgeom.analysis.study import StudyRun
    from taskgeom.errors import AnalysisError
    from taskgeom.tasks import TaskFamily

    class Other(TaskFamily):  # a family the analysis has no token-effect model for
        name = "other"
        sample_params = make_batch = model_io = reference_predictions = training_loss = position_losses = (
            context_statistic
        ) = None

    with pytest.raises(AnalysisError, match="'other' is not supported yet"):
        StudyRun(SimpleNamespace(family=Other()))

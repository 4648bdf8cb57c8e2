"""The scale ladder: a reproduction limited to some recipes and a diversity grid, and the claim x
rung table read back from results folders, checked against statistics computed here from each
folder's per-seed values."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from taskgeom.analysis.protocol import STUDY, measured_under
from taskgeom.cli import app
from tests.conftest import SMOKE


def _claims(folder: Path) -> list[dict]:
    return json.loads((folder / "claims.json").read_text())


def test_a_rung_measures_only_its_recipes_over_its_grid(tmp_path):
    from taskgeom.experiments import reproduce
    from taskgeom.experiments.base import shipped_studies
    from taskgeom.experiments.executors import Executor

    out = tmp_path / "rung"
    shrunk = (
        "train.steps=30",
        "train.eval_every=10",
        "train.checkpoint_every=10",
        "model.n_layers=1",
        "model.d_model=16",
    )
    reproduce(
        out,
        "wide",
        None,
        Executor("local", 1),
        device="cpu",
        overrides=shrunk,
        seeds=(0,),
        studies=tuple(s for s in shipped_studies() if s.name == "e1"),
        diversities=(-1, 2),
    )
    ids = [c["id"] for c in _claims(out)]
    assert ids and all(i.startswith("e1.") for i in ids) and "e1.ablate_V_ood" in ids and "e1.bayes_optimal" in ids
    manifest = json.loads((out / "reproduction.json").read_text())
    assert manifest["profile"] == "wide" and manifest["recipes"] == ["e1"] and manifest["grid"] == [-1, 2]
    assert manifest["overrides"] == list(shrunk)  # every run trained with them, on top of the profile
    configs = [yaml.safe_load(p.read_text()) for p in (out / "runs").glob("*/config.yaml")]
    assert configs and {(c["train"]["steps"], c["model"]["d_model"], c["model"]["d_mlp"]) for c in configs} == {
        (30, 16, 512)
    }
    sweep = pd.read_csv(out / "tables" / "sweep.csv")
    assert sorted(sweep["diversity"].unique()) == [-1, 2] and set(sweep["recipe"]) == {"e1"}
    assert {r.split("-")[0] for r in manifest["runs"]} == {"e1"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile", "huge"], "unknown profile 'huge' for recipe e1"),
        (["--recipes", "e9"], "--recipes: unknown recipes ['e9']"),
        (["--recipes", "e1", "--grid", "1,1"], "--grid names 1 more than once"),
    ],
)
def test_reproduce_refuses_a_rung_it_cannot_run_before_writing(tmp_path, args, message):
    out = tmp_path / "never"
    result = CliRunner().invoke(app, ["reproduce", "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()


def _stats(values: list[float]) -> str:
    return f"{np.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def test_the_ladder_table_is_each_rung_s_per_seed_values(tiny_reproduction, tmp_path):
    low, high = tmp_path / "low", tmp_path / "high"
    shutil.copytree(tiny_reproduction, low)
    shutil.copytree(tiny_reproduction, high)
    claims = _claims(high)  # rung "high": one claim measured higher on every seed, as if at another scale
    moved = next(c for c in claims if c["status"] in ("pass", "fail") and len(c["seeds"]) > 1)
    for row in moved["seeds"]:
        row["value"] += 1.0
    values = [r["value"] for r in moved["seeds"]]
    moved |= {
        "median": float(np.median(values)),
        "min": min(values),
        "max": max(values),
        "value": float(np.median(values)),
    }
    (high / "claims.json").write_text(json.dumps(claims))
    out = tmp_path / "ladder"
    result = CliRunner().invoke(app, ["ladder", f"small={low}", f"big={high}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {line.split("`")[1]: line.split(" | ") for line in result.output.splitlines() if line.startswith("| `")}
    assert list(rows) == [c["id"] for c in _claims(low)]
    for rung, column in ((low, 2), (high, 3)):
        for claim in _claims(rung):
            measured = [r["value"] for r in claim["seeds"] if r["status"] != "n/a"]
            cell = rows[claim["id"]][column]
            assert cell.startswith("n/a") if claim["status"] == "n/a" else cell.startswith(_stats(measured)), (
                claim["id"],
                cell,
            )
    long = pd.read_csv(out / "ladder.csv")
    assert len(long) == 2 * sum(len(c["seeds"]) for c in _claims(low)) and set(long["rung"]) == {"small", "big"}
    recipes = {c["id"].split(".")[0] for c in _claims(low) if c["status"] != "n/a"}
    assert all((out / f"ladder_{recipe}.png").stat().st_size > 0 for recipe in recipes)
    verdicts = pd.read_csv(out / "verdicts.csv", keep_default_na=False, na_values=[""]).set_index(["claim", "profile"])
    assert (
        len(verdicts) == 2 * len(_claims(low)) and (out / "verdicts.png").stat().st_size > 0
    )  # the grid, every claim at each rung
    assert verdicts.loc[(moved["id"], "big"), "median"] == pytest.approx(moved["median"], rel=1e-12)
    assert verdicts.loc[(moved["id"], "big"), "status"] == moved["status"]
    curve = pd.read_csv(low / "tables" / "rank_curve.csv")  # the rank curve at the highest k, by hand
    top = curve[(curve["diversity"] == curve["diversity"].max()) & curve["layer"].isna() & (curve["recipe"] == "e1")]
    first = top[top["rank"] == 1]["value"]
    reliable = first[first.notna() & ~top.loc[first.index, "unreliable"].eq(True)].tolist()  # as the claims count seeds
    lines = [x for x in result.output.splitlines() if x.startswith("| e1 | small |")]
    assert [line.split(" | ")[2] for line in lines] == ([_stats(reliable)] if reliable else [])


def test_the_ladders_rank_curve_counts_only_the_seeds_whose_gain_is_reliable(tiny_reproduction, tmp_path):
    """A seed whose OOD gain is below the reliability floor is n/a in the claims; the ladder's rank
    curve leaves it out too, and a rung with no reliable seed has no row."""
    mixed, none = tmp_path / "mixed", tmp_path / "none"
    shutil.copytree(tiny_reproduction, mixed)
    shutil.copytree(tiny_reproduction, none)
    path = mixed / "tables" / "rank_curve.csv"
    curve = pd.read_csv(path)
    e1 = curve["recipe"] == "e1"
    seeds = sorted(curve.loc[e1, "seed"].unique())
    assert len(seeds) > 1
    curve.loc[e1, "value"] = curve.loc[e1, "seed"].map({seed: 10.0 * (i + 1) for i, seed in enumerate(seeds)})
    curve.loc[e1, "unreliable"] = curve.loc[e1, "seed"] == seeds[-1]  # the last seed: 10 x its number, to be left out
    curve.to_csv(path, index=False)
    unreliable = pd.read_csv(none / "tables" / "rank_curve.csv").assign(unreliable=True)
    unreliable.to_csv(none / "tables" / "rank_curve.csv", index=False)
    result = CliRunner().invoke(app, ["ladder", f"mixed={mixed}", f"none={none}", "--out", str(tmp_path / "ladder")])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("| e1 | mixed |"))
    kept = [10.0 * (i + 1) for i in range(len(seeds) - 1)]
    assert line.split(" | ")[2] == _stats(kept)
    assert not any(x.startswith("| e1 | none |") for x in result.output.splitlines())


def test_the_ladder_refuses_a_folder_that_is_not_a_reproduction(tmp_path):
    result = CliRunner().invoke(app, ["ladder", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "reproduction.json not found" in result.output, result.output


def test_sensitivity_lists_each_claim_under_the_protocol_and_each_variant_on_the_same_run(tiny_reproduction):
    """The protocol's values are the stored claims' (one code path); each variant lists the claims
    it can move; with one block, reading V at the best block is reading the block mean."""
    from taskgeom.analysis.study import StudyRun
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.sensitivity import ABLATION_VARIANTS, ablation_variants
    from taskgeom.runs.folders import Run

    high = int(pd.read_csv(tiny_reproduction / "tables" / "sweep.csv")["diversity"].max())
    config = Context(tiny_reproduction, SMOKE).config("e1", (f"task.diversity={high}",), 0)
    assert config.model.n_layers == 1
    run_dir = tiny_reproduction / "runs" / f"{config.name}-{config.digest()}"
    rows = pd.DataFrame(ablation_variants(StudyRun(Run.open(run_dir))))
    claims = {c["id"]: next(s for s in c["seeds"] if s["seed"] == 0) for c in _claims(tiny_reproduction)}
    protocol = rows[rows["variant"] == "protocol"].set_index("claim")
    assert sorted(protocol.index) == sorted(
        f"e1.{c}" for c in ("ablate_S_major", "ablate_S_ood", "ablate_V_ood", "ablate_V_major", "random_control")
    )
    for claim, measured in protocol.iterrows():
        assert measured["status"] == claims[claim]["status"], claim
        stored = claims[claim]["value"]  # null in claims.json where the claim does not apply
        assert (
            math.isnan(measured["value"]) if stored is None else measured["value"] == pytest.approx(stored, rel=1e-9)
        ), claim
    listed = {
        name: sorted(c.split(".")[1] for c in rows[rows["variant"] == name]["claim"]) for name in ABLATION_VARIANTS
    }
    assert listed == {
        "centred-S": ["ablate_S_major", "ablate_S_ood"],
        "v-avoids-tokens": ["ablate_V_major", "ablate_V_ood", "random_control"],
        "v-searched-on-minors": ["ablate_V_major", "ablate_V_ood"],
        "v-searched-on-ood": ["ablate_V_major", "ablate_V_ood"],
        "v-avoids-major-span": ["ablate_V_major", "ablate_V_ood", "random_control"],
        "v-earlier-search": ["ablate_V_major", "ablate_V_ood", "random_control"],
        "v-best-block": ["ablate_V_major", "ablate_V_ood", "random_control"],
        "s-with-mean": ["ablate_S_major", "ablate_S_ood"],
        "probe-exact": ["ablate_S_major", "ablate_S_ood"],
    }
    best = rows[rows["variant"] == "v-best-block"].set_index("claim")
    for claim in best.index:
        assert best.loc[claim, "value"] == pytest.approx(protocol.loc[claim, "value"], rel=1e-12, nan_ok=True)
    assert set(best["place"]) == {"block 0"} and set(protocol["place"]) == {"mean over blocks"}
    for text in protocol["v_search"]:  # the one block's V search: steps run / best step
        run_steps, best_step = map(int, text.removeprefix("0: ").split("/"))
        assert 0 <= best_step < run_steps <= STUDY.search_steps

    result = CliRunner().invoke(app, ["sensitivity", str(run_dir), "--variant", "centred-S"])
    assert result.exit_code == 0, result.output
    assert {"protocol", "centred-S"} <= set(result.output.split()) and "v-best-block" not in result.output
    result = CliRunner().invoke(app, ["sensitivity", str(run_dir), "--variant", "centred-s"])
    assert result.exit_code == 2 and "centred-S" in result.output


def test_sensitivity_reads_the_m1_and_projection_variants_from_the_stored_analyses(tiny_reproduction):
    """Under the protocol the stored rows give the claims' own values and verdicts; each variant
    lists the claims it can move, read where it says."""
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.sensitivity import stored_variants
    from taskgeom.runs.folders import Run

    claims = {c["id"]: next(s for s in c["seeds"] if s["seed"] == 0) for c in _claims(tiny_reproduction)}
    ctx = Context(tiny_reproduction, SMOKE)
    high = int(pd.read_csv(tiny_reproduction / "tables" / "sweep.csv")["diversity"].max())
    run_dirs = {
        k: tiny_reproduction / "runs" / f"{c.name}-{c.digest()}"
        for k in (-1, high)
        for c in [ctx.config("e1", (f"task.diversity={k}",), 0)]
    }
    with measured_under(ctx.protocol):  # the rows are stored under the smoke profile's sample sizes
        rows = pd.DataFrame(stored_variants(Run.open(run_dirs[-1])))
        projection = pd.DataFrame(stored_variants(Run.open(run_dirs[high]))).set_index("variant")  # no m1.json
    protocol = rows[(rows["variant"] == "protocol") & rows["claim"].str.startswith("e1.P")].set_index("claim")
    assert sorted(protocol.index) == sorted(f"e1.{c}" for c in ("P0", "P1", "P2", "P2.vs_random", "P3", "P3.shrinks"))
    for claim, measured in protocol.iterrows():
        assert measured["status"] == claims[claim]["status"], claim
        stored = claims[claim]["value"]  # null in claims.json where the claim does not apply
        assert (
            math.isnan(measured["value"]) if stored is None else measured["value"] == pytest.approx(stored, rel=1e-12)
        ), claim
    assert sorted(rows[rows["variant"] == "pooled-anova"]["claim"]) == ["e1.P0", "e1.P1"]
    assert set(rows[rows["variant"] == "site-mid"]["place"]) == {"layer 0 resid_mid"}
    assert len(rows[rows["variant"] == "selected-place"]) == 6
    assert projection.loc["protocol", "value"] == pytest.approx(
        claims["e1.projection_r2_high_diversity"]["value"], rel=1e-12
    )
    assert {"protocol", "per-sequence-r2"} == set(projection.index)

    result = CliRunner().invoke(
        app, ["sensitivity", str(run_dirs[-1]), "--variant", "pooled-anova", "--profile", SMOKE]
    )
    assert result.exit_code == 0, result.output
    assert "pooled-anova" in result.output and "e1.P0" in result.output and "centred-S" not in result.output


def test_the_pinned_place_holds_the_claims_values_and_every_place_is_listed(tiny_reproduction):
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.sensitivity import place_choices
    from taskgeom.runs.folders import Run

    claims = {c["id"]: {r["seed"]: r["value"] for r in c["seeds"]} for c in _claims(tiny_reproduction)}
    high = int(pd.read_csv(tiny_reproduction / "tables" / "sweep.csv")["diversity"].max())
    ctx = Context(tiny_reproduction, SMOKE)
    for k, metric, claim in (
        (-1, "p2.r2_additive", "e1.P2"),
        (high, "projection_r2", "e1.projection_r2_high_diversity"),
    ):
        config = ctx.config("e1", (f"task.diversity={k}",), 0)
        with measured_under(ctx.protocol):  # the rows are stored under the smoke profile's sample sizes
            rows = pd.DataFrame(
                place_choices(Run.open(tiny_reproduction / "runs" / f"{config.name}-{config.digest()}"))
            )
        mine = rows[rows["metric"] == metric]
        assert len(mine) == 2 * config.model.n_layers and mine["pinned"].sum() == 1  # every layer, both sites
        assert mine[mine["pinned"]]["value"].iloc[0] == pytest.approx(claims[claim][0], rel=1e-9)


def test_reproduce_trains_a_data_variant_alone_under_its_settings_and_refuses_a_measurement_variant(tmp_path):
    """--variant e1-v6 plans the E1 runs of the recipe with the variant's overrides (the run names
    carry the digest of that config) and nothing else; a variant of the measurement belongs to
    sensitivity, and a data variant to reproduce."""
    from taskgeom.analysis.measures.variants import BY_NAME
    from taskgeom.experiments.base import Context

    result = CliRunner().invoke(app, ["reproduce", "--variant", "e1-v6", "--plan", "--csv", "--seeds", "0"])
    assert result.exit_code == 0, result.output
    plan = pd.read_csv(io.StringIO(result.output))
    assert set(plan["recipe"]) == {"e1"}
    overrides = BY_NAME["e1-v6"].overrides
    expected = {
        f"e1-{Context(tmp_path).config('e1', (*overrides, f'task.diversity={k}'), 0).digest()}"
        for k in plan["diversity"]
    }
    assert set(plan["run"]) == expected
    assert Context(tmp_path).config("e1", overrides).task.vocab_size == 6

    refused = CliRunner().invoke(app, ["reproduce", "--variant", "selected-place", "--plan"])
    assert refused.exit_code == 2 and "taskgeom sensitivity" in refused.output
    refused = CliRunner().invoke(app, ["reproduce", "--variant", "e1-v6", "--recipes", "e2", "--plan"])
    assert refused.exit_code == 2 and "e2" in refused.output
    refused = CliRunner().invoke(app, ["sensitivity", str(tmp_path), "--variant", "separator"])
    assert refused.exit_code == 2 and "taskgeom reproduce" in refused.output and "--variant separator" in refused.output

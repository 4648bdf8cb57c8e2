"""The public API (``import taskgeom as tg``) on a tiny reproduction's runs: the seven-step study
of the quickstart notebook gives the stored analyses' numbers, and each verb agrees with an
independent computation (steering against the mixture by hand, ablation losses against a plain
forward hook, states against ``hooks.capture``)."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch
from conftest import SMOKE

import taskgeom as tg
from taskgeom.analysis.reading.steering import KINDS, steering_place
from taskgeom.claims.m1 import steering_claim
from taskgeom.errors import AnalysisError, TaskgeomError
from taskgeom.hooks import capture, intervene
from taskgeom.settings.recipes import load_measure, recipe_path

ROOT = Path(__file__).resolve().parents[1]
MEASURE = load_measure(recipe_path("e3"), SMOKE)  # what the tiny reproduction measures: its projection sizes
SIZES = MEASURE.analysis_protocol  # and its sample sizes


@pytest.fixture(autouse=True)
def measured_as_stored():
    """Every test measures under the tiny reproduction's protocol (the smoke profile's sample sizes)."""
    with tg.measured_under(SIZES):
        yield


def study_cell() -> str:
    """The notebook's study: the code cell tagged ``study``."""
    notebook = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    (cell,) = [c for c in notebook.cells if "study" in c.metadata.get("tags", [])]
    return cell.source


def stored(run: tg.StudyRun, analysis: str) -> list[dict]:
    """The rows of a stored analysis as written (json, not pandas, whose reader rounds the last digit)."""
    return json.loads((run.path / "analysis" / f"{analysis}.json").read_text())


def one(rows: list[dict], metric: str, **where) -> dict:
    (found,) = [r for r in rows if r["metric"] == metric and all(r[k] == v for k, v in where.items())]
    return found


@pytest.fixture(scope="module")
def folder(tiny_reproduction, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("api") / "results"
    shutil.copytree(tiny_reproduction, copy)
    return copy


@pytest.fixture(scope="module")
def e3(folder) -> tg.StudyRun:
    return tg.results(folder).run("e3", diversity=-1, seed=0)


def test_the_seven_step_study_is_twenty_lines_and_gives_the_stored_numbers(folder):
    code = study_cell()
    lines = [line for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(lines) <= 20, len(lines)
    assert code in (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")  # the page shows this very study
    imports = [node for node in ast.walk(ast.parse(code)) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(node) for node in imports] == ["import taskgeom as tg"]
    namespace = {"folder": folder}
    assert tg.results(folder).protocol == SIZES  # the folder's protocol, under which this test measures
    exec(compile(code, "the study", "exec"), namespace)
    run, place, geometry, shares, r2, claims = (
        namespace[k] for k in ("run", "place", "geometry", "shares", "r2", "claims")
    )

    m1, dual = stored(run, "m1"), stored(run, "dual")
    pinned = one(m1, "place.m1")
    assert tuple(place) == (pinned["layer"], pinned["site"])
    at = {"layer": place.layer, "site": place.site, "position": None, "task": None}
    for name, metric, batch in (
        ("P0", "p0.cell_r2_forced", "cells"),
        ("P1", "p1.additive_share_forced", "cells"),
        ("P2", "p2.r2_additive_forced", "cells"),
        ("P3", "p3.tv_trajectory", "trajectory"),
    ):
        assert namespace["p"][name] == pytest.approx(
            one(m1, metric, batch=batch, **at)["value"], rel=1e-12, abs=1e-15
        ), name
        assert claims.loc[f"e3.{name}", "seeds"][0]["value"] == pytest.approx(namespace["p"][name], rel=1e-12), name
    steering_at = steering_place(
        run.family, run.config.model.n_layers
    )  # the stored steering: the study's block, its own draws
    drawn = run.geometry(namespace["major"], steering_at).steer(
        "dirichlet", sequences=run.heldout("major", SIZES.steering_sequences, split="steering")
    )
    stored_steering = claims.loc["e3.steering", "seeds"][0]
    assert stored_steering["value"] == steering_claim(drawn, "e3").value
    for kind in KINDS:
        row = one(
            m1, f"steering.kl_{kind}", layer=steering_at.layer, site="resid_mid"
        )  # written where the study writes it
        assert row["value"] == drawn.mean(kind) == stored_steering["parts"][kind], kind
    steered = namespace["steered"]
    for shown in (
        steered,
        geometry,
        geometry.p3,
        *shares.values(),
    ):  # a result prints as a one-line summary, not its tensors
        assert len(repr(shown)) < 300 and "tensor(" not in repr(shown) and "\n" not in repr(shown), repr(shown)
    assert f"steered {steered.mean('steered'):.4g}" in repr(steered) and f"{shares['major'].gain:.4g} nats" in repr(
        shares["major"]
    )
    assert steered.a.eq(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)).all()
    assert torch.isfinite(steered.steered).all() and not torch.equal(
        steered.steered, steered.unsteered
    )  # the edit moved the model
    mid = {"layer": place.layer, "site": "resid_mid"}  # the block of the S ablation the study ablates
    for kind, share in shares.items():
        row = one(dual, "gain_removed_ablate_S", set=kind, **mid)
        assert (row["value"], row["gain"], row["unreliable"], row["reason"]) == (
            share.value,
            share.gain,
            share.unreliable,
            share.reason,
        )
        assert one(dual, "loss_ablate_S", set=kind, **mid)["value"] == pytest.approx(share.ablated, rel=1e-12)
    assert r2 == pytest.approx(one(dual, "projection_r2", step=None)["value"], rel=1e-12)
    assert set(namespace["table"]["set"]) >= {"major", "ood"}


def test_projection_r2_and_its_variant_at_every_place_and_the_reference_are_the_stored_table(e3, folder):
    dual = stored(e3, "dual")
    tasks, per_task = MEASURE.projection_sizes  # the claims' draw
    ood, major = e3.heldout_tasks("ood", per_task, n_tasks=tasks), e3.heldout_tasks("major", per_task)
    study_tasks, study_per_task = SIZES.projection_study_sizes
    study_draw = e3.heldout_tasks("ood", study_per_task, n_tasks=study_tasks)
    geometry_ood = e3.heldout("ood", SIZES.geometry_sequences, split="geometry")
    for place in e3.places():
        row = one(dual, "table.projection_r2", layer=place.layer, site=place.site)
        r2 = e3.projection_r2(ood, major, place)
        assert (r2.mean, r2.quartiles) == (
            pytest.approx(row["value"], rel=1e-12),
            pytest.approx(row["band"], rel=1e-12),
        )
        if row["metric"] == "table.projection_r2" and (place.layer, place.site) == (
            one(dual, "projection_r2", step=None)["layer"],
            one(dual, "projection_r2", step=None)["site"],
        ):
            assert r2.standard_error == pytest.approx(one(dual, "projection_r2_se")["value"], rel=1e-12)
            study_major = e3.heldout_tasks("major", study_per_task)  # the study's draw, its per-task size
            assert e3.projection_r2(study_draw, study_major, place).mean == pytest.approx(
                one(dual, "projection_r2_study_draw")["value"], rel=1e-12
            )
        variant = e3.projection_r2(
            geometry_ood,
            e3.heldout("major", SIZES.geometry_sequences, split="geometry"),
            place,
            protocol=tg.protocol("per-sequence-r2"),
        )
        assert variant.mean == pytest.approx(
            one(dual, "table.projection_r2_per_sequence", layer=place.layer, site=place.site)["value"], rel=1e-6
        )
    reference = e3.projection_reference(ood, major)
    assert reference.mean == pytest.approx(one(dual, "projection_r2_reference")["value"], rel=1e-12)
    claims = tg.results(folder).claims.set_index("id")
    parts = claims.loc["e3.projection_r2_drop", "seeds"][0]["parts"]
    assert parts["k=-1.reference"] == pytest.approx(reference.mean, rel=1e-12) and parts["k=-1.ood_tasks"] == tasks
    with pytest.raises(AnalysisError, match="no variant of the measurement 'per-sequence'"):
        e3.projection_r2(ood, major, protocol=tg.protocol("per-sequence"))
    with pytest.raises(
        AnalysisError, match="no variant of the measurement 'e1-v6'"
    ):  # a variant of the data: other runs
        tg.protocol("e1-v6")
    with pytest.raises(ValueError, match="projection='per-state'"):
        dataclasses.replace(tg.STUDY, projection="per-state")


def test_the_orthogonal_search_gives_the_stored_ablated_losses(e3):
    dual = stored(e3, "dual")
    major = e3.heldout("major", SIZES.geometry_sequences, split="geometry")
    ood = e3.heldout("ood", SIZES.eval_sequences, split="loss")
    geometries = list(e3.geometries(major, [(layer, "resid_mid") for layer in range(e3.config.model.n_layers)]))
    for geometry, search in zip(geometries, e3.orthogonal_search([(g, 1) for g in geometries])):
        v = search.directions
        assert 0 <= search.best_step < search.steps <= SIZES.search_steps and len(search.losses) == search.steps
        assert v.shape == (geometry.basis.shape[0], 1) and (v.T.double() @ geometry.avoided.double()).abs().max() < 1e-5
        # E3's V avoids its search probe's task span (the K - 1 = 2 task contrasts at k = -1) and its tokens
        probe = geometry.search_probe
        assert geometry.avoided.shape[1] == 2 + geometry._token_span(probe).shape[1] and probe.basis.shape[1] == 2
        with e3.ablate(v, geometry.place):
            ablated = e3.loss(ood)
        row = one(dual, "loss_ablate_V", layer=geometry.place.layer, site=geometry.place.site, set="ood")
        assert ablated == pytest.approx(row["value"], rel=1e-12)


def test_steering_to_a_chosen_point_moves_the_model_to_the_mixture_computed_by_hand(e3):
    """On the trained E3 run, under the variant steer-at-read-site: the edit h - (h - mu_p) P_S + a
    theta at position 5 alone, applied by a plain hook where the vectors are read, gives the steered
    KL to sum_k a_k P_k(. | x_5) (the protocol's injection: tests/test_steering_values.py)."""
    major = e3.heldout("major", 64, split="measure")
    place = e3.places()[0]
    geometry = e3.geometry(major, place)
    a = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    result = geometry.steer(to=a, positions=[5], protocol=tg.protocol("steer-at-read-site"))
    tokens = major.batch.tokens
    basis, theta, mu = geometry.basis.float(), geometry.task_vectors.float(), geometry.mu[5].float()

    def by_hand(h: torch.Tensor) -> torch.Tensor:  # h: [N, 1, D] at position 5
        return h - (h - mu) @ basis @ basis.T + a.float() @ theta

    model = e3.model
    with torch.no_grad():
        plain = torch.log_softmax(model(tokens)[:, 5].double(), -1)
        with intervene(model, place, by_hand, slice(5, 6)):
            edited = torch.log_softmax(model(tokens)[:, 5].double(), -1)
    transitions = e3.pool.subset("major").params.double()  # [K, V, V]
    target = torch.einsum("k,kbv->bv", a, transitions[:, tokens[:, 5]])  # sum_k a_k P_k(. | x_5)

    def kl(logp: torch.Tensor) -> torch.Tensor:
        return (logp.exp() * (logp - target.log())).sum(-1)

    torch.testing.assert_close(result.unsteered, kl(plain), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(result.steered, kl(edited), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(result.steered, result.unsteered)  # the edit acts
    with pytest.raises(AnalysisError, match="sum to one"):
        geometry.steer(to=[0.6, 0.3, 0.3])
    with pytest.raises(AnalysisError, match=r"over the 3 major tasks, \[3\] or \[64, 3\]; got shape \(2,\)"):
        geometry.steer(to=[0.5, 0.5])


@pytest.mark.parametrize("recipe", ["e3", "e2"])
def test_ablation_losses_equal_a_plain_forward_hook(folder, recipe):
    """S (on the analysed positions: E2's separators), V, and both at once, against hooks written here."""
    run = tg.results(folder).run(recipe, diversity=-1, seed=0)
    geometry = run.geometry(run.heldout("major", 64, split="geometry"), run.places()[0])
    sequences = run.heldout("ood", 32, split="loss")
    gen = torch.Generator().manual_seed(0)
    v = torch.linalg.qr(torch.randn(geometry.basis.shape[0], 2, generator=gen, dtype=torch.float64))[0]
    place_v = run.places()[-1]
    positions = run.analysed_positions
    mu, basis = geometry.mu.float(), geometry.basis.float()

    def hooked(*edits) -> torch.Tensor:
        handles = []
        for place, edit in edits:

            def hook(_module, _inputs, out, edit=edit):
                out = out.clone()
                out[:, positions] = edit(out[:, positions])
                return out

            handles.append(run.model.site(*place).register_forward_hook(hook))
        try:
            with torch.no_grad():
                return run.family.position_losses(run.model, sequences.batch, *sequences.references)["loss"].mean(0)
        finally:
            for handle in handles:
                handle.remove()

    probe = geometry.probe.float()
    ablate_s = (geometry.place, lambda h: h - h @ probe @ probe.T)  # the protocol: h - h P_S, S the probe's
    centred_s = (geometry.place, lambda h: h - (h - mu) @ basis @ basis.T)  # the variant centred-S
    ablate_v = (place_v, lambda h: h - h @ v.float() @ v.float().T)
    clean = run.loss(sequences, per_position=True)
    torch.testing.assert_close(clean, hooked(), rtol=0, atol=1e-6)
    with geometry.ablate():
        torch.testing.assert_close(run.loss(sequences, per_position=True), hooked(ablate_s), rtol=0, atol=1e-5)
    with geometry.ablate(tg.protocol("centred-S")):
        torch.testing.assert_close(run.loss(sequences, per_position=True), hooked(centred_s), rtol=0, atol=1e-5)
    with geometry.ablate(tg.protocol("v-best-block")):  # a field the S ablation does not read: the study's S
        torch.testing.assert_close(run.loss(sequences, per_position=True), hooked(ablate_s), rtol=0, atol=1e-5)
    with run.ablate(v, place_v):  # float64 directions work as they are
        torch.testing.assert_close(run.loss(sequences, per_position=True), hooked(ablate_v), rtol=0, atol=1e-5)
    with geometry.ablate(), run.ablate(v, place_v):
        both = run.loss(sequences, per_position=True)
    torch.testing.assert_close(both, hooked(ablate_s, ablate_v), rtol=0, atol=1e-5)
    assert not torch.allclose(both, clean) and run.loss(sequences) == pytest.approx(
        float(clean[run.family.loss_from :].mean()), rel=1e-12
    )
    if recipe == "e3":  # a token family's loss is the cross-entropy of the next token, written out here
        with torch.no_grad():
            logp = torch.log_softmax(run.model(sequences.batch.tokens).double(), -1)
        nll = -logp[:, :-1].gather(-1, sequences.batch.tokens[:, 1:, None])[..., 0].mean(0)
        torch.testing.assert_close(clean, nll, rtol=0, atol=1e-9)


def test_cache_holds_the_states_the_hooks_capture(e3):
    major = e3.heldout("major", 32, split="measure")
    places = e3.places()
    states = e3.cache(major, places)
    with torch.no_grad(), capture(e3.model, places) as captured:
        e3.model(major.batch.tokens)
    assert list(states) == places and all(isinstance(p, tg.Place) for p in states)
    for place in places:
        torch.testing.assert_close(states[place], captured[place], rtol=0, atol=1e-5)


def test_a_split_or_a_set_that_does_not_exist_is_a_clear_error(e3):
    with pytest.raises(
        AnalysisError,
        match=r"unknown split 'mesure'; choose one of \['select', 'measure', 'geometry', 'loss', "
        r"'search-select', 'prior', 'projection', 'steering', 'probe', 'trajectory', 'transition', 'cells'\]",
    ):
        e3.heldout("major", 8, split="mesure")
    with pytest.raises(AnalysisError, match=r"split 'select' has no ood sequences; it has \['major'\]"):
        e3.heldout("ood", 8, split="select")
    with pytest.raises(
        AnalysisError, match=r"unknown set 'majors'; choose one of \['major', 'minor', 'ood', 'mixture'\]"
    ):
        e3.heldout("majors", 8, split="measure")
    with pytest.raises(AnalysisError, match="has no minor tasks"):
        e3.heldout("minor", 8, split="loss")
    with pytest.raises(AnalysisError, match="fitted on major sequences, not ood"):
        e3.geometry(e3.heldout("ood", 8, split="loss"), e3.places()[0])
    same = e3.heldout("major", 8, split=tg.Split.MEASURE).batch.tokens
    assert torch.equal(same, e3.heldout("major", 8, split="measure").batch.tokens)
    assert not torch.equal(same, e3.heldout("major", 8, split="select").batch.tokens)


def test_results_hold_every_share_with_its_gain(folder):
    results = tg.results(folder)
    assert set(results.rows["analysis"]) >= {"m1", "dual"} and len(results.claims) == results.claims["id"].nunique()
    shares = results.claims[results.claims["id"].str.contains(r"\.ablate_[SV]_")]
    assert len(shares)
    for claim in shares.itertuples():
        for seed in claim.seeds:
            assert {"gain", "unreliable", "clean_loss", "ablated_loss", "loss_first"} <= set(seed["parts"])
            # a share of a null or unreliable gain counts neither way: n/a for that seed
            assert (seed["status"] == "n/a") == (not seed["parts"]["gain"] >= tg.MIN_RELIABLE_GAIN), claim.id
            assert seed["parts"]["unreliable"] == (not seed["parts"]["gain"] >= tg.MIN_RELIABLE_GAIN)
    dual = results.rows[(results.rows["analysis"] == "dual") & results.rows["metric"].str.startswith("gain_removed")]
    assert dual["gain"].notna().all() and (dual["value"].notna() == (dual["gain"] > 0)).all()
    assert dual["value"].isna().any()  # the tiny runs have shares of a non-positive gain: the next line reads some
    assert dual.loc[dual["value"].isna(), "reason"].fillna("").astype(str).str.contains("not positive").all()
    curve = pd.read_csv(folder / "tables" / "rank_curve.csv")
    assert {"gain", "unreliable", "reason"} <= set(curve.columns) and (
        curve["value"].notna() == (curve["gain"] > 0)
    ).all()
    with pytest.raises(TaskgeomError, match="used no run of 'e3' at diversity 5"):
        results.run("e3", diversity=5)


def test_an_m1_file_of_an_earlier_row_version_is_not_read(folder, tmp_path):
    """Stored rows of another layout are measured again, never misread: the sensitivity table
    leaves such an m1.json out, and the M1 experiment rewrites it (as ``taskgeom analyze`` does)."""
    from taskgeom.analysis.stored.keys import FORMATS
    from taskgeom.analysis.stored.rows import stored_rows
    from taskgeom.experiments.sensitivity import place_choices

    shutil.copytree(tg.results(folder).run("e1").path, tmp_path / "run")
    run = tg.open_run(tmp_path / "run")
    rows = stored(run, "m1")
    assert stored_rows(run.directory, "m1") == rows and {r["version"] for r in rows} == {FORMATS["m1"]}
    assert {r["analysis"] for r in place_choices(run.directory)} == {"m1", "dual"}
    (run.path / "analysis" / "m1.json").write_text(json.dumps([{**r, "version": FORMATS["m1"] - 1} for r in rows]))
    assert stored_rows(run.directory, "m1") is None
    assert {r["analysis"] for r in place_choices(run.directory)} == {"dual"}


def test_the_run_at_each_kept_training_step_gives_the_stored_projection_across_training(e3):
    dual = stored(e3, "dual")
    study_tasks, per_task = SIZES.projection_study_sizes
    ood, major = e3.heldout_tasks("ood", per_task, n_tasks=study_tasks), e3.heldout_tasks("major", per_task)
    snapshots = e3.snapshots()
    assert list(snapshots) == sorted(snapshots) and len(snapshots) >= 1
    for step, snapshot in snapshots.items():
        assert snapshot.model is not e3.model and snapshot.path == e3.path
        r2 = snapshot.projection_r2(ood, major)
        assert r2.mean == pytest.approx(one(dual, "projection_r2", step=step)["value"], rel=1e-12), step


@pytest.mark.parametrize(
    "n_layers, expected",
    [
        (2, {3: 1, 4: 1, 0: 0, 5: 1}),
        (3, {3: 1, 4: 2, 0: 0, 5: 2}),
        (6, {b: b for b in range(6)}),
        (16, {3: 10, 4: 13, 0: 2, 5: 15}),
    ],
)
def test_place_at_depth_maps_a_study_block_of_six_to_the_same_relative_depth(n_layers, expected):
    for block, layer in expected.items():
        assert tg.Place.at_depth(block, 6, n_layers) == (layer, "resid_post")
        # the same relative depth by hand: the first block whose end reaches (block + 1) / 6 of the model
        assert min(l for l in range(n_layers) if (l + 1) / n_layers >= (block + 1) / 6) == layer


def test_place_at_depth_of_sixteen_blocks():
    assert [tg.Place.at_depth(b, 16, 16).layer for b in range(16)] == list(range(16))
    assert tg.Place.at_depth(10, 16, 3) == (2, "resid_post") and tg.Place.at_depth(9, 16, 3) == (1, "resid_post")
    assert tg.Place.at_depth(10, 16, 2).layer == 1 and tg.Place.at_depth(9, 16, 2).layer == 1
    with pytest.raises(Exception, match="no study block"):
        tg.Place.at_depth(6, 6, 2)

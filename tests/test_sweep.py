"""The sweep runner: one row set per run, failures isolated, restarts redo only unfinished runs."""

from __future__ import annotations

import json
import math

import pandas as pd
import yaml
from conftest import tiny_config

from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN
from taskgeom.analysis.stored.dual import load_dual
from taskgeom.analysis.stored.keys import FORMATS
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.sweep import Job, job_seconds, run_sweep, summary
from taskgeom.runs.folders import Run


def test_sweep_isolates_failures_and_resumes(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump({"base": tiny_config("dice", steps=30).model_dump(mode="json"), "profiles": {"quick": {}}})
    )
    root = tmp_path / "runs"
    jobs = [Job(str(recipe), k, 0, "quick", str(root)) for k in (-1, 1, 30)]
    table = run_sweep(jobs, Executor(workers=1), out=tmp_path)
    status = table.drop_duplicates(["diversity"]).set_index("diversity")["status"]
    assert status.to_dict() == {-1: "ok", 1: "ok", 30: "failed"}
    assert "diversity" in table[table["diversity"] == 30]["error"].iloc[0]
    wide = pd.read_csv(tmp_path / "sweep.csv")
    assert len(wide) == 3 and {"projection_r2@ood", "gain_removed_ablate_S@major", "gain_removed_ablate_V@ood"} <= set(
        wide.columns
    )
    finished = wide[wide["status"] == "ok"]
    for set_name in (
        "major",
        "ood",
    ):  # each share beside the gain it divides by: empty, with the reason, where there is none
        gain, share = finished[f"gain@{set_name}"], finished[f"gain_removed_ablate_S@{set_name}"]
        assert gain.notna().all() and (share.notna() == (gain > 0)).all()
        assert (finished[f"unreliable@{set_name}"] == ~(gain >= MIN_RELIABLE_GAIN)).all()
        assert finished.loc[gain <= 0, f"reason@{set_name}"].fillna("").astype(str).str.contains("not positive").all()
    steps = pd.read_csv(tmp_path / "by_step.csv")
    assert set(steps["diversity"]) == {-1, 1} and {"log_ratio", "projection_r2"} <= set(steps.columns)
    one = table[(table["diversity"] == -1) & table["step"].isna()]
    n_layers = tiny_config("dice", steps=30).model.n_layers
    for metric in (
        "gain_removed_ablate_S",
        "gain_removed_ablate_V",
        "gain_removed_random",
    ):  # every block's resid_mid, and their mean
        rows = one[one["metric"] == metric]
        assert len(rows) == 2 * (n_layers + 1) and set(rows["site"]) == {
            "resid_mid"
        }  # major and OOD (k = -1: no minors)
        assert sorted(rows["layer"].dropna()) == sorted([*range(n_layers)] * 2)
    d0 = one[one["metric"] == "d0"]["value"].iloc[0]
    ranks = one[one["metric"].str.startswith("gain_removed_ablate_V_rank")]
    assert (
        len(ranks[ranks["layer"].isna()]) == len(ranks) / (n_layers + 1) == min(math.ceil(d0), 16 - 2)
    )  # width 16 less S's rank (K - 1 at k = -1)
    assert {
        "place_selected",
        "projection_r2",
        "projection_r2_reference",
        "projection_r2_per_sequence",
        "loss_ablate_S",
        "loss_ablate_V",
    } <= set(one["metric"])
    fig4 = one[one["metric"].isin(["projection_r2", "projection_r2_tasks", "projection_r2_per_task"])].set_index(
        "metric"
    )
    assert (fig4.loc["projection_r2_tasks", "value"], fig4.loc["projection_r2_per_task", "value"]) == (
        1024,
        128,
    )  # 8x the study's 128 tasks, its 128 sequences
    assert (fig4.loc["projection_r2", "layer"], fig4.loc["projection_r2", "site"]) == (
        0,
        "resid_post",
    )  # block 4 of 6 of one block

    done, redo = (sorted(root.glob("tiny-dice-*"))[i] for i in (0, 1))
    run = Run.open(done)
    old = run.path / "analysis" / "dual.json"
    rows = json.loads(old.read_text())
    assert rows and load_dual(run) == rows  # the stored analysis is read as written
    old.write_text(json.dumps([{k: v for k, v in r.items() if k != "version"} for r in rows]))
    assert load_dual(run) is None  # an analysis of an earlier version is measured again
    old.write_text(json.dumps([{**r, "version": FORMATS["dual"] - 1} for r in rows]))
    assert load_dual(run) is None
    old.write_text(json.dumps([{**r, "protocol": "0" * 12} for r in rows]))  # measured under another protocol
    assert load_dual(run) is None
    old.write_text(json.dumps(rows))
    kept = {p: p.stat().st_mtime_ns for p in (done / "model.safetensors", done / "analysis" / "dual.json")}
    (redo / "model.safetensors").unlink()  # as if the sweep had been killed while training this run
    (redo / "analysis" / "dual.json").unlink()
    again = run_sweep(jobs[:2], Executor(workers=2), out=tmp_path)
    assert set(again["status"]) == {"ok"}
    first, second = job_seconds(table).set_index("run"), job_seconds(again).set_index("run")
    assert sorted(first["diversity"]) == [-1, 1] and (first[["train_wall_s", "analysis_wall_s"]] > 0).all().all()
    # reused, not retrained nor re-analysed (CPU seconds of the worker: independent of the machine's load)
    assert second.loc[str(done), "train_cpu_s"] < first.loc[str(done), "train_cpu_s"] / 5
    assert second.loc[str(done), "analysis_cpu_s"] < first.loc[str(done), "analysis_cpu_s"] / 5
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert (redo / "model.safetensors").exists() and (redo / "analysis" / "dual.json").exists()


def test_dual_analysis_runs_on_regression(tmp_path):
    """E2 goes through the same analysis: its own squared-error losses, probes of the ridge
    prediction; the token-only measurements (transition, Theorem 2) are absent."""
    config = tiny_config("dice", steps=20).model_dump(mode="json")
    config["name"] = "tiny-regression"
    config["task"] = {"family": "regression", "d": 2, "n_examples": 5, "diversity": 1}
    recipe = tmp_path / "reg.yaml"
    recipe.write_text(yaml.safe_dump({"base": config, "profiles": {"quick": {}}}))
    table = run_sweep([Job(str(recipe), 1, 0, "quick", str(tmp_path / "runs"))], Executor(workers=1))
    assert set(table["status"]) == {"ok"}, table.get("error")
    metrics = set(table["metric"])
    assert {
        "projection_r2",
        "gain_removed_ablate_S",
        "gain_removed_ablate_V",
        "gain_removed_random",
        "probe_r2_complement",
    } <= metrics
    assert {
        "projection_r2_se",
        "projection_r2_study_draw",
        "bayes_ood_loss",
        "bayes_ood_loss_first",
    } <= metrics  # ridge's squared error
    assert not any(m.startswith(("transition", "theorem2")) for m in metrics)
    first = table[(table["metric"] == "loss_first") & (table["set"] == "ood")]["value"].iloc[0]
    assert first > 1.0  # predicting y_0 with no examples: the prior variance d + noise^2 = 2.25


def test_a_sweep_that_meets_a_run_being_trained_reports_it_locked(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump({"base": tiny_config("dice", steps=30).model_dump(mode="json"), "profiles": {"quick": {}}})
    )
    jobs = [Job(str(recipe), k, 0, "quick", str(tmp_path / "runs")) for k in (-1, 1)]
    busy = Run.create(jobs[0].config(), jobs[0].root)
    with busy.writer():  # as another trainer would hold it (the sweep's worker is another process)
        table = run_sweep(jobs, Executor(workers=1), out=tmp_path)
    status = table.drop_duplicates(["diversity"]).set_index("diversity")["status"].to_dict()
    assert status == {-1: "locked", 1: "ok"}
    error = table[table["diversity"] == -1]["error"].iloc[0]
    assert "is being written by another process" in error and ".lock" in error
    assert not (busy.path / "model.safetensors").exists()


def test_the_summary_of_a_sweep_whose_every_run_failed_lists_the_failures():
    table = pd.DataFrame(
        [
            {"recipe": "e1", "diversity": k, "seed": 0, "status": "failed", "error": f"AnalysisError: run {k}"}
            for k in (-1, 2)
        ]
    )
    wide = summary(table)
    assert wide.to_dict("records") == [
        {"recipe": "e1", "diversity": -1, "seed": 0, "status": "failed", "error": "AnalysisError: run -1"},
        {"recipe": "e1", "diversity": 2, "seed": 0, "status": "failed", "error": "AnalysisError: run 2"},
    ]

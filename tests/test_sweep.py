"""The sweep runner: one row set per run, failures isolated, restarts redo only unfinished runs."""

from __future__ import annotations

import pandas as pd
import yaml

from conftest import tiny_config
from taskgeom.experiments.sweep import Job, run_sweep


def test_sweep_isolates_failures_and_resumes(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"base": tiny_config("dice", steps=30).model_dump(mode="json"), "profiles": {"quick": {}}}))
    root = tmp_path / "runs"
    jobs = [Job(str(recipe), k, 0, "quick", str(root)) for k in (-1, 1, 30)]
    table = run_sweep(jobs, workers=1, out=tmp_path)
    status = table.drop_duplicates(["diversity"]).set_index("diversity")["status"]
    assert status.to_dict() == {-1: "ok", 1: "ok", 30: "failed"}
    assert "diversity" in table[table["diversity"] == 30]["error"].iloc[0]
    wide = pd.read_csv(tmp_path / "sweep.csv")
    assert len(wide) == 3 and {"projection_r2@ood", "gain_removed_ablate_S@major", "gain_removed_ablate_V@ood"} <= set(wide.columns)
    assert set(pd.read_csv(tmp_path / "transition.csv")["diversity"]) == {-1, 1}

    done, redo = (sorted(root.glob("tiny-dice-*"))[i] for i in (0, 1))
    kept = {p: p.stat().st_mtime_ns for p in (done / "model.safetensors", done / "analysis" / "dual.json")}
    (redo / "model.safetensors").unlink()  # as if the sweep had been killed while training this run
    (redo / "analysis" / "dual.json").unlink()
    again = run_sweep(jobs[:2], workers=2, out=tmp_path)
    assert set(again["status"]) == {"ok"}
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert (redo / "model.safetensors").exists() and (redo / "analysis" / "dual.json").exists()

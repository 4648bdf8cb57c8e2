"""The paper profile, ready for whoever has the hardware: every run of its reproduction trains (a
few steps, on the CPU) at the study's sizes."""

from __future__ import annotations

import math

import pytest

from taskgeom.config import parameter_count
from taskgeom.experiments import Context, planned_runs
from taskgeom.experiments.schedule import plan_table
from taskgeom.runs import Run
from taskgeom.train import train


def test_the_paper_plan_is_the_study_s_grid_on_every_seed(tmp_path):
    table = plan_table(planned_runs(Context(tmp_path, "paper", (0, 1, 2))))
    sweep = table[table["recipe"].isin(["e1", "e2", "e3"])]
    assert sorted(sweep["diversity"].unique()) == list(range(-1, 11))
    assert len(sweep) == 3 * 12 * 3 and table["run"].is_unique and (table["steps"] == 30000).all()
    assert set(table[table["recipe"] == "e4"]["seed"]) == {0, 1, 2}


@pytest.mark.slow
def test_every_paper_run_trains_a_few_steps_on_the_cpu(tmp_path):
    tasks = {(t.config.name, t.config.task.diversity): t for t in planned_runs(Context(tmp_path, "paper", (0,)))}
    for (recipe, k), task in sorted(tasks.items()):
        config = task.config.model_copy(update={"train": task.config.train.model_copy(
            update={"steps": 2, "eval_every": 2, "checkpoint_every": 2, "snapshots": 0, "eval_batch": 8, "threads": 1})})
        run = Run.create(config, tmp_path / "runs")
        record = train(run, device="cpu")
        assert run.finished and math.isfinite(record["train_loss"]), (recipe, k, record)
        model = Run.open(run.path).load_model()  # the saved weights have the study's sizes
        assert sum(p.numel() for p in model.parameters()) == parameter_count(task.config), (recipe, k)

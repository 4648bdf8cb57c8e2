"""One schedule for all training: the runs every experiment declares are trained first, together,
and each equals the same run trained alone, bit for bit."""

from __future__ import annotations

import json

import yaml

from conftest import tiny_config
from taskgeom.experiments.base import Context, reproduce
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.schedule import TrainTask, unique_unfinished
from taskgeom.recipes import load_recipe
from taskgeom.runs import Run
from taskgeom.train import train


def _recipe(tmp_path, steps: int = 30):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"base": tiny_config("dice", steps=steps).model_dump(mode="json"), "profiles": {"quick": {}}}))
    return str(recipe)


def test_scheduled_runs_equal_runs_trained_alone_and_experiments_find_them_finished(tmp_path):
    recipe = _recipe(tmp_path)
    seen = {}

    def first(ctx: Context) -> None:
        seen["first"] = [ctx.trained(recipe, (f"task.diversity={k}",)) for k in (-1, 1)]

    def second(ctx: Context) -> None:
        seen["second"] = ctx.trained(recipe, ("task.diversity=-1",))

    first.runs = lambda ctx: [ctx.plan(recipe, (f"task.diversity={k}",)) for k in (-1, 1)]
    second.runs = lambda ctx: [ctx.plan(recipe, ("task.diversity=-1",))]  # shared with first: trained once
    out = tmp_path / "results"
    reproduce(out, "quick", {"first": first, "second": second}, Executor(workers=2))

    timings = json.loads((out / "timings.json").read_text())
    trained = [s for s in timings["stages"] if s["stage"].startswith("train")]
    assert [s["experiment"] for s in trained] == ["schedule", "schedule"]  # the experiments trained nothing
    assert all(s["where"] == "worker" for s in trained)
    assert seen["second"].path == seen["first"][0].path

    for k, scheduled in zip((-1, 1), seen["first"]):
        alone = Run.create(load_recipe(recipe, "quick", [f"task.diversity={k}"]), tmp_path / "alone")
        train(alone)
        for name in ("model.safetensors", "checkpoint.safetensors", "metrics.jsonl"):
            assert (scheduled.path / name).read_bytes() == (alone.path / name).read_bytes(), (k, name)


def test_the_schedule_takes_each_run_once_most_expensive_first(tmp_path):
    recipe = _recipe(tmp_path)
    small, big = (load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 40))
    tasks = [TrainTask(small, str(tmp_path), "cpu", "none", 1), TrainTask(big, str(tmp_path), "cpu", "none", 2),
             TrainTask(small, str(tmp_path), "cpu", "none", 2)]
    todo = unique_unfinished(tasks)
    assert [(t.config.train.steps, t.threads) for t in todo] == [(40, 2), (10, 1)]  # the first task naming a run sets its threads
    train(Run.create(big, tmp_path))
    assert [t.config.train.steps for t in unique_unfinished(tasks)] == [10]


def test_threads_never_outnumber_cores(tmp_path, monkeypatch):
    from taskgeom.experiments import schedule
    from taskgeom.timing import Profile

    recipe = _recipe(tmp_path)
    configs = [load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 20, 30, 40)]
    tasks = [TrainTask(c, str(tmp_path), "cpu", "none", threads) for c, threads in zip(configs, (1, 2, 1, 2))]
    groups = []
    monkeypatch.setattr(schedule.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(schedule, "_train_group", lambda group, workers: groups.append(([t.config.train.steps for t in group], workers)) or [])
    schedule.train_all(tasks, Executor(workers=2), Profile())
    assert groups == [([30, 10], 2), ([40, 20], 1)]  # single-thread runs two at a time; two-thread runs alone

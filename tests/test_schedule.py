"""One schedule for all training: the runs every experiment declares are trained first, together,
and each equals the same run trained alone, bit for bit."""

from __future__ import annotations

import json

import yaml
from conftest import tiny_config

from taskgeom.claims.registry import Experiment
from taskgeom.experiments import Context, reproduce
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.schedule import TrainTask, phases, plan
from taskgeom.experiments.sweep import Job, run_job
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe
from taskgeom.training.train import train


def _recipe(tmp_path, steps: int = 30):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump({"base": tiny_config("dice", steps=steps).model_dump(mode="json"), "profiles": {"quick": {}}})
    )
    return str(recipe)


def test_scheduled_runs_equal_runs_trained_alone_and_experiments_find_them_finished(tmp_path):
    recipe = _recipe(tmp_path)
    seen = {}

    def first(ctx: Context) -> None:
        seen["first"] = [ctx.trained(recipe, (f"task.diversity={k}",)) for k in (-1, 1)]

    def second(ctx: Context) -> None:
        seen["second"] = ctx.trained(recipe, ("task.diversity=-1",))

    experiments = {
        "first": Experiment(
            "first",
            (),
            first,
            lambda ctx: [task for k in (-1, 1) for task in ctx.plans(recipe, (f"task.diversity={k}",))],
        ),
        "second": Experiment(
            "second", (), second, lambda ctx: ctx.plans(recipe, ("task.diversity=-1",))
        ),  # shared with first: trained once
    }
    out = tmp_path / "results"
    reproduce(out, "quick", experiments, Executor(workers=2))

    timings = json.loads((out / "timings.json").read_text())
    trained = [s for s in timings["stages"] if s["stage"].startswith("train")]
    assert [s["experiment"] for s in trained] == ["schedule", "schedule"]  # the experiments trained nothing
    assert all(s["where"] == "worker" for s in trained)
    assert all(
        100 < s["peak_mb"] < timings["total"]["peak_mb"] + 1 for s in trained
    )  # a worker's own peak: torch at least
    assert seen["second"].path == seen["first"][0].path

    for k, scheduled in zip((-1, 1), seen["first"]):
        alone = Run.create(load_recipe(recipe, "quick", [f"task.diversity={k}"]), tmp_path / "alone")
        train(alone)
        for name in ("model.safetensors", "checkpoint.safetensors", "metrics.jsonl"):
            assert (scheduled.path / name).read_bytes() == (alone.path / name).read_bytes(), (k, name)


def test_the_schedule_takes_each_run_once_most_expensive_first(tmp_path):
    recipe = _recipe(tmp_path)
    small, big = (load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 40))
    tasks = [
        TrainTask(small, str(tmp_path), "cpu", "none", 1),
        TrainTask(big, str(tmp_path), "cpu", "none", 2),
        TrainTask(small, str(tmp_path), "cpu", "none", 2),
    ]
    todo = plan(tasks)
    assert [(u.task.config.train.steps, u.train_threads, u.analysis_threads) for u in todo] == [
        (40, 2, 0),
        (10, 1, 0),
    ]  # the first task naming a run sets its threads
    train(Run.create(big, tmp_path))
    assert [u.task.config.train.steps for u in plan(tasks)] == [10]


def test_an_analysis_runs_in_the_phase_of_its_threads_after_its_training(tmp_path):
    recipe = _recipe(tmp_path)
    a, b, c = (load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 20, 30))
    tasks = [
        TrainTask(a, str(tmp_path), "cpu", "none", 2),
        TrainTask(a, str(tmp_path), "cpu", "none", 1, analyse=True),
        TrainTask(b, str(tmp_path), "cpu", "none", 1, analyse=True),
        TrainTask(c, str(tmp_path), "cpu", "none", 2),
    ]
    steps = [
        (threads, [(u.task.config.train.steps, u.train_threads, u.analysis_threads) for u in group])
        for threads, group in phases(plan(tasks))
    ]
    # a trains with 2 threads (its first task's) and is analysed with 1 (the sweep's), in the single-thread phase
    assert steps == [(2, [(30, 2, 0), (10, 2, 0)]), (1, [(20, 1, 1), (10, 0, 1)])]


def test_threads_never_outnumber_cores(tmp_path, monkeypatch):
    from taskgeom.experiments import schedule
    from taskgeom.training.timing import Timings

    recipe = _recipe(tmp_path)
    configs = [load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 20, 30, 40)]
    tasks = [TrainTask(c, str(tmp_path), "cpu", "none", threads) for c, threads in zip(configs, (1, 2, 1, 2))]
    groups = []
    monkeypatch.setattr(schedule, "usable_cores", lambda: 2)
    monkeypatch.setattr(
        schedule,
        "_run_phase",
        lambda group, workers, failed: groups.append(([u.task.config.train.steps for u in group], workers)) or [],
    )
    schedule.train_all(tasks, Executor(workers=2), Timings())
    assert groups == [([40, 20], 1), ([30, 10], 2)]  # two-thread runs alone, then single-thread runs two at a time


def test_the_schedule_analyses_a_sweep_run_as_the_sweep_would(tmp_path):
    """The dual analysis done in the schedule writes the dual.json the sweep writes for the same
    run alone (bitwise); the sweep then finds it and analyses nothing."""
    from taskgeom.experiments.schedule import train_all
    from taskgeom.training.timing import Timings

    recipe = _recipe(tmp_path, steps=40)
    job = Job(recipe, -1, 0, "quick", str(tmp_path / "alone"))
    assert run_job(job, threads=1)[0]["status"] == "ok"
    config = job.config()
    profile = Timings()
    train_all(
        [TrainTask(config, str(tmp_path / "scheduled"), "cpu", "none", 1, analyse=True)], Executor(workers=2), profile
    )
    name = f"{config.name}-{config.digest()}"
    for file in ("model.safetensors", "analysis/dual.json"):
        assert (tmp_path / "scheduled" / name / file).read_bytes() == (tmp_path / "alone" / name / file).read_bytes(), (
            file
        )
    assert [s.stage.split()[0] for s in profile.stages] == ["train", "analyse"]
    again = run_job(Job(recipe, -1, 0, "quick", str(tmp_path / "scheduled")), threads=1)
    assert (
        again[0]["analysis_cpu_s"] < 1.0
        and plan([TrainTask(config, str(tmp_path / "scheduled"), "cpu", "none", 1, analyse=True)]) == []
    )


def test_an_analysis_needing_more_threads_than_its_training_never_oversubscribes(tmp_path):
    recipe = _recipe(tmp_path)
    a, b = (load_recipe(recipe, "quick", [f"train.steps={n}"]) for n in (10, 20))
    tasks = [
        TrainTask(a, str(tmp_path), "cpu", "none", 1, analyse=False),
        TrainTask(a, str(tmp_path), "cpu", "none", 2, analyse=True),
        TrainTask(b, str(tmp_path), "cpu", "none", 1),
    ]
    steps = [
        (threads, [(u.task.config.train.steps, u.train_threads, u.analysis_threads) for u in group])
        for threads, group in phases(plan(tasks))
    ]
    assert steps == [
        (2, [(10, 1, 2)]),
        (1, [(20, 1, 0)]),
    ]  # trained with 1 thread, then analysed with 2, in the 2-thread phase


def test_no_analysis_of_a_run_whose_training_failed_and_a_damaged_run_is_left_to_its_experiment(tmp_path, monkeypatch):
    from taskgeom.experiments import schedule
    from taskgeom.training.timing import Timings

    recipe = _recipe(tmp_path)
    config = load_recipe(recipe, "quick", ["train.steps=10"])
    task = TrainTask(config, str(tmp_path), "cpu", "none", 2, analyse=True)
    done = []

    def fake(group, workers, failed):
        for unit in group:
            done.append((unit.train_threads, unit.analysis_threads))
            yield unit, (RuntimeError("boom") if unit.train_threads else {"analyse": (0.0, 0.0)})

    monkeypatch.setattr(schedule, "_run_phase", fake)
    schedule.train_all(
        [
            TrainTask(config, str(tmp_path), "cpu", "none", 2),
            TrainTask(config, str(tmp_path), "cpu", "none", 1, analyse=True),
        ],
        Executor(workers=2),
        Timings(),
    )
    assert done == [(2, 0)]  # the analysis of the run that failed to train is not attempted
    task.path.mkdir(parents=True)
    (task.path / "model.safetensors").write_bytes(b"")
    (task.path / "run.json").write_text("[]")  # damaged: planned as not analysed, not an error here
    assert [(u.train_threads, u.analysis_threads) for u in plan([task])] == [(0, 2)]


def _step(log: list, name: str, fails: bool = False) -> dict:
    log.append(name)
    if fails:
        raise RuntimeError(f"{name} broke")
    return {f"measure {name}": (0.0, 0.0, 1.0)}


def test_a_prepared_measurement_starts_once_what_it_reads_is_done_and_never_after_a_failure():
    from functools import partial

    from taskgeom.experiments.schedule import Prepared, _run_phase, chain_costs

    log: list[str] = []

    def item(name, needs=(), cost=1.0, fails=False):
        return Prepared("x", name, needs, 1, partial(_step, log, name, fails), cost)

    items = [
        item("lone", cost=5.0),
        item("late", ("first",), cost=3.0),
        item("first", cost=1.0),
        item("broken", cost=0.5, fails=True),
        item("after-broken", ("broken",), cost=9.0),
        item("after-earlier-failure", ("gone",), cost=9.0),
        item("outside", ("a run trained in an earlier phase",)),
    ]
    assert chain_costs(items)["first"] == 4.0 and chain_costs(items)["broken"] == 9.5
    failed = {"gone"}
    results = dict((i.name, r) for i, r in _run_phase(items, 1, failed))
    # the longest chain first (broken heads 9.5, lone 5, first 4 then late), a need from an earlier phase counts as done
    assert log == ["broken", "lone", "first", "late", "outside"]
    assert isinstance(results["after-broken"], RuntimeError) and "broken" in str(results["after-broken"])
    assert isinstance(results["after-earlier-failure"], RuntimeError)
    assert failed == {"gone", "broken", "after-broken", "after-earlier-failure"}
    seconds, peak = results["late"]
    assert seconds == {"measure late": (0.0, 0.0, 1.0)} and peak > 10  # and this process's peak
    cycle = [item("p", ("q",)), item("q", ("p",))]
    assert all(isinstance(r, RuntimeError) for _, r in _run_phase(cycle, 1, set()))


def test_m1_measured_beside_on_the_pool_equals_m1_measured_by_its_experiment(tmp_path):
    """A prepared M1 analysis, made on the schedule's pool with the reproducing process's two threads
    (whose OpenMP threads wait asleep there), writes the m1.json and m1.safetensors that the experiment
    writes analysing the same run in this process: bit for bit."""
    import shutil
    from functools import partial

    from taskgeom.analysis.protocol import measured_under
    from taskgeom.analysis.study import StudyRun
    from taskgeom.experiments.m1 import analyse_stored, stored_or_analyzed
    from taskgeom.experiments.schedule import Prepared, train_all
    from taskgeom.settings.devices import torch_threads
    from taskgeom.settings.recipes import load_measure, load_study
    from taskgeom.training.timing import Timings

    protocol = load_measure(load_study("e1").path, "smoke").analysis_protocol
    runs = []
    for seed in (0, 1):
        run = Run.create(load_recipe("e1", "smoke", [f"train.seed={seed}", "task.diversity=-1"]), tmp_path / "pool")
        train(run)
        runs.append(run)
    shutil.copytree(tmp_path / "pool", tmp_path / "alone")
    timings = Timings()
    prepared = [
        Prepared("m1", f"m1 {run.path.name}", (run.path.name,), 2, partial(analyse_stored, run.path), 1.0, protocol)
        for run in runs
    ]
    train_all([], Executor(workers=2), timings, prepared)
    assert sorted(s.stage for s in timings.stages) == sorted(f"analyse {run.path.name}" for run in runs)
    assert {s.where for s in timings.stages} == {"worker"}
    assert all(s.peak_mb > 10 for s in timings.stages)  # each stage's own worker peak
    with measured_under(protocol), torch_threads(2):
        for run in runs:
            stored_or_analyzed(StudyRun(Run.open(tmp_path / "alone" / run.path.name)))
    for run in runs:
        for file in ("m1.json", "m1.safetensors"):
            alone = (tmp_path / "alone" / run.path.name / "analysis" / file).read_bytes()
            assert (run.path / "analysis" / file).read_bytes() == alone, (run.path.name, file)


def test_a_worker_that_dies_fails_its_items_and_the_schedule_goes_on():
    """A worker process that dies breaks the pool: what it ran and what was still to start come back
    as failures (left to the experiments), and no exception escapes the schedule."""
    import os
    from functools import partial

    from taskgeom.experiments.schedule import Prepared, _run_phase

    items = [
        Prepared("x", "dies", (), 1, partial(os._exit, 1), 3.0),
        Prepared("x", "beside", (), 1, partial(dict), 2.0),
        Prepared("x", "later", (), 1, partial(dict), 1.0),
        Prepared("x", "after-it", ("dies",), 1, partial(dict), 0.5),
    ]
    failed: set[str] = set()
    results = dict((item.name, result) for item, result in _run_phase(items, 2, failed))
    assert sorted(results) == ["after-it", "beside", "dies", "later"]
    assert isinstance(results["dies"], BaseException) and isinstance(results["after-it"], RuntimeError)
    assert {"dies", "after-it"} <= failed

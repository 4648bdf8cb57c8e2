"""The Ray executor: a sweep on a local Ray instance equals the local pool's, restarts redo nothing,
a crashed task is one failure among successes, and bad executor settings stop with exit code 2.
Ray is an optional extra: the tests that need it are skipped where it is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import tiny_config
from safetensors.torch import load_file
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.executors import Executor, execute
from taskgeom.experiments.sweep import Job, run_sweep
from taskgeom.settings.devices import default_workers

HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture(scope="module")
def ray():
    """The ray module; the test is skipped where the extra is not installed."""
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_instance(ray):
    """A local Ray instance started by the test, not by the executor."""
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _recipe(folder):
    recipe = folder / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump({"base": tiny_config("dice", steps=30).model_dump(mode="json"), "profiles": {"quick": {}}})
    )
    return recipe


def _jobs(recipe, root) -> list[Job]:
    return [Job(str(recipe), k, seed, "quick", str(root)) for k, seed in ((-1, 0), (1, 1))]


@pytest.fixture(scope="module")
def ray_sweep(tmp_path_factory, ray):
    """A tiny sweep run on a local Ray instance that the executor starts and stops itself:
    (its recipe, its folder, whether Ray was stopped afterwards)."""
    folder = tmp_path_factory.mktemp("ray_sweep")
    recipe = _recipe(folder)
    table = run_sweep(_jobs(recipe, folder / "runs"), Executor("ray", workers=2, cpus_per_run=1), folder)
    assert set(table["status"]) == {"ok"}, table.get("error")
    return recipe, folder, not ray.is_initialized()


def test_ray_sweep_equals_local_pool(ray_sweep, tmp_path):
    recipe, on_ray, stopped = ray_sweep
    assert stopped  # the executor stopped the instance it started
    local = tmp_path
    table = run_sweep(_jobs(recipe, local / "runs"), Executor("local", workers=2, cpus_per_run=1), local)
    assert set(table["status"]) == {"ok"}, table.get("error")

    for name in ("sweep.csv", "by_step.csv"):  # floats are written round-trip exact
        assert (on_ray / name).read_text() == (local / name).read_text()
    assert len((on_ray / "sweep.csv").read_text().splitlines()) == 1 + 2
    runs = sorted(p.name for p in (local / "runs").glob("tiny-dice-*"))
    assert len(runs) == 2 and runs == sorted(p.name for p in (on_ray / "runs").glob("tiny-dice-*"))
    for name in runs:
        mine, theirs = (load_file(where / "runs" / name / "model.safetensors") for where in (local, on_ray))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_restarting_a_finished_ray_sweep_redoes_nothing(ray_sweep, ray_instance, ray):
    recipe, folder, _ = ray_sweep
    root = folder / "runs"
    tables = {name: (folder / name).read_text() for name in ("sweep.csv", "by_step.csv")}
    written = {
        p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and not p.name.startswith("index.sqlite")
    }
    assert len([p for p in written if p.name == "model.safetensors"]) == 2

    run_sweep(_jobs(recipe, root), Executor("ray", cpus_per_run=1), folder)
    assert ray.is_initialized()  # the instance the test started is left running
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert {p for p in root.rglob("*") if p.is_file() and not p.name.startswith("index.sqlite")} == set(written)
    assert {name: (folder / name).read_text() for name in tables} == tables


def test_a_crashed_ray_task_is_one_failure(ray_instance, ray):
    def crash_on_one(item: int, threads: int) -> int:
        if item == 1:
            os._exit(3)  # the worker process dies without raising
        return item * 10

    results = dict(execute(crash_on_one, [0, 1, 2], Executor("ray", cpus_per_run=1)))
    assert results[0] == 0 and results[2] == 20
    assert isinstance(results[1], ray.exceptions.RayError)


def test_ray_tasks_start_with_the_kernels_this_process_chose(ray_instance, ray, monkeypatch):
    from taskgeom.settings import kernels

    chosen = dict(kernels.PINS) | {kernels.CHOICE_VARIABLE: "pinned"}
    for name, value in chosen.items():
        monkeypatch.setenv(name, value)

    def kernel_variables(item: int, threads: int) -> dict:
        return {name: os.environ.get(name) for name in chosen}

    ((_, seen),) = execute(kernel_variables, [0], Executor("ray", cpus_per_run=1))
    assert seen == chosen


def test_a_dead_job_becomes_a_failed_row(tmp_path, monkeypatch, ray):
    """What the executor yields for a crashed task turns into that job's failed row; the others stand."""
    jobs = _jobs(_recipe(tmp_path), tmp_path / "runs")
    submitted = [job.for_ray(0) for job in jobs]  # what run_sweep hands the executor
    finished = [
        (submitted[0], ray.exceptions.WorkerCrashedError()),
        (submitted[1], [{"run": "r", "status": "ok", "metric": "m", "value": 1.5}]),
    ]
    monkeypatch.setattr("taskgeom.experiments.sweep.execute", lambda fn, items, executor: iter(finished))
    table = run_sweep(jobs, Executor("ray"), tmp_path).set_index("diversity")
    assert table.loc[-1, "status"] == "failed" and table.loc[-1, "error"].startswith("WorkerCrashedError")
    assert table.loc[1, "status"] == "ok" and table.loc[1, "seed"] == 1 and table.loc[1, "value"] == 1.5
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 1 + 2


def test_ray_refuses_resources_the_cluster_lacks(ray_instance, ray):
    gpus = ray.cluster_resources().get("GPU", 0)
    with pytest.raises(TaskgeomError, match="GPU"):
        list(execute(lambda item, threads: item, [0], Executor("ray", gpus_per_run=gpus + 1)))
    with pytest.raises(TaskgeomError, match="CPU"):
        list(execute(lambda item, threads: item, [0], Executor("ray", cpus_per_run=3)))


def test_resources_are_checked_per_node_not_summed():
    """Two 4-CPU nodes cannot run a 6-CPU task, though they hold 8 CPUs together."""
    from taskgeom.experiments.executors import _check_resources

    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0}]
    _check_resources(nodes, Executor("ray", cpus_per_run=4, gpus_per_run=1))
    with pytest.raises(TaskgeomError, match="no node of the Ray cluster has more than 4"):
        _check_resources(nodes, Executor("ray", cpus_per_run=6))


def test_an_address_nobody_answers_is_refused_at_once(tmp_path, ray):
    """In a fresh process (this one may already hold a Ray connection, which a sweep reuses). An
    address nobody answers is the environment refusing (exit 3); one that is not HOST:PORT is bad
    input (exit 2)."""
    recipe = _recipe(tmp_path)
    for address, message, code in (
        ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1", 3),
        ("nohost", "must look like HOST:PORT", 2),
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "taskgeom",
                "sweep",
                str(recipe),
                "--diversity",
                "-1",
                "--seeds",
                "0",
                "--out",
                str(tmp_path),
                "--executor",
                "ray",
                "--address",
                address,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == code and message in result.stderr, result.stderr
        assert not list(tmp_path.glob("tiny-dice-*"))


def test_ray_jobs_use_a_gpu_only_when_they_declare_one():
    """Ray hides no GPU from a task declaring none, so `auto` must mean the CPU there."""
    job = Job("e1", -1, 0, device="auto")
    assert job.for_ray(0).device == "cpu" and job.for_ray(0.5).device == "auto"
    assert Job("e1", -1, 0, device="cuda").for_ray(1).device == "cuda"
    with pytest.raises(TaskgeomError, match="needs --gpus-per-run above 0"):
        Job("e1", -1, 0, device="cuda").for_ray(0)
    with pytest.raises(TaskgeomError, match="uses the GPU Ray assigns it"):
        Job("e1", -1, 0, device="cuda:1").for_ray(1)


def test_ray_is_imported_only_when_asked_for():
    code = "import sys, taskgeom.cli, taskgeom.experiments; print('ray' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_missing_ray_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    recipe = _recipe(tmp_path)
    result = CliRunner().invoke(
        app, ["sweep", str(recipe), "--diversity", "-1", "--seeds", "0", "--out", str(tmp_path), "--executor", "ray"]
    )
    assert result.exit_code == 2
    assert "pip install taskgeom[ray]" in result.output
    assert not list(tmp_path.glob("tiny-dice-*"))


@pytest.mark.parametrize(
    "options, message",
    [
        (["--executor", "dask"], "unknown executor 'dask'"),
        (["--address", "10.0.0.1:6379"], "need --executor ray"),
        (["--gpus-per-run", "0.5"], "need --executor ray"),
        (["--executor", "ray", "--cpus-per-run", "-1"], "--cpus-per-run must be at least 1"),
        (["--executor", "ray", "--gpus-per-run", "-0.5"], "--gpus-per-run must be"),
        (["--executor", "ray", "--gpus-per-run", "1.5"], "--gpus-per-run must be"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--executor", "ray", "--device", "gpu"], "unknown device 'gpu'"),
        (["--tracker", "mlflow"], "unknown tracker 'mlflow'"),
    ],
)
def test_bad_executor_and_training_options_exit_2(tmp_path, options, message):
    result = CliRunner().invoke(app, ["sweep", str(_recipe(tmp_path)), "--out", str(tmp_path), *options])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not list(tmp_path.glob("tiny-dice-*"))


@pytest.mark.parametrize(
    "options, executor, device, tracker",
    [
        ([], Executor("local", default_workers()), "auto", "none"),
        (
            ["--workers", "3", "--cpus-per-run", "2", "--device", "cpu", "--tracker", "tensorboard"],
            Executor("local", 3, None, 2, 0.0),
            "cpu",
            "tensorboard",
        ),
        pytest.param(
            ["--executor", "ray", "--workers", "1", "--cpus-per-run", "1", "--device", "cpu"],
            Executor("ray", 1, None, 1, 0.0),
            "cpu",
            "none",
            marks=pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra"),
        ),
    ],
)
def test_reproduce_takes_the_executor_options(tmp_path, monkeypatch, options, executor, device, tracker):
    """The options of `reproduce` reach the context every experiment receives."""
    import taskgeom.experiments
    from taskgeom.claims.registry import Experiment

    seen = []
    record = Experiment("record", (), seen.append)
    monkeypatch.setattr(taskgeom.experiments, "declared", lambda studies, profile: {"record": record})
    result = CliRunner().invoke(app, ["reproduce", "--out", str(tmp_path), *options])
    assert result.exit_code == 0, result.output
    (ctx,) = seen
    assert (ctx.executor, ctx.device, ctx.tracker) == (executor, device, tracker)


def test_the_sweeps_of_reproduce_run_on_its_executor(tmp_path, monkeypatch):
    """dual_modes hands the context's executor to its sweep, and its device and tracker to every job."""
    from taskgeom.experiments.base import Context

    dual_modes = importlib.import_module(
        "taskgeom.experiments.dual_modes"
    )  # the package exports a function of that name

    class Stop(Exception):
        pass

    calls = []

    def record(jobs, executor, out=None):
        calls.append((jobs, executor, out))
        raise Stop

    monkeypatch.setattr(dual_modes, "run_sweep", record)
    executor = Executor("local", workers=3, cpus_per_run=2)
    with pytest.raises(Stop):
        dual_modes.dual_modes(Context(tmp_path, "quick", executor=executor, device="cpu", tracker="tensorboard"))
    ((jobs, used, out),) = calls
    assert used is executor and out == tmp_path / "tables"
    assert jobs and {(job.device, job.tracker, job.root) for job in jobs} == {
        ("cpu", "tensorboard", str(tmp_path / "runs"))
    }

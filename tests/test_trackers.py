"""Optional trackers: TensorBoard event files and an offline W&B run receive the evaluation
records that metrics.jsonl holds; unknown or missing trackers are refused before any work."""

from __future__ import annotations

import sys

import pytest
import yaml
from conftest import tiny_config
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.sweep import Job, run_sweep
from taskgeom.runs.folders import Run
from taskgeom.training.trackers import check_tracker, scalars
from taskgeom.training.train import train

runner = CliRunner()


def test_tensorboard_holds_the_metrics_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    train(run, device="cpu", tracker="tensorboard")
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    records = run.metrics()
    assert set(events.Tags()["scalars"]) == set(scalars(records[0]))
    for name in ("major/loss", "ood/excess", "train/loss"):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        expected = [(r["step"], scalars(r)[name]) for r in records]
        assert [s for s, _ in logged] == [s for s, _ in expected]
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)  # stored as float32


def test_wandb_writes_an_offline_run_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    train(run, device="cpu", tracker="wandb")
    offline = list((run.path / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run.path / "wandb").iterdir())
    history = b"".join(path.read_bytes() for path in offline[0].glob("*.wandb"))
    assert b"major/loss" in history and b"ood/excess" in history
    assert run.metrics()[-1]["step"] == 40  # metrics.jsonl is written as always


def test_unknown_and_missing_trackers_are_refused(tmp_path, monkeypatch):
    with pytest.raises(TaskgeomError, match="unknown tracker 'mlflow'"):
        check_tracker("mlflow")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TaskgeomError, match=r"pip install taskgeom\[wandb\]"):
        check_tracker("wandb")
    result = runner.invoke(app, ["train", "e1", "--tracker", "mlflow", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown tracker" in result.output
    assert not any(tmp_path.iterdir())


def test_sweep_runs_log_to_the_tracker(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump({"base": tiny_config("dice", steps=20).model_dump(mode="json"), "profiles": {"quick": {}}})
    )
    jobs = [
        Job(str(recipe), k, 0, "quick", str(tmp_path / "runs"), device="cpu", tracker="tensorboard") for k in (-1, 1)
    ]
    table = run_sweep(jobs, Executor(workers=1))
    assert set(table["status"]) == {"ok"}, table.get("error")
    runs = sorted((tmp_path / "runs").glob("tiny-dice-*"))
    assert len(runs) == 2 and all(list((run / "tensorboard").glob("events.out.tfevents.*")) for run in runs)


class Interrupt(Exception):
    pass


def _interrupt_at(step: int):
    def progress(done: int, _total: int, _loss: float) -> None:
        if done == step:
            raise Interrupt

    return progress


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_resumed_run_continues_its_tracker_without_duplicates(tmp_path, monkeypatch, kind):
    """Stopped at step 30 with the checkpoint at 20, then resumed: TensorBoard holds each step once
    with metrics.jsonl's values; W&B continues the run under the same id."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = Run.create(tiny_config("dice", checkpoint_every=20), path=tmp_path / "r")
    with pytest.raises(Interrupt):
        train(run, _interrupt_at(30), device="cpu", tracker=kind)
    if kind == "wandb":
        first_id = (run.path / "wandb" / "taskgeom-id").read_text()
    train(run, device="cpu", tracker=kind)
    records = run.metrics()
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    if kind == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run.path / "tensorboard"))
        events.Reload()
        logged = events.Scalars("major/loss")
        assert [e.step for e in logged] == [10, 20, 30, 40]
        assert [e.value for e in logged] == pytest.approx([scalars(r)["major/loss"] for r in records], rel=1e-6)
    else:
        assert (run.path / "wandb" / "taskgeom-id").read_text() == first_id
        offline = list((run.path / "wandb").glob("offline-run-*"))  # one per session
        assert offline and all(first_id in path.name for path in offline)

"""The trainer: determinism, exact resume after SIGKILL, and refusing bad run directories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_config
from taskgeom.cli import app
from taskgeom.runs import Run
from taskgeom.train import learning_rate, train

runner = CliRunner()


def write_recipe(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump({"base": config.model_dump(mode="json"), "profiles": {"quick": {}}}))
    return path


def test_learning_rate_is_triangular():
    rates = [learning_rate(s, 10, 1.0, 0.5) for s in range(10)]
    assert rates == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


@pytest.mark.parametrize("family", ["dice", "markov"])
def test_same_seed_gives_identical_metrics(tmp_path, family):
    config = tiny_config(family)
    first, second = Run.create(config, path=tmp_path / "a"), Run.create(config, path=tmp_path / "b")
    train(first), train(second)
    assert first.metrics_path.read_text() == second.metrics_path.read_text()
    assert len(first.metrics()) == 4 and first.metrics()[-1]["step"] == 40
    assert {"major", "ood"} <= set(first.metrics()[-1]["eval"])
    other = Run.create(tiny_config(family, seed=1), path=tmp_path / "c")
    train(other)
    assert other.metrics_path.read_text() != first.metrics_path.read_text()


def test_training_beats_the_untrained_model(tmp_path):
    run = Run.create(tiny_config("dice", steps=150), path=tmp_path / "r")
    record = train(run)
    first = run.metrics()[0]["eval"]["major"]["excess"]
    assert record["eval"]["major"]["excess"] < first
    assert record["eval"]["major"]["excess"] < 0.1


def test_resume_after_sigkill_is_bitwise_identical(tmp_path):
    config = tiny_config("dice", steps=1000, checkpoint_every=25, eval_every=250)
    recipe = write_recipe(tmp_path / "recipe.yaml", config)
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "taskgeom", "train", str(recipe), "--run-dir", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoint.safetensors").exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "model.safetensors").exists(), "training finished before it could be killed"
    resumed = Run.open(killed)
    resumed_from = int(load_file(str(resumed.checkpoint_path))["optim.0.step"].item())
    assert 0 < resumed_from < 1000
    train(resumed)
    straight = Run.create(config, path=tmp_path / "straight")
    train(straight)
    a, b = load_file(str(resumed.model_path)), load_file(str(straight.model_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.metrics_path.read_text() == straight.metrics_path.read_text()


@pytest.fixture
def finished(tmp_path):
    run = Run.create(tiny_config("dice", steps=10), path=tmp_path / "done")
    train(run)
    return run


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_cli_rejects_unknown_key_and_bad_size():
    for setting, message in [("train.stepz=3", "unknown config field 'train.stepz'"), ("model.d_model=0", "'model.d_model'")]:
        result = runner.invoke(app, ["train", "e1", "--set", setting])
        assert result.exit_code == 2 and message in result.output


def test_cli_rejects_a_run_directory_of_another_config(tmp_path, finished):
    recipe = write_recipe(tmp_path / "other.yaml", tiny_config("dice", steps=11))
    before = _snapshot(finished.path)
    result = runner.invoke(app, ["train", str(recipe), "--run-dir", str(finished.path)])
    assert result.exit_code == 2 and "different config" in result.output
    assert _snapshot(finished.path) == before


def test_cli_rejects_truncated_and_foreign_checkpoints(tmp_path, finished):
    data = finished.model_path.read_bytes()
    finished.model_path.write_bytes(data[: len(data) // 2])
    before = _snapshot(finished.path)
    result = runner.invoke(app, ["eval", str(finished.path)])
    assert result.exit_code == 2 and "truncated or corrupt" in result.output
    assert _snapshot(finished.path) == before

    finished.model_path.write_bytes(b"\x00" * 64)
    assert runner.invoke(app, ["eval", str(finished.path)]).exit_code == 2

    other = Run.create(tiny_config("dice", steps=12), path=tmp_path / "other")
    train(other)
    finished.model_path.write_bytes(other.model_path.read_bytes())
    result = runner.invoke(app, ["eval", str(finished.path)])
    assert result.exit_code == 2 and "written for config" in result.output


def test_cli_rejects_a_corrupt_checkpoint_when_resuming(tmp_path):
    config = tiny_config("dice", steps=20)
    run = Run.create(config, path=tmp_path / "r")
    train(run)
    run.model_path.unlink()  # unfinished again, with a damaged checkpoint to resume from
    run.checkpoint_path.write_bytes(run.checkpoint_path.read_bytes()[:100])
    before = _snapshot(run.path)
    result = runner.invoke(app, ["train", str(write_recipe(tmp_path / "c.yaml", config)), "--run-dir", str(run.path)])
    assert result.exit_code == 2 and "truncated or corrupt" in result.output
    assert _snapshot(run.path) == before


def test_cli_rejects_a_run_directory_from_another_version(finished):
    meta = finished.path / "run.json"
    meta.write_text(meta.read_text().replace('"format": 1', '"format": 99'))
    result = runner.invoke(app, ["eval", str(finished.path)])
    assert result.exit_code == 2 and "run format 99" in result.output


def test_cli_eval_writes_tidy_rows(finished):
    import pandas as pd

    result = runner.invoke(app, ["eval", str(finished.path)])
    assert result.exit_code == 0, result.output
    table = pd.read_json(finished.path / "analysis" / "eval.json")
    assert set(table.columns) == {"set", "position", "metric", "value"}
    assert set(table["set"]) == {"major", "ood"} and table["position"].max() == 14
    assert (finished.path / "figures" / "loss_by_position.png").stat().st_size > 0

"""The trainer: determinism, exact resume after SIGKILL, refusing bad run directories and
checkpoints, and divergence as an outcome."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_config
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.errors import CheckpointError, RunDirError, TrainingDiverged
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import CHECKPOINT_FORMAT
from taskgeom.training import train as train_module
from taskgeom.training.train import learning_rate, train

runner = CliRunner()


def write_recipe(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump({"base": config.model_dump(mode="json"), "profiles": {"quick": {}}}))
    return path


def test_learning_rate_is_triangular():
    rates = [learning_rate(s, 10, 1.0, 0.5) for s in range(10)]
    assert rates == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_learning_rate_rises_from_its_floor_and_decays_to_it_linearly_or_on_a_cosine():
    """By hand: floor 0.1, peak 1.1, 10 steps, 5 of warm-up; the cosine's share of the span at
    (steps - step) / 5 = 0.8, 0.6, ... is (1 - cos(pi * share)) / 2."""
    rise = [0.3, 0.5, 0.7, 0.9, 1.1]
    assert [learning_rate(s, 10, 1.1, 0.5, 0.1) for s in range(10)] == pytest.approx(rise + [1.1, 0.9, 0.7, 0.5, 0.3])
    cosine = [0.1 + (1 - math.cos(math.pi * share)) / 2 for share in (1.0, 0.8, 0.6, 0.4, 0.2)]
    assert cosine[1:] == pytest.approx([1.0045085, 0.7545085, 0.4454915, 0.1954915])
    assert [learning_rate(s, 10, 1.1, 0.5, 0.1, "cosine") for s in range(10)] == pytest.approx(rise + cosine)
    assert [learning_rate(s, 10, 1.0, 0.5, 0.0) for s in range(10)] == [
        learning_rate(s, 10, 1.0, 0.5) for s in range(10)
    ]
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        learning_rate(0, 10, 1.0, 0.5, 0.0, "step")


@pytest.mark.parametrize(
    "recipe,start,end", [("e1", 1e-5, 1e-5), ("e3", 1e-5, 1e-5), ("e4", 2e-5, 2e-5), ("e2", 0.0, 0.0)]
)
def test_the_paper_schedules_are_the_study_s(recipe, start, end):
    """docs/protocol.md#the-studys-settings-the-paper-profile: from the floor to the peak at 15k of 30k steps and back to the floor."""
    from taskgeom.settings.recipes import load_recipe

    cfg = load_recipe(recipe, "paper").train
    rate = [
        learning_rate(s, cfg.steps, cfg.lr, cfg.warmup_frac, cfg.lr_floor, cfg.schedule) for s in (-1, 14999, 30000)
    ]
    assert cfg.steps == 30000 and rate == pytest.approx([start, cfg.lr, end], abs=1e-12)


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
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskgeom", "train", str(recipe), "--run-dir", str(killed)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
    for setting, message in [
        ("train.stepz=3", "unknown config field 'train.stepz'"),
        ("model.d_model=0", "'model.d_model'"),
    ]:
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


# ---- checkpoint metadata ----------------------------------------------------------------------
def _hand_made_checkpoint(run: Run, **meta: str) -> None:
    """checkpoint.safetensors with the weights of a fresh model and the metadata ``meta`` (besides
    format and config digest): what a damaged or foreign writer could leave."""
    tensors = {f"model.{k}": v.contiguous() for k, v in run.new_model().state_dict().items()}
    save_file(
        tensors,
        str(run.checkpoint_path),
        metadata={"format": CHECKPOINT_FORMAT, "config_digest": run.config.digest(), **meta},
    )


@pytest.mark.parametrize(
    "meta, shown",
    [
        ({"loss_sum": "0.0", "loss_count": "0"}, "'step' is missing"),
        ({"step": "ten", "loss_sum": "0.0", "loss_count": "0"}, "'step' is 'ten'"),
        ({"step": "2.5", "loss_sum": "0.0", "loss_count": "0"}, "'step' is '2.5'"),
        ({"step": "-1", "loss_sum": "0.0", "loss_count": "0"}, "'step' is '-1'"),
        ({"step": "41", "loss_sum": "0.0", "loss_count": "0"}, "'step' is '41', expected an integer in 0..40"),
        ({"step": "10", "loss_sum": "nan", "loss_count": "0"}, "'loss_sum' is 'nan'"),
        ({"step": "10", "loss_sum": "0.0"}, "'loss_count' is missing"),
    ],
)
def test_checkpoint_metadata_is_checked_and_the_message_says_how_to_restart(tmp_path, meta, shown):
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    _hand_made_checkpoint(run, **meta)
    with pytest.raises(CheckpointError) as caught:
        train(run)
    message = str(caught.value)
    assert (
        shown in message
        and f"delete {run.checkpoint_path} to train the run from scratch" in message
        and "\n" not in message
    )
    assert not run.model_path.exists() and not run.metrics_path.exists()
    run.checkpoint_path.unlink()  # the advice works
    assert train(run)["step"] == 40


def test_a_valid_hand_made_checkpoint_is_resumed_from_its_step(tmp_path):
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    _hand_made_checkpoint(run, step="30", loss_sum="0.0", loss_count="0")
    train(run)
    assert [record["step"] for record in run.metrics()] == [40]


def test_cli_corrupt_checkpoint_message_says_how_to_restart(tmp_path):
    config = tiny_config("dice", steps=20)
    run = Run.create(config, path=tmp_path / "r")
    _hand_made_checkpoint(run, step="many")
    result = runner.invoke(app, ["train", str(write_recipe(tmp_path / "c.yaml", config)), "--run-dir", str(run.path)])
    assert (
        result.exit_code == 2
        and "'step' is 'many'" in result.output
        and "to train the run from scratch" in result.output
    )


# ---- divergence -------------------------------------------------------------------------------
def _strict_json(line: str) -> dict:
    """json.loads that refuses NaN and Infinity (not standard JSON)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def test_strict_json_refuses_nan():
    with pytest.raises(ValueError):
        _strict_json('{"loss": NaN}')


def _poison_training_loss(monkeypatch, at_call: int, value: float) -> None:
    """Make train_step report ``value`` from its ``at_call``-th call on (1-based)."""
    real, calls = train_module.train_step, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return value if len(calls) >= at_call else loss

    monkeypatch.setattr(train_module, "train_step", poisoned)


def _assert_diverged(run: Run, step: int, metric: str, value: str, caught: pytest.ExceptionInfo) -> None:
    message = str(caught.value)
    assert (
        "\n" not in message
        and f"diverged at step {step} of 40: {metric} is {value}" in message
        and str(run.path) in message
    )
    assert _strict_json(run.path.joinpath("run.json").read_text())["status"] == "diverged"
    assert Run.open(run.path).diverged == {"step": step, "metric": metric, "value": value}
    assert Run.open(run.path).status == "diverged"
    assert not run.model_path.exists()
    with pytest.raises(RunDirError, match=f"diverged at step {step} "):
        run.load_model()


def test_a_nan_training_loss_stops_training_and_marks_the_run(tmp_path, monkeypatch):
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    _poison_training_loss(monkeypatch, at_call=25, value=math.nan)
    with pytest.raises(TrainingDiverged) as caught:
        train(run)
    _assert_diverged(run, 25, "train_loss", "nan", caught)
    lines = run.metrics_path.read_text().splitlines()
    assert [_strict_json(line)["step"] for line in lines] == [10, 20]  # nothing from the diverged stretch
    monkeypatch.undo()
    with pytest.raises(TrainingDiverged, match="not trained again"):  # refused at once, nothing retrained
        train(run)
    assert run.metrics_path.read_text().splitlines() == lines


def test_an_infinite_held_out_loss_stops_training(tmp_path, monkeypatch):
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    real, calls = train_module.summary, []

    def poisoned(model, sets):
        calls.append(1)
        result = real(model, sets)
        if len(calls) == 3:
            result["major"]["loss"] = math.inf
        return result

    monkeypatch.setattr(train_module, "summary", poisoned)
    with pytest.raises(TrainingDiverged) as caught:
        train(run)
    _assert_diverged(run, 30, "eval.major.loss", "inf", caught)
    assert [_strict_json(line)["step"] for line in run.metrics_path.read_text().splitlines()] == [10, 20]


def test_a_non_finite_reference_value_is_written_as_null(tmp_path, monkeypatch):
    run = Run.create(tiny_config("dice"), path=tmp_path / "r")
    real = train_module.summary

    def with_nan_reference(model, sets):
        result = real(model, sets)
        result["ood"]["bayes_ood_loss"] = math.nan
        return result

    monkeypatch.setattr(train_module, "summary", with_nan_reference)
    train(run)
    records = [_strict_json(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert all(r["eval"]["ood"]["bayes_ood_loss"] is None and math.isfinite(r["eval"]["ood"]["loss"]) for r in records)
    assert run.status == "finished" and run.diverged is None


def test_a_huge_learning_rate_diverges_through_the_cli(tmp_path):
    config = tiny_config("dice", lr=1e6)
    recipe = write_recipe(tmp_path / "huge.yaml", config)
    result = runner.invoke(app, ["train", str(recipe), "--run-dir", str(tmp_path / "r")])
    assert result.exit_code != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "diverged at step" in errors[0] and "Traceback" not in result.output
    run = Run.open(tmp_path / "r")
    assert run.status == "diverged" and not run.model_path.exists()
    for line in run.metrics_path.read_text().splitlines() if run.metrics_path.exists() else []:
        _strict_json(line)
    for command in (["eval", str(run.path)], ["analyze", str(run.path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and f"run {run.path} diverged at step" in result.output, (command, result.output)
        assert "Traceback" not in result.output


def test_a_run_json_without_status_still_opens(finished):
    meta = {"format": 1, "taskgeom": "0.1.0", "digest": finished.config.digest()}  # as written before the status field
    (finished.path / "run.json").write_text(json.dumps(meta))
    run = Run.open(finished.path)
    assert run.status == "finished" and run.diverged is None and run.load_model() is not None


def test_a_model_with_non_finite_weights_is_refused(finished):
    from safetensors.torch import load_file as load

    tensors = load(str(finished.model_path))
    name = sorted(tensors)[0]
    tensors[name][0] = math.nan
    save_file(
        tensors,
        str(finished.model_path),
        metadata={"format": CHECKPOINT_FORMAT, "config_digest": finished.config.digest(), "step": "10"},
    )
    with pytest.raises(RunDirError, match="non-finite weights"):
        finished.load_model()


@pytest.mark.parametrize("content", [b"[1, 2]", b"\xff\xfe not utf-8"])
def test_an_odd_run_json_is_a_run_dir_error(finished, content):
    (finished.path / "run.json").write_bytes(content)
    with pytest.raises(RunDirError, match="run.json"):
        Run.open(finished.path)


def test_eval_json_is_standard_json_when_a_reference_is_not_finite(finished, monkeypatch):
    from taskgeom.training import evaluate

    real = evaluate.per_position

    def with_nan_reference(model, evalset):
        rows = real(model, evalset)
        rows["bayes_ood_loss"][0] = math.nan
        return rows

    monkeypatch.setattr(evaluate, "per_position", with_nan_reference)
    rows = evaluate.evaluate_run(finished)
    on_disk = _strict_json((finished.path / "analysis" / "eval.json").read_text())
    assert on_disk == rows
    assert [r["position"] for r in rows if r["value"] is None] == [0, 0]  # major and ood
    assert all(math.isfinite(r["value"]) for r in rows if r["value"] is not None)


def test_a_damaged_metrics_line_of_a_finished_run_is_named(finished):
    finished.metrics_path.write_bytes(finished.metrics_path.read_bytes()[:-10])
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 1 is not a JSON record"):
        train(finished)


def test_a_runs_thread_count_does_not_leak_into_the_next_run(tmp_path):
    """A run with train.threads set trains with that many torch threads and leaves the process as
    it found it, so the next run this process trains (whose result depends on its thread count)
    gets the same threads as if it had been trained alone."""
    import torch
    from conftest import tiny_config

    outside = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's setting, different from the run's
    config = tiny_config("dice", steps=4).model_copy(
        update={"train": tiny_config("dice", steps=4).train.model_copy(update={"threads": 1})}
    )
    seen = []
    original = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = record
    try:
        train(Run.create(config, tmp_path))
    finally:
        torch.optim.AdamW.step = original
    leaked = torch.get_num_threads()
    torch.set_num_threads(outside)
    assert set(seen) == {1}
    assert leaked == 2


def textbook_attention(self, x):
    """Attention as first written: queries and keys rotated one after the other, half by half."""
    B, T, D = x.shape
    head_dim = D // self.n_heads
    q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, head_dim).permute(2, 0, 3, 1, 4)
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    rotated = []
    for part in (q, k):
        x1, x2 = part.chunk(2, dim=-1)
        rotated.append(torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1))
    y = torch.nn.functional.scaled_dot_product_attention(*rotated, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(B, T, D))


def textbook_step(model, opt, family, batch, grad_clip):
    """The training step as first written, on the CPU (no clipping when grad_clip is None)."""
    loss = family.training_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


def test_grad_clip_null_trains_unclipped():
    """grad_clip null (the study's E1/E3): the step equals an unclipped textbook step, and differs
    from a clipped one (a clip far below the gradient's norm)."""
    from taskgeom.settings.recipes import load_recipe

    run = Run("unused", load_recipe("e1", "quick", ["train.grad_clip=null"]))
    cfg = run.config.train
    batch = run.family.sample(run.pool, cfg.batch_size, run.config.task.seq_len, 0, 0)
    models = []
    for step, clip in ((train_module.train_step, None), (textbook_step, None), (textbook_step, 1e-4)):
        model = run.new_model()
        opt = train_module.make_optimizer(model, 1e-3, cfg.weight_decay)
        opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = 1e-3
        (
            step(model, opt, run.family, batch, torch.device("cpu"), "fp32", clip)
            if step is train_module.train_step
            else step(model, opt, run.family, batch, clip)
        )
        models.append(model.state_dict())
    assert all(torch.equal(models[0][name], models[1][name]) for name in models[0])
    assert not all(torch.equal(models[0][name], models[2][name]) for name in models[0])


def test_the_step_trains_the_textbook_model_bit_for_bit(monkeypatch):
    """The trainer's speed-ups change no float: a few steps of the quick E1 model give weights
    equal, exactly, to the textbook step's."""
    from taskgeom.models.transformer import Attention
    from taskgeom.settings.recipes import load_recipe

    run = Run("unused", load_recipe("e1"))
    cfg = run.config.train
    batches = [run.family.sample(run.pool, cfg.batch_size, run.config.task.seq_len, 0, step) for step in range(3)]
    fast = run.new_model()
    fast_opt = train_module.make_optimizer(fast, cfg.lr, cfg.weight_decay)
    for batch in batches:
        train_module.train_step(fast, fast_opt, run.family, batch, torch.device("cpu"), "fp32", cfg.grad_clip)
    monkeypatch.setattr(Attention, "forward", textbook_attention)
    slow = run.new_model()
    slow_opt = torch.optim.AdamW(
        [
            {"params": [p for p in slow.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in slow.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    for batch in batches:
        textbook_step(slow, slow_opt, run.family, batch, cfg.grad_clip)
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state.keys() == slow_state.keys()
    assert all(torch.equal(fast_state[name], slow_state[name]) for name in fast_state)

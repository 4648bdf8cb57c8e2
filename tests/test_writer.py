"""One writer per run directory (an OS lock held for the whole training, released by the kernel
when its process dies), uniquely named temporary files, and file modes that follow the umask."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_config

from taskgeom.errors import RunDirError, RunLockedError
from taskgeom.runs.folders import LOCK_NAME, Run
from taskgeom.runs.storage import atomic_write_text, exclusive_lock, load_tensors, save_tensors
from taskgeom.training.train import train

SRC = str(Path(__file__).parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _steps(run: Run) -> list[int]:
    return [json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines()]


# ---- the lock ---------------------------------------------------------------------------------
HOLD = """
import sys, time
from taskgeom.runs.storage import exclusive_lock
with exclusive_lock(sys.argv[1], "test"):
    print("locked", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a child process holding the lock of a new run directory; yields (run, child)."""
    run = Run.create(tiny_config("dice", steps=20), path=tmp_path / "r")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run.path / LOCK_NAME)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        yield run, child
    finally:
        child.kill()
        child.wait()


def test_a_lock_held_by_another_process_refuses_training(holder):
    run, child = holder
    with pytest.raises(RunLockedError) as caught:
        train(run)
    message = str(caught.value)
    assert (
        f"pid {child.pid} on host {socket.gethostname()}" in message
        and str(run.path / LOCK_NAME) in message
        and "\n" not in message
    )
    assert not run.metrics_path.exists() and not run.checkpoint_path.exists() and not run.model_path.exists()


def test_a_lock_left_by_a_killed_process_does_not_block(holder):
    run, child = holder
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (run.path / LOCK_NAME).read_text().split()[0] == str(
        child.pid
    )  # the file stays; the lock went with the process
    assert train(run)["step"] == 20
    assert (run.path / LOCK_NAME).read_text().split() == [str(os.getpid()), socket.gethostname()]


def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    run = Run.create(tiny_config("dice", steps=20), path=tmp_path / "r")
    with run.writer():
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            train(run)
    assert train(run)["step"] == 20  # released at the end of the block


def test_two_concurrent_trainings_of_one_run(tmp_path):
    """Two `taskgeom train` of one recipe and run directory started together: one trains, the other
    exits 2 naming the lock and the first one's process id; metrics.jsonl has each step once."""
    config = tiny_config("dice", steps=600, eval_every=100, checkpoint_every=25)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": config.model_dump(mode="json"), "profiles": {"quick": {}}}))
    command = [sys.executable, "-m", "taskgeom", "train", str(recipe), "--run-dir", str(tmp_path / "r")]
    procs = [
        subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [(proc.pid, proc.wait(timeout=300), proc.stderr.read()) for proc in procs]
    for proc in procs:
        proc.stdout.close(), proc.stderr.close()
    codes = sorted(code for _, code, _ in results)
    assert codes == [0, 2], (
        f"expected one run to train and one to be refused (did the first finish before the second started?): {results}"
    )
    ((winner, _, _),) = [r for r in results if r[1] == 0]
    ((_, _, refused),) = [r for r in results if r[1] == 2]
    lines = [line for line in refused.splitlines() if line.strip()]
    assert len(lines) == 1 and f"pid {winner} on host" in lines[0] and LOCK_NAME in lines[0], refused
    run = Run.open(tmp_path / "r")
    assert run.finished and _steps(run) == [100, 200, 300, 400, 500, 600]


def test_a_directory_holding_only_a_lock_and_temporary_files_can_become_a_run(tmp_path):
    path = tmp_path / "r"
    path.mkdir()
    (path / LOCK_NAME).write_text("12345\n")
    (path / ".config.yaml.abc123.tmp").write_text("half")
    assert Run.create(tiny_config("dice"), path=path).config.digest() == tiny_config("dice").digest()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a taskgeom run directory"):
        Run.create(tiny_config("dice"), path=tmp_path / "other")
    with pytest.raises(RunDirError, match="is a file"):
        Run.create(tiny_config("dice"), path=tmp_path / "other" / "notes.txt")


# ---- temporary files --------------------------------------------------------------------------
def test_checkpoints_are_written_through_unique_temporary_files(tmp_path):
    target = tmp_path / "checkpoint.safetensors"
    (tmp_path / f".{target.name}.tmp").mkdir()  # the old fixed temporary name, taken
    tensors = {"w": torch.arange(1000.0)}
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(20):
                save_tensors(target, {"w": tensors["w"] + i}, {"writer": str(i)})
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    loaded, meta = load_tensors(target)
    assert torch.equal(loaded["w"], tensors["w"] + int(meta["writer"]))  # one whole write, never a mix
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, f".{target.name}.tmp"]
    )  # no temporary file left


# ---- file modes -------------------------------------------------------------------------------
@pytest.fixture
def umask():
    """Set the process umask for one test (``umask(value)``), restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_written_files_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    atomic_write_text(tmp_path / "a.txt", "x")
    save_tensors(tmp_path / "t.safetensors", {"w": torch.zeros(2)}, {})
    run = Run.create(tiny_config("dice", steps=10, snapshots=2), path=tmp_path / "r")
    train(run)
    files = [tmp_path / "a.txt", tmp_path / "t.safetensors"] + [p for p in run.path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {
        "run.json",
        "config.yaml",
        "metrics.jsonl",
        "checkpoint.safetensors",
        "model.safetensors",
        LOCK_NAME,
    } <= names
    assert any(p.parent.name == "snapshots" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


def test_a_run_directory_cut_short_after_its_config_is_finished_by_the_same_config_only(tmp_path):
    """config.yaml is written before run.json: a directory holding only config.yaml is one whose
    making was cut short (or is under way in another process, which holds the lock)."""
    made = Run.create(tiny_config("dice"), path=tmp_path / "r")
    (made.path / "run.json").unlink()
    assert Run.create(tiny_config("dice"), path=tmp_path / "r").config.digest() == made.config.digest()
    (made.path / "run.json").unlink()
    with pytest.raises(RunDirError, match="config.yaml of another config and no run.json"):
        Run.create(tiny_config("dice", steps=41), path=tmp_path / "r")
    with exclusive_lock(made.path / LOCK_NAME, "test"):  # another process making it now: refused, naming the lock
        with pytest.raises(RunLockedError, match="being written by another process"):
            Run.create(tiny_config("dice"), path=tmp_path / "r")


# ---- one writer per results folder ---------------------------------------------------------------
REPRODUCE = """
import sys
from taskgeom.cli import app
sys.argv = ["taskgeom", "reproduce", "--recipes", "e1", "--seeds", "0", "--grid", "-1", "--only", "bayes_optimum",
            "--workers", "1", "--out", sys.argv[1], "--set", "train.steps=20", "--set", "train.batch_size=8",
            "--set", "train.eval_every=10", "--set", "train.checkpoint_every=20", "--set", "train.snapshots=0"]
app()
"""


def test_a_second_reproduction_into_one_results_folder_is_refused_with_nothing_written(tmp_path):
    """Two processes, one folder: while a reproduction holds the folder (a child process started
    first, holding it as ``reproduce`` does), a second ``taskgeom reproduce`` exits 3 before it
    trains or writes anything; once the first has ended, the same command runs and writes the
    manifests whole."""
    from taskgeom.experiments import RESULTS_LOCK

    out = tmp_path / "results"
    out.mkdir()
    (out / "claims.json").write_text("[]")  # what the first writer has written so far
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out / RESULTS_LOCK)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        second = subprocess.run(
            [sys.executable, "-c", REPRODUCE, str(out)], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"results folder {out} is being written by another process (pid {child.pid}" in " ".join(
            second.stderr.split()
        )
        assert (
            sorted(p.relative_to(out) for p in out.rglob("*")) == before and (out / "claims.json").read_text() == "[]"
        )
    finally:
        child.kill()
        child.wait()
    third = subprocess.run(
        [sys.executable, "-c", REPRODUCE, str(out)], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert third.returncode in (0, 1), third.stdout + third.stderr
    assert json.loads((out / "claims.json").read_text()) and (out / "reproduction.json").is_file()

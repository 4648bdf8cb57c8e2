"""``benchmarks/device_check.sh`` end to end on the CPU (docs/device-check.md): the CUDA tests (which
skip here), E1 and E3 trained at the paper profile shrunk to a tiny model, both analysed, and the
folder it writes: the machine, the timings of both runs and a manifest that names the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The paper profile shrunk to a 1-block, 16-wide model on 16-token sequences, trained 6 steps.
TINY = [
    "model.n_layers=1",
    "model.d_model=16",
    "model.d_mlp=32",
    "task.seq_len=16",
    "model.max_len=16",
    "train.batch_size=8",
    "train.eval_batch=16",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "train.snapshots=0",
    "train.threads=1",
]


def check(out: Path, budget: int, least: int = 10) -> tuple[dict, dict]:
    """Run the script on the CPU into ``out`` within ``budget`` seconds, each analysis given at least
    ``least``; check what every check writes, and return (timings, manifest)."""
    env = os.environ | {
        "DEVICE": "cpu",
        "STEPS": "6",
        "SEQUENCES": "32",
        "BUDGET": str(budget),
        "MIN_SECONDS": str(least),
        "EXTRA_SETS": " ".join(TINY),
        "PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_check.sh"), str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "steps per second on cpu" in done.stdout and "analyses (taskgeom analyze, 32 sequences, on cpu" in done.stdout
    )

    timings = json.loads((out / "timings.json").read_text())
    assert timings["device"] == "cpu" and set(timings["runs"]) == {"e1", "e3"} and timings["cuda_tests_s"] > 0
    for recipe, run in timings["runs"].items():
        assert run["steps"] == 6 and run["device"] == "cpu" and run["analysis_device"] == "cpu", recipe
        assert run["train_s"] > 0 and run["steps_per_s"] > 0, recipe
        assert run["analyze_s"] > 0 and run["eval_s"] > 0 and run["analysis_s"] > 0, recipe
        folder = out / run["run_dir"]
        assert folder.name.startswith(f"{recipe}-") and (folder / "model.safetensors").is_file(), recipe

    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["device"] == "cpu"
        and manifest["analysis_device"] == "cpu"
        and manifest["device_name"]
        and manifest["torch"]
    )
    assert manifest["cuda_tests"]["exit_code"] == 0 and "skipped" in manifest["cuda_tests"]["summary"]
    commands = manifest["commands"]
    assert len(commands) == 7 and "tests/test_devices.py" in commands[0]
    for recipe in ("e1", "e3"):
        assert any(
            f"train {recipe} --profile paper --device cpu" in c
            and "task.diversity=-1" in c
            and "train.seed=0" in c
            and "train.steps=6" in c
            for c in commands
        ), recipe
    assert "torch" in (out / "machine.txt").read_text() and (out / "cuda-tests.txt").is_file()
    return timings, manifest


@pytest.mark.slow  # 60-90 s on the busy 2-core machine: E3's analysis alone is half a minute at any size (its fixed-size parts)
def test_the_device_check_runs_end_to_end_on_the_cpu(tmp_path):
    timings, _ = check(tmp_path / "check", budget=1200)
    for recipe, run in timings["runs"].items():
        assert run["analyze_finished"] and run["eval_finished"], recipe
        folder = tmp_path / "check" / run["run_dir"]
        assert (folder / "analysis" / "m1.json").is_file() and (folder / "analysis" / "eval.json").is_file(), recipe


def test_the_device_check_stops_an_analysis_at_its_budget_and_still_writes_everything(tmp_path):
    """With no budget left, each command gets the floor, here 1 s: E3's analysis (its start-up
    alone takes longer on any machine; its fixed-size parts 8-30 s) is stopped there and recorded as
    unfinished, and the check still succeeds. (At the default 10 s floor a fast, quiet machine
    finishes it: the floor is a setting, not a machine's speed.)"""
    timings, _ = check(tmp_path / "check", budget=1, least=1)
    e3 = timings["runs"]["e3"]
    assert e3["analyze_finished"] is False and e3["analyze_s"] >= 1
    assert "timeout --kill-after=10 1 " in " ".join(
        json.loads((tmp_path / "check" / "manifest.json").read_text())["commands"]
    )

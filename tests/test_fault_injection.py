"""Fault injection: a sweep of three tiny runs killed with SIGKILL while one run is finished and
another is half trained, then restarted, ends with exactly the results of a sweep never
interrupted (sweep.csv, by_step.csv, and per run the model and checkpoint, the metrics and the
analysis).

The safetensors files are compared as their header (parsed) and their tensor bytes: safetensors
writes the metadata map in a random order on every save, so two identical runs do not give
identical file bytes (``test_identical_saves_give_identical_bytes``, expected to fail until
``storage.save_tensors`` writes its metadata in a fixed order)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config

DIVERSITIES = "-1,0,1"
POLL_S = 0.005
TIMEOUT_S = 120


def _sweep(recipe: Path, out: Path, log: Path) -> subprocess.Popen:
    """``taskgeom sweep`` in its own process group (so that SIGKILL reaches all of it), one run
    at a time in that process, one thread per run."""
    command = [
        sys.executable,
        "-m",
        "taskgeom",
        "sweep",
        str(recipe),
        "--diversity",
        DIVERSITIES,
        "--seeds",
        "0",
        "--out",
        str(out),
        "--workers",
        "1",
        "--cpus-per-run",
        "1",
        "--device",
        "cpu",
    ]
    with open(log, "w") as stream:
        return subprocess.Popen(
            command, cwd=out.parent, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True
        )


def _state(out: Path) -> dict[str, set[str]]:
    """Run directories by stage: ``training`` (a checkpoint, no final model), ``analysed``."""
    runs = list(out.glob("tiny-dice-*"))
    return {
        "training": {
            r.name for r in runs if (r / "checkpoint.safetensors").exists() and not (r / "model.safetensors").exists()
        },
        "analysed": {r.name for r in runs if (r / "analysis" / "dual.json").exists()},
    }


def _files(out: Path) -> set[str]:
    """Every file a run or the sweep wrote, but the index and temp files (never trusted, never read)."""
    return {
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file() and p.name != "index.sqlite" and "tmp" not in p.name and p.name != ".lock"
    }


def _safetensors(path: Path) -> tuple[dict, bytes]:
    """(header with its metadata, the tensor bytes) of a safetensors file."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def test_a_sweep_killed_mid_way_and_restarted_ends_as_one_never_interrupted(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    config = tiny_config("dice", steps=60, checkpoint_every=10, eval_every=20).model_dump(mode="json")
    recipe.write_text(yaml.safe_dump({"base": config, "profiles": {"quick": {}}}))
    reference_out, victim_out = tmp_path / "reference", tmp_path / "victim"
    reference_out.mkdir()
    victim_out.mkdir()

    reference = _sweep(recipe, reference_out, tmp_path / "reference.log")  # runs beside the victim
    victim = _sweep(recipe, victim_out, tmp_path / "victim.log")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # one run finished and analysed, another half trained
            state = _state(victim_out)
            if state["analysed"] and state["training"] - state["analysed"]:
                os.killpg(victim.pid, signal.SIGKILL)
                break
            if victim.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the sweep was never caught half way (exit {victim.returncode}, last state {state}): "
                    f"{(tmp_path / 'victim.log').read_text()[-2000:]}"
                )
            time.sleep(POLL_S)
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    killed = _state(victim_out)
    assert len(killed["analysed"]) < 3 and killed["training"], killed
    assert not (victim_out / "sweep.csv").exists()
    half = sorted(killed["training"])[0]
    assert not (victim_out / half / "model.safetensors").exists()

    restarted = _sweep(recipe, victim_out, tmp_path / "restart.log")
    assert restarted.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "restart.log").read_text()[-3000:]
    assert reference.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "reference.log").read_text()[-3000:]

    for name in ("sweep.csv", "by_step.csv"):  # floats are written round-trip exact
        assert (victim_out / name).read_text() == (reference_out / name).read_text(), name
    assert len((reference_out / "sweep.csv").read_text().splitlines()) == 1 + 3
    assert _files(victim_out) == _files(reference_out)
    runs = sorted(p.name for p in reference_out.glob("tiny-dice-*"))
    assert len(runs) == 3 and half in runs
    for run in runs:
        for name in ("model.safetensors", "checkpoint.safetensors"):
            assert _safetensors(victim_out / run / name) == _safetensors(reference_out / run / name), (run, name)
        for name in ("metrics.jsonl", "analysis/dual.json"):
            assert (victim_out / run / name).read_bytes() == (reference_out / run / name).read_bytes(), (run, name)


def test_identical_saves_give_identical_bytes(tmp_path):
    """Twelve saves of the same tensors and metadata (with three keys, twelve equal orders by chance
    have probability 6**-11)."""
    import torch

    from taskgeom.runs.storage import save_tensors

    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    for i in range(12):
        save_tensors(tmp_path / f"{i}.safetensors", tensors, {"step": "60", "config_digest": "abc"})
    assert len({(tmp_path / f"{i}.safetensors").read_bytes() for i in range(12)}) == 1

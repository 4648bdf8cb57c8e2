"""The stored M1 result (``analysis/m1.json`` and ``analysis/m1.safetensors``): read back, it gives the
same claims, tensors and steering as the analysis that wrote it, so a reproduction stopped midway
measures only the runs it had not reached; another request, another version or a damaged file is
never read as it."""

import importlib
import json

import pytest
import torch

from taskgeom.analysis.stored import m1 as stored
from taskgeom.analysis.stored.keys import FORMATS
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.m1 import claims
from taskgeom.errors import CheckpointError
from taskgeom.experiments.m1 import stored_or_analyzed
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe
from taskgeom.training.train import train

TINY = [
    "task.seq_len=24",
    "model.max_len=24",
    "model.d_model=16",
    "model.d_mlp=32",
    "train.steps=20",
    "train.eval_every=20",
    "train.checkpoint_every=20",
    "train.eval_batch=32",
    "train.threads=1",
]
OPTIONS = {"n_sequences": 48, "n_random": 2, "per_cell": 4}


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    run = Run.create(load_recipe("e1", "quick", TINY), tmp_path_factory.mktemp("runs"))
    train(run)
    study = StudyRun(run)
    result = stored.analyze(study, **OPTIONS)
    stored.write(study, result)
    return study, result


def test_the_stored_result_is_the_analysed_one(analysed):
    study, result = analysed
    back = stored.load(study, **OPTIONS)
    assert back is not None
    assert [c.as_dict() for c in claims(back)] == [
        c.as_dict() for c in claims(result)
    ]  # every value and part, bit for bit
    for name in ("task", "alpha", "beta"):
        assert (
            torch.equal(getattr(back, name), getattr(result, name))
            and getattr(back, name).dtype == getattr(result, name).dtype
        )
    for name in ("beta", "alpha", "tv"):
        assert torch.equal(getattr(back.mean, name), getattr(result.mean, name))
    for name in ("a", "sequence", "unsteered", "steered", "mode", "random"):
        assert torch.equal(getattr(back.steering, name), getattr(result.steering, name))
    same = (
        "experiment",
        "place",
        "p3_place",
        "selected",
        "runner_up",
        "summary",
        "window",
        "p2_window",
        "effect",
        "request",
    )
    assert {name: getattr(back, name) for name in same} == {name: getattr(result, name) for name in same}
    assert back.steering.positions == result.steering.positions and back.steering.place == result.steering.place
    assert (back.steering.form, back.steering.label, back.steering.n_sequences) == (
        result.steering.form,
        result.steering.label,
        result.steering.n_sequences,
    )


def test_another_request_or_version_is_measured_again(analysed, monkeypatch):
    study, _ = analysed
    assert stored.load(study, **{**OPTIONS, "n_sequences": 64}) is None
    assert stored.load(study, **{**OPTIONS, "per_cell": 8}) is None
    assert stored.load(study, **OPTIONS, layers=(1,)) is None  # fewer places than were measured
    rows_path = study.path / "analysis" / "m1.json"
    original = rows_path.read_bytes()
    rows = json.loads(original)
    rows[0]["value"] += 1.0  # m1.json written since, by another analysis: the stored rest is not read beside it
    rows_path.write_text(json.dumps(rows))
    try:
        assert stored.load(study, **OPTIONS) is None
    finally:
        rows_path.write_bytes(original)
    assert stored.load(study, **OPTIONS) is not None
    monkeypatch.setitem(FORMATS, "m1", FORMATS["m1"] + 1)
    assert stored.load(study, **OPTIONS) is None


def test_a_changed_protocol_choice_is_measured_again_with_no_number_bumped(analysed):
    """Steering's write site moved in the protocol, every format number left alone: the stored M1
    result is not read back (its key holds the protocol's digest), so the next reproduction measures it."""
    from dataclasses import replace

    from taskgeom.analysis import protocol

    study, _ = analysed
    assert stored.load(study, **OPTIONS) is not None
    moved = replace(protocol.STUDY, steering_write_site="resid_post")
    assert moved.digest() != protocol.STUDY.digest()
    with protocol.measured_under(moved):
        assert stored.load(study, **OPTIONS) is None
    assert stored.load(study, **OPTIONS) is not None


def test_the_experiment_reads_a_stored_result_instead_of_measuring(analysed, monkeypatch):
    study, result = analysed
    experiment = importlib.import_module(
        "taskgeom.experiments.m1"
    )  # the module (the package's name m1 is its function)
    monkeypatch.setattr(experiment, "load", lambda run: stored.load(run, **OPTIONS))
    monkeypatch.setattr(experiment, "analyze", lambda run: pytest.fail("measured a run whose result is stored"))
    assert [c.as_dict() for c in claims(stored_or_analyzed(study))] == [c.as_dict() for c in claims(result)]


def test_a_damaged_or_foreign_file_is_a_clear_error_and_is_kept(analysed, tmp_path):
    study, _ = analysed
    path = study.path / "analysis" / stored.RESULT_FILE
    original = path.read_bytes()
    try:
        path.write_bytes(original[: len(original) // 2])
        with pytest.raises(CheckpointError, match="truncated or corrupt.*delete it"):
            stored.load(study, **OPTIONS)
        assert path.stat().st_size == len(original) // 2  # nothing overwritten
        from taskgeom.runs.storage import save_tensors

        save_tensors(path, {"x": torch.zeros(1)}, {"analysis": "dual"})
        with pytest.raises(CheckpointError, match="not a stored M1 result"):
            stored.load(study, **OPTIONS)
    finally:
        path.write_bytes(original)
    assert json.loads((study.path / "analysis" / "m1.json").read_text())[0]["version"] == FORMATS["m1"]

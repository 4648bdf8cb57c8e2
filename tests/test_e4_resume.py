"""E4's measurement of each seed is kept in the results folder (``analysis/e4/seed-*.json``) and read
back by a reproduction started again on the same runs: its claims are those the rows give, nothing is
measured again; rows stored under another key (version, runs) are measured again."""

import json
import shutil

import pytest
from conftest import SMOKE, TINY_SEEDS

from taskgeom.experiments import reproduce
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.request import Request, resolve


def _e4(out):
    resolved = resolve(Request(SMOKE, TINY_SEEDS, out, only=("e4",)))
    return reproduce(
        out,
        SMOKE,
        resolved.experiments,
        Executor("local", 1),
        device="cpu",
        seeds=TINY_SEEDS,
        studies=resolved.studies,
    )


def _claims(out):
    return [c for c in json.loads((out / "claims.json").read_text()) if c["id"].startswith("e4.")]


def test_a_second_reproduction_reads_each_seed_back_and_gives_the_same_claims(tiny_reproduction, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_reproduction, copy)
    assert sorted(p.name for p in (copy / "analysis" / "e4").iterdir()) == [f"seed-{s}.json" for s in TINY_SEEDS]
    monkeypatch.setattr(
        "taskgeom.studies.e4.experiment.measure_rows", lambda *a: pytest.fail("measured a seed whose rows are stored")
    )
    _e4(copy)
    assert _claims(copy) == _claims(tiny_reproduction)
    assert (copy / "analysis" / "e4.json").read_bytes() == (tiny_reproduction / "analysis" / "e4.json").read_bytes()


def test_rows_stored_under_another_key_are_measured_again(tiny_reproduction, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_reproduction, copy)
    stale = copy / "analysis" / "e4" / f"seed-{TINY_SEEDS[0]}.json"
    stored = json.loads(stale.read_text())
    stale.write_text(json.dumps({**stored, "version": stored["version"] - 1}))
    measured = []
    from taskgeom.studies.e4 import experiment as dyck

    real = dyck.measure_rows
    monkeypatch.setattr(
        dyck,
        "measure_rows",
        lambda ctx, name, majors, diverse, refs, seed: (
            measured.append(seed) or real(ctx, name, majors, diverse, refs, seed)
        ),
    )
    _e4(copy)
    assert measured == [TINY_SEEDS[0]]
    assert json.loads(stale.read_text())["version"] == stored["version"]  # written again under the current key
    assert _claims(copy) == _claims(tiny_reproduction)  # the same runs measured again: the same bits

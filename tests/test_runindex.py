"""The run index: the trainer records runs; listing survives damaged run directories."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import tiny_config
from taskgeom.cli import app
from taskgeom.runindex import query, refresh
from taskgeom.runs import Run
from taskgeom.train import train

runner = CliRunner()


def test_trainer_records_and_listing_skips_damaged_runs(tmp_path):
    good = [Run.create(tiny_config(family, steps=10), tmp_path) for family in ("dice", "markov")]
    for run in good:
        train(run)
    table = query(tmp_path)
    assert sorted(table["family"]) == ["dice", "markov"] and set(table["status"]) == {"finished"}
    assert table["loss_major"].notna().all() and (table["step"] == 10).all()

    half = Run.create(tiny_config("dice", steps=11), tmp_path)
    (half.path / "run.json").write_text('{"format": 1, "taskg')  # cut short by a crash
    assert [p.split(":")[0] for p in refresh(tmp_path)] == [str(half.path)]
    result = runner.invoke(app, ["runs", str(tmp_path), "--where", "family=markov", "--csv"])
    assert result.exit_code == 0, result.output
    assert "skipped" in result.output and str(half.path) in result.output
    lines = [line for line in result.output.splitlines() if line.startswith(str(tmp_path))]
    assert len(lines) == 1 and ",markov," in lines[0]
    assert len(query(tmp_path, ["k=-1", "seed=0"])) == 2


def test_unknown_filter_field_is_named(tmp_path):
    run = Run.create(tiny_config("dice", steps=5), tmp_path)
    train(run)
    result = runner.invoke(app, ["runs", str(tmp_path), "--where", "colour=red"])
    assert result.exit_code == 2 and "unknown field 'colour'" in result.output


def test_index_follows_the_folder_it_lives_in(tmp_path):
    """Runs deleted or moved away leave the index; a copied folder lists its own runs only; an
    index of another version's columns is rebuilt; device and precision are listed."""
    import shutil
    import sqlite3

    root = tmp_path / "a"
    runs = [Run.create(tiny_config("dice", steps=5, seed=seed, **extra), root) for seed, extra in ((0, {}), (1, {"precision": "bf16"}))]
    for run in runs:
        train(run, device="cpu")
    table = query(root).set_index("seed")
    assert table.loc[1, "precision"] == "bf16" and table.loc[0, "precision"] == "fp32" and set(table["device"]) == {"cpu"}

    shutil.copytree(root, tmp_path / "b")  # the index travels with the folder
    assert refresh(tmp_path / "b") == []
    assert all(path.startswith(str((tmp_path / "b").resolve())) for path in query(tmp_path / "b")["path"])
    shutil.rmtree(runs[0].path)
    refresh(root)
    assert list(query(root)["seed"]) == [1]

    with sqlite3.connect(root / "index.sqlite") as db:  # an older version's index
        db.execute("DROP TABLE runs")
        db.execute("CREATE TABLE runs (path PRIMARY KEY, name, family)")
    assert refresh(root) == [] and list(query(root)["seed"]) == [1]


def test_a_damaged_index_never_stops_training_and_is_rebuilt(tmp_path):
    run = Run.create(tiny_config("dice", steps=5), tmp_path)
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.warns(UserWarning, match="not updated"):
        train(run, device="cpu")
    assert run.finished
    assert refresh(tmp_path) == []
    assert list(query(tmp_path)["status"]) == ["finished"]

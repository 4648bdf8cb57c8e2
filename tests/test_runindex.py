"""The run index: the trainer records runs; listing survives damaged run directories."""

from __future__ import annotations

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

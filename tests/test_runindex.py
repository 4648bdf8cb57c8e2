"""The run index: the trainer records runs; listing survives damaged run directories."""

from __future__ import annotations

import json
import sqlite3

import pytest
from conftest import tiny_config
from typer.testing import CliRunner

from taskgeom.cli import app
from taskgeom.errors import TaskgeomError
from taskgeom.runs.folders import Run
from taskgeom.runs.index import query, refresh
from taskgeom.training.train import train

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
    runs = [
        Run.create(tiny_config("dice", steps=5, seed=seed, **extra), root)
        for seed, extra in ((0, {}), (1, {"precision": "bf16"}))
    ]
    for run in runs:
        train(run, device="cpu")
    table = query(root).set_index("seed")
    assert (
        table.loc[1, "precision"] == "bf16" and table.loc[0, "precision"] == "fp32" and set(table["device"]) == {"cpu"}
    )

    shutil.copytree(root, tmp_path / "b")  # the index travels with the folder
    assert refresh(tmp_path / "b") == []
    assert all(path.startswith(str((tmp_path / "b").resolve())) for path in query(tmp_path / "b")["path"])
    shutil.rmtree(runs[0].path)
    refresh(root)
    assert _indexed_seeds(root) == [1]  # the index itself, not the listing (which reads the directories)

    with sqlite3.connect(root / "index.sqlite") as db:  # an older version's index
        db.execute("DROP TABLE runs")
        db.execute("CREATE TABLE runs (path PRIMARY KEY, name, family)")
    assert refresh(root) == [] and _indexed_seeds(root) == [1]


def _indexed_seeds(root) -> list:
    """The seeds index.sqlite holds, read from the database itself."""
    import sqlite3

    with sqlite3.connect(root / "index.sqlite") as db:
        return [seed for (seed,) in db.execute("SELECT seed FROM runs ORDER BY seed")]


def test_a_damaged_index_never_stops_training_and_is_rebuilt(tmp_path):
    run = Run.create(tiny_config("dice", steps=5), tmp_path)
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.warns(UserWarning, match="not updated"):
        train(run, device="cpu")
    assert run.finished
    assert refresh(tmp_path) == []
    assert list(query(tmp_path)["status"]) == ["finished"]
    with sqlite3.connect(tmp_path / "index.sqlite") as db:  # rebuilt: a database again, holding the run
        assert db.execute("SELECT status FROM runs").fetchall() == [("finished",)]


# ---- `taskgeom runs` never fails on one bad run (issue 12, item 5) ----------------------------
@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """A folder of three finished dice runs (seeds 0-2), each with two metrics records (steps 10, 20)."""
    root = tmp_path_factory.mktemp("three") / "runs"
    for seed in range(3):
        train(Run.create(tiny_config("dice", steps=20, seed=seed), root), device="cpu")
    return root


@pytest.fixture
def folder(three_runs, tmp_path):
    """A fresh copy of ``three_runs``, and its runs by seed."""
    import shutil

    root = shutil.copytree(three_runs, tmp_path / "runs")
    return root, {Run.open(p).config.train.seed: Run.open(p) for p in sorted(root.iterdir()) if p.is_dir()}


def _list(root, *extra):
    """`taskgeom runs ROOT --csv`: (exit code, stdout rows by seed, stderr)."""
    result = runner.invoke(app, ["runs", str(root), "--csv", *extra])
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    import io

    import pandas as pd

    table = pd.read_csv(io.StringIO(result.stdout)) if result.stdout.strip() else pd.DataFrame()
    return result.exit_code, table.set_index("seed") if len(table) else table, result.stderr


def _tree(root) -> dict:
    """{relative path: (size, mtime_ns)} of everything under ``root``: to show nothing was written."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    "content",
    [b"[]", b"[1, 2]", b'{"format": 1, "taskgeom": "\xff\xfe"}', b"", b'"text"'],
    ids=["empty-list", "list", "not-utf8", "empty", "string"],
)
def test_a_run_with_an_odd_run_json_is_named_and_the_others_listed(folder, content):
    root, runs = folder
    (runs[1].path / "run.json").write_bytes(content)
    code, table, err = _list(root)
    assert code == 0, err
    assert sorted(table.index) == [0, 2] and set(table["status"]) == {"finished"}
    problem = next(line for line in err.splitlines() if str(runs[1].path) in line)
    assert "run.json" in problem


def test_a_cut_last_metrics_line_does_not_hide_a_finished_run(folder):
    """The trainer crashed while appending: the last line is cut short. The run is finished
    (model.safetensors exists), listed from its first record, and the file and line are named."""
    root, runs = folder
    path = runs[1].metrics_path
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20]
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    code, table, err = _list(root)
    assert code == 0, err
    assert sorted(table.index) == [0, 1, 2] and set(table["status"]) == {"finished"}
    assert table.loc[1, "step"] == 10 and table.loc[0, "step"] == 20
    assert table.loc[1, "loss_major"] == pytest.approx(json.loads(lines[0])["eval"]["major"]["loss"])
    assert f"{path} line 2 (cut short" in err


@pytest.mark.parametrize("line", [b"\xff\xfe{}", b"[1]", b"not json", b'{"step": 25, "eval": [1]}'])
@pytest.mark.parametrize("where", ["middle", "last"])
def test_an_unreadable_metrics_line_is_named_and_read_around(folder, line, where):
    root, runs = folder
    path = runs[2].metrics_path
    lines = path.read_bytes().splitlines()
    order = [lines[0], line, lines[1]] if where == "middle" else [lines[0], lines[1], line]
    path.write_bytes(b"\n".join(order) + b"\n")
    code, table, err = _list(root)
    assert code == 0, err
    assert sorted(table.index) == [0, 1, 2] and set(table["status"]) == {"finished"}
    assert table.loc[2, "step"] == (25 if line.startswith(b'{"step": 25') and where == "last" else 20)
    assert table.loc[2, "loss_major"] == pytest.approx(json.loads(lines[1])["eval"]["major"]["loss"])
    if not line.startswith(b'{"step": 25'):  # a record whose eval is not an object is read, its eval passed over
        assert f"{path} line {2 if where == 'middle' else 3} (" in err


def test_an_index_that_is_a_directory_is_read_around_and_left_alone(folder):
    root, runs = folder
    (root / "index.sqlite").unlink()
    (root / "index.sqlite").mkdir()
    (root / "index.sqlite" / "keep").write_text("x")
    code, table, err = _list(root, "--where", "seed=2")
    assert code == 0, err
    assert list(table.index) == [2]
    assert "index.sqlite (it is a directory)" in err and "skipped" in err
    assert (root / "index.sqlite" / "keep").read_text() == "x"
    assert refresh(root) == [
        f"writing the index {root / 'index.sqlite'} (it is a directory); the runs are listed from their directories"
    ]


def test_an_index_with_a_corrupt_page_is_rebuilt(folder):
    import sqlite3

    root, runs = folder
    index = root / "index.sqlite"
    data = bytearray(index.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) > page  # more than the header page
    data[page:] = b"\xab" * (len(data) - page)
    index.write_bytes(bytes(data))
    with pytest.raises(sqlite3.DatabaseError):
        with sqlite3.connect(index) as db:
            db.execute("SELECT * FROM runs").fetchall()
    code, table, err = _list(root)
    assert code == 0, err
    assert sorted(table.index) == [0, 1, 2] and err == ""
    with sqlite3.connect(index) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert sorted(row[0] for row in db.execute("SELECT seed FROM runs")) == [0, 1, 2]


@pytest.fixture
def read_only(monkeypatch):
    """Make a folder read-only: chmod a-w, and where that does not bind (root), also open the index
    read-only, as SQLite does in a read-only folder or file system."""
    import os
    import sqlite3
    import stat

    made = []

    def apply(root):
        paths = [root, *root.rglob("*")]
        made.extend((p, p.stat().st_mode) for p in paths)
        for p in paths:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        if os.access(root, os.W_OK):  # root ignores modes
            connect = sqlite3.connect
            monkeypatch.setattr(
                "taskgeom.runs.index.sqlite3.connect",
                lambda path, **kw: (
                    connect(path, **kw) if str(path) == ":memory:" else connect(f"file:{path}?mode=ro", uri=True, **kw)
                ),
            )

    yield apply
    for p, mode in reversed(made):
        p.chmod(mode)


@pytest.mark.parametrize("index", ["current", "stale", "none"])
def test_a_read_only_folder_is_listed_without_writing(folder, read_only, index):
    """An index from another place (the folder was copied) or none at all: the listing comes from
    the directories, nothing is written, and the index not written is named."""
    root, runs = folder
    if index == "stale":
        (runs[0].metrics_path).write_text("")  # listed at step 0 now; the index still says 20
        import shutil

        shutil.rmtree(runs[2].path)
    if index == "none":
        (root / "index.sqlite").unlink()
    before = _tree(root)
    read_only(root)
    code, table, err = _list(root)
    assert code == 0, err
    assert sorted(table.index) == ([0, 1] if index == "stale" else [0, 1, 2])
    assert table.loc[0, "step"] == (0 if index == "stale" else 20)
    assert _tree(root) == before
    assert f"skipped writing the index {root / 'index.sqlite'}" in err


def test_a_diverged_run_is_listed_as_diverged(folder):
    root, runs = folder
    runs[1].model_path.unlink()
    meta = json.loads((runs[1].path / "run.json").read_text())
    (runs[1].path / "run.json").write_text(
        json.dumps(meta | {"status": "diverged", "diverged": {"step": 10, "metric": "train_loss", "value": "nan"}})
    )
    runs[0].model_path.unlink()
    code, table, err = _list(root)
    assert code == 0 and err == "", err
    assert table["status"].to_dict() == {0: "unfinished", 1: "diverged", 2: "finished"}


def test_a_bad_filter_is_refused_before_anything_is_read_or_written(folder, monkeypatch):
    from taskgeom.runs import index as runindex

    root, runs = folder
    before = _tree(root)
    monkeypatch.setattr(runindex, "scan", lambda root: pytest.fail("scanned before the filter was checked"))
    for where in (["colour=red"], ["seed"]):
        with pytest.raises(TaskgeomError, match="colour|field=value"):
            runindex.list_runs(root, where)
    assert _tree(root) == before

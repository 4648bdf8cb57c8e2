"""An SQLite index of the runs under one folder: their key settings and headline metrics.

The trainer records a run when it starts and when it finishes; ``refresh`` re-reads every run
directory under the folder (so runs copied in, or made by an older session, appear too, and runs
deleted or moved away disappear). A run directory that cannot be read is reported by name and
reason, never fatal. The index is a cache of the directories: one written with other columns (by
another version) is rebuilt.
"""

from __future__ import annotations

import json
import sqlite3
import time
import warnings
from pathlib import Path

import pandas as pd

from taskgeom.errors import TaskgeomError
from taskgeom.runs import Run

INDEX_NAME = "index.sqlite"
COLUMNS = ("path", "name", "family", "diversity", "seed", "steps", "arch", "precision", "digest", "status", "step", "device",
           "loss_major", "excess_major", "updated")
ALIASES = {"k": "diversity"}


def _connect(root: Path, rebuild_damaged: bool = False) -> sqlite3.Connection:
    """The index of ``root``; with ``rebuild_damaged``, an unreadable index file is replaced by an
    empty one (for ``refresh`` to fill), else sqlite3.Error."""
    root.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(root / INDEX_NAME, timeout=30)
    try:
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(runs)"))
    except sqlite3.DatabaseError:
        db.close()
        if not rebuild_damaged:
            raise
        (root / INDEX_NAME).unlink()
        return _connect(root)
    if columns not in ((), COLUMNS):
        db.execute("DROP TABLE runs")  # another version's columns: refresh() refills it
    db.execute(f"CREATE TABLE IF NOT EXISTS runs ({', '.join(c + (' PRIMARY KEY' if c == 'path' else '') for c in COLUMNS)})")
    return db


def summarise(run: Run) -> dict:
    """The index row of a run: settings from its config, the last evaluation from metrics.jsonl."""
    cfg, metrics = run.config, run.metrics()
    last = metrics[-1] if metrics else {}
    major = last.get("eval", {}).get("major", {})
    return {"path": str(run.path.resolve()), "name": cfg.name, "family": cfg.task.family, "diversity": cfg.task.diversity,
            "seed": cfg.train.seed, "steps": cfg.train.steps, "arch": cfg.model.arch, "precision": cfg.train.precision,
            "digest": cfg.digest(), "status": "finished" if run.finished else "unfinished", "step": last.get("step", 0),
            "device": last.get("device"),
            "loss_major": major.get("loss"), "excess_major": major.get("excess"), "updated": time.time()}


def record(run: Run) -> None:
    """Insert or update ``run`` in the index of its parent folder. The index is a cache: if it
    cannot be written (damaged, or locked too long on a network filesystem), training goes on
    with a warning and ``refresh`` restores it later."""
    row = summarise(run)
    try:
        with _connect(run.path.parent) as db:
            db.execute(f"INSERT OR REPLACE INTO runs VALUES ({', '.join('?' * len(COLUMNS))})", [row[c] for c in COLUMNS])
    except sqlite3.Error as err:
        warnings.warn(f"run index {run.path.parent / INDEX_NAME} not updated ({err}); `taskgeom runs` rebuilds it", stacklevel=2)


def refresh(root: Path) -> list[str]:
    """Re-read every run directory under ``root`` into the index, dropping entries of directories
    no longer there; returns 'path: reason' for each directory that could not be read (and drops
    it from the index)."""
    root = Path(root)
    if not root.is_dir():
        raise TaskgeomError(f"{root} is not a folder of runs")
    bad = []
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    with _connect(root, rebuild_damaged=True) as db:
        present = {str(p.resolve()) for p in folders}
        for (path,) in db.execute("SELECT path FROM runs").fetchall():
            if path not in present:
                db.execute("DELETE FROM runs WHERE path = ?", [path])
        for path in folders:
            try:
                row = summarise(Run.open(path))
            except (TaskgeomError, OSError, ValueError, KeyError, json.JSONDecodeError) as err:
                bad.append(f"{path}: {err}")
                db.execute("DELETE FROM runs WHERE path = ?", [str(path.resolve())])
                continue
            db.execute(f"INSERT OR REPLACE INTO runs VALUES ({', '.join('?' * len(COLUMNS))})", [row[c] for c in COLUMNS])
    return bad


def query(root: Path, where: list[str] = ()) -> pd.DataFrame:
    """The indexed runs under ``root`` matching every ``field=value`` in ``where`` (fields: the
    columns, or ``k`` for diversity)."""
    clauses, values = [], []
    for item in where:
        if "=" not in item:
            raise TaskgeomError(f"--where {item!r} must look like field=value")
        field, value = item.split("=", 1)
        field = ALIASES.get(field, field)
        if field not in COLUMNS:
            raise TaskgeomError(f"unknown field {field!r} in --where; choose from {sorted(COLUMNS + tuple(ALIASES))}")
        clauses.append(f"CAST({field} AS TEXT) = ?")
        values.append(value)
    sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY name, family, diversity, seed"
    with _connect(Path(root)) as db:
        return pd.read_sql_query(sql, db, params=values)

"""An SQLite index of the runs under one folder: their key settings and headline metrics.

The trainer records a run when it starts, when it finishes and when it diverges; a listing
(``list_runs``, ``refresh``, ``query``) re-reads every run directory under the folder, so runs
copied in, or made by an older session, appear too, and runs deleted or moved away disappear. The
index is a cache of the directories, never the source of a listing:

- a run directory that cannot be read (run.json or config.yaml missing, not JSON, not UTF-8, not
  an object, made by another version) is named with its reason and left out; the rest are listed;
- a line of metrics.jsonl that cannot be read (cut short by a crash, not UTF-8, not a JSON
  object) is named, and the run is listed from the lines that can; a run is finished when its
  model.safetensors exists, whatever metrics.jsonl holds;
- an index that is damaged (not a database, a corrupt page, another version's columns) is
  rebuilt; one that cannot be written (a read-only folder or file system, a directory in its
  place) is left as it is, said so, and the runs are listed from their directories all the same.
"""

from __future__ import annotations

import json
import sqlite3
import time
import warnings
from pathlib import Path

import pandas as pd

from taskgeom.errors import EnvironmentRefused, TaskgeomError
from taskgeom.runs.folders import Run

INDEX_NAME = "index.sqlite"
COLUMNS = (
    "path",
    "name",
    "family",
    "diversity",
    "seed",
    "steps",
    "arch",
    "precision",
    "digest",
    "status",
    "step",
    "device",
    "loss_major",
    "excess_major",
    "updated",
)
ALIASES = {"k": "diversity"}
_TABLE = f"CREATE TABLE IF NOT EXISTS runs ({', '.join(c + (' PRIMARY KEY' if c == 'path' else '') for c in COLUMNS)})"
_INSERT = f"INSERT OR REPLACE INTO runs VALUES ({', '.join('?' * len(COLUMNS))})"


def _connect(root: Path, rebuild_damaged: bool = False) -> sqlite3.Connection:
    """The index of ``root``, checked page by page; with ``rebuild_damaged``, a damaged index file
    (not a database, a corrupt page) is replaced by an empty one, else sqlite3.DatabaseError. An
    index of another version's columns is emptied (the next listing refills it)."""
    db = sqlite3.connect(root / INDEX_NAME, timeout=30)
    try:
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("database disk image is malformed (quick_check)")
        columns = tuple(row[1] for row in db.execute("PRAGMA table_info(runs)"))
    except sqlite3.DatabaseError as err:
        db.close()
        # damaged is SQLITE_NOTADB or SQLITE_CORRUPT; an OperationalError (locked, unreadable) is not
        if not rebuild_damaged or isinstance(err, sqlite3.OperationalError) or not (root / INDEX_NAME).is_file():
            raise
        (root / INDEX_NAME).unlink()
        return _connect(root)
    if columns not in ((), COLUMNS):
        db.execute("DROP TABLE runs")
    db.execute(_TABLE)
    return db


# ---- reading one run directory ---------------------------------------------------------------
def read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """The records of the metrics.jsonl file ``path`` that can be read, and one 'PATH line N
    (reason)' for each line that cannot (cut short, not UTF-8, not a JSON object)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    records, problems = [], []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problems.append(f"{path} line {number} (not UTF-8)")
            continue
        except json.JSONDecodeError as err:
            cut = number == data.count(b"\n") + 1  # the last line, with no newline: a write cut short
            problems.append(f"{path} line {number} ({'cut short' if cut else 'not JSON'}: {err.msg})")
            continue
        if not isinstance(record, dict):
            problems.append(f"{path} line {number} (not a JSON object)")
            continue
        records.append(record)
    return records, problems


def _summary(run: Run) -> tuple[dict, list[str]]:
    """The index row of ``run`` and the metrics lines it had to leave out."""
    metrics, problems = read_metrics(run.metrics_path)
    evaluated = [record for record in metrics if isinstance(record.get("eval"), dict)]
    last = metrics[-1] if metrics else {}
    major = evaluated[-1]["eval"].get("major", {}) if evaluated else {}
    major = major if isinstance(major, dict) else {}
    cfg = run.config
    row = {
        "path": str(run.path.resolve()),
        "name": cfg.name,
        "family": cfg.task.family,
        "diversity": cfg.task.diversity,
        "seed": cfg.train.seed,
        "steps": cfg.train.steps,
        "arch": cfg.model.arch,
        "precision": cfg.train.precision,
        "digest": cfg.digest(),
        "status": run.status,
        "step": _scalar(last.get("step", 0)),
        "device": _scalar(last.get("device")),
        "loss_major": _scalar(major.get("loss")),
        "excess_major": _scalar(major.get("excess")),
        "updated": time.time(),
    }
    return row, problems


def _scalar(value):
    """A value SQLite can store: numbers and text as they are, anything else as its JSON text."""
    return value if value is None or isinstance(value, (int, float, str)) else json.dumps(value)


def summarise(run: Run) -> dict:
    """The index row of a run: settings from its config, the last evaluation from metrics.jsonl
    (its readable lines)."""
    return _summary(run)[0]


def scan(root: Path) -> tuple[list[dict], list[str]]:
    """The index rows of every readable run directory under ``root``, and one line for each thing
    left out: 'RUN_DIR: reason' for a directory, 'METRICS line N (reason); ...' for a metrics line
    read around. Writes nothing; TaskgeomError if ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        raise TaskgeomError(f"{root} is not a folder of runs")
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name != INDEX_NAME)
    except OSError as err:
        raise EnvironmentRefused(f"cannot read the folder {root} ({err.strerror})") from None
    rows, problems = [], []
    for path in folders:
        try:
            row, lines = _summary(Run.open(path))
        except Exception as err:  # noqa: BLE001: one bad run is named, never the end of the listing
            problems.append(f"{path}: {_reason(err)}")
            continue
        rows.append(row)
        problems += [f"{line}; the run is listed from the lines that can be read" for line in lines]
    return rows, problems


def _reason(err: Exception) -> str:
    if isinstance(err, TaskgeomError):
        return str(err)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}" + (f" ({err.filename})" if err.filename else "")
    return f"unreadable ({type(err).__name__}: {err})"


# ---- the index file --------------------------------------------------------------------------
def _store(root: Path, rows: list[dict]) -> str | None:
    """Make the index of ``root`` hold exactly ``rows``, rebuilding a damaged one; None when
    written, else why not (the index is then left as it was)."""
    try:
        db = _connect(root, rebuild_damaged=True)
        try:
            with db:
                db.execute("DELETE FROM runs")
                db.executemany(_INSERT, [[row[c] for c in COLUMNS] for row in rows])
        finally:
            db.close()
    except (sqlite3.Error, OSError) as err:
        why = "it is a directory" if (root / INDEX_NAME).is_dir() else str(err)
        return f"writing the index {root / INDEX_NAME} ({why}); the runs are listed from their directories"
    return None


def record(run: Run) -> None:
    """Insert or update ``run`` in the index of its parent folder. The index is a cache: if it
    cannot be written (damaged, or locked too long on a network filesystem), training goes on
    with a warning and the next listing restores it."""
    try:
        row = summarise(run)
        db = _connect(run.path.parent)
        try:
            with db:
                db.execute(_INSERT, [row[c] for c in COLUMNS])
        finally:
            db.close()
    except (sqlite3.Error, OSError) as err:
        warnings.warn(
            f"run index {run.path.parent / INDEX_NAME} not updated ({err}); `taskgeom runs` rebuilds it", stacklevel=2
        )


# ---- listing ---------------------------------------------------------------------------------
def _filters(where: list[str]) -> tuple[str, list[str]]:
    """The SQL WHERE clause and its values for ``field=value`` items; TaskgeomError for a bad one."""
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
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), values


def list_runs(root: Path, where: list[str] = ()) -> tuple[pd.DataFrame, list[str]]:
    """The runs under ``root`` matching every ``field=value`` in ``where`` (fields: the columns, or
    ``k`` for diversity), read from their directories, and one line for each thing left out (a
    run directory, a metrics line, the index write: ``scan``'s lines and ``_store``'s). The index is rewritten to match when it
    can be; the table never depends on it."""
    clause, values = _filters(list(where))
    rows, problems = scan(root)
    note = _store(Path(root), rows)
    memory = sqlite3.connect(":memory:")
    try:
        memory.execute(_TABLE)
        memory.executemany(_INSERT, [[row[c] for c in COLUMNS] for row in rows])
        sql = "SELECT * FROM runs" + clause + " ORDER BY name, family, diversity, seed"
        table = pd.read_sql_query(sql, memory, params=values)
    finally:
        memory.close()
    return table, problems + ([note] if note else [])


def refresh(root: Path) -> list[str]:
    """Re-read every run directory under ``root`` into the index (rebuilt if damaged, left alone
    if it cannot be written); returns one line for each run directory, metrics line or index
    write that had to be left out (as ``list_runs``)."""
    rows, problems = scan(root)
    note = _store(Path(root), rows)
    return problems + ([note] if note else [])


def query(root: Path, where: list[str] = ()) -> pd.DataFrame:
    """The runs under ``root`` matching every ``field=value`` in ``where`` (fields: the columns, or
    ``k`` for diversity), as ``list_runs`` reads them (the problems are ``refresh``'s)."""
    return list_runs(root, where)[0]

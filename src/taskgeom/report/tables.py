"""The long table: every analysis row of every run of a results folder in one tidy frame
(``tables/analysis.parquet`` and ``.csv``), so that one ``pandas.read_parquet`` loads a whole
reproduction, every seed of it.

Rows come from the ``analysis/*.json`` of each run the reproduction used (a list of rows per file;
``reproduction.json`` names the runs, so runs of an earlier or a smoke reproduction in the same
``runs/`` stay out) and from the folder's own ``analysis/*.json`` (a mapping of named lists of
rows, as ``e4.json``). Columns: ``run`` (its
directory name; empty for folder-level rows), ``recipe``, ``diversity`` and ``seed`` (from the
run's config; a folder-level row keeps its own ``seed``), ``analysis`` (``m1``, ``dual``, ``eval``, ``e4.probes``, ...), then the rows' own
fields; a ``band`` [low, high] becomes ``band_low`` and ``band_high``.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import yaml

from taskgeom.errors import TaskgeomError
from taskgeom.report.manifest import read_json
from taskgeom.runs.storage import atomic_write_bytes, atomic_write_text

LEADING = ["run", "recipe", "diversity", "seed", "analysis"]
INTEGER_FIELDS = ("layer", "position", "task", "step", "version")


def _rows(path: Path) -> list[tuple[str, list[dict]]]:
    """(analysis name, rows) of one analysis file: a list of rows, or a mapping of named lists."""
    data = read_json(path, "delete it and rerun `taskgeom reproduce` to measure it again")
    if isinstance(data, list):
        return [(path.stem, data)]
    return [(f"{path.stem}.{key}", rows) for key, rows in data.items() if isinstance(rows, list)]


def run_config(run_dir: Path) -> dict:
    """The config of a run directory as written (``config.yaml``), as a dict."""
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise TaskgeomError(f"{run_dir}/config.yaml is unreadable ({err})") from None


def _run_columns(run_dir: Path) -> dict:
    config = run_config(run_dir)
    return {
        "run": run_dir.name,
        "recipe": config["name"],
        "diversity": config["task"]["diversity"],
        "seed": config["train"]["seed"],
    }


def _frame(rows: list[dict], columns: dict, analysis: str) -> pd.DataFrame:
    """The rows of one analysis as a frame with the leading columns; a folder-level row's own
    ``seed`` (E4's rows, one set per seed) is kept."""
    frame = pd.DataFrame(rows)
    return frame.assign(**{k: v for k, v in columns.items() if k not in frame or v is not None}, analysis=analysis)


def analysis_table(out: Path, runs: list[str]) -> pd.DataFrame:
    """Every analysis row of the run directories ``runs`` (names under ``out/runs``) and of the
    folder itself (see the module docstring for the columns)."""
    out = Path(out)
    sources = [
        ({"run": "", "recipe": "", "diversity": None, "seed": None}, path)
        for path in sorted(out.glob("analysis/*.json"))
    ]
    sources += [
        (_run_columns(out / "runs" / name), path)
        for name in sorted(runs)
        for path in sorted((out / "runs" / name).glob("analysis/*.json"))
    ]
    frames = [_frame(rows, columns, name) for columns, path in sources for name, rows in _rows(path) if rows]
    if not frames:
        return pd.DataFrame(columns=LEADING)
    table = pd.concat(frames, ignore_index=True)
    if "band" in table:
        bands = table.pop("band").map(lambda b: b if isinstance(b, (list, tuple)) and len(b) == 2 else (None, None))
        table["band_low"], table["band_high"] = [b[0] for b in bands], [b[1] for b in bands]
    for column in ("diversity", "seed", *INTEGER_FIELDS):  # integers with gaps stay integers
        if column in table:
            table[column] = table[column].astype("Int64")
    for column in table.columns:  # a column mixing strings with numbers is kept as text (Parquet needs one type)
        kinds = set(table[column].dropna().map(type))
        if str in kinds and len(kinds) > 1:
            table[column] = table[column].map(lambda v: None if v is None or v != v else str(v))
    return table[LEADING + [c for c in table.columns if c not in LEADING]]


def write_analysis_table(out: Path, runs: list[str]) -> pd.DataFrame:
    """Write ``tables/analysis.parquet`` and ``tables/analysis.csv`` under ``out`` (``analysis_table``); returns the table."""
    table = analysis_table(out, runs)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    atomic_write_bytes(Path(out) / "tables" / "analysis.parquet", buffer.getvalue())
    atomic_write_text(Path(out) / "tables" / "analysis.csv", table.to_csv(index=False))
    return table

"""The one row layout of the stored analyses, ``analysis/m1.json`` and ``analysis/dual.json``:
tidy records that ``pandas.read_json`` loads in one call, each with every field of ``FIELDS``
(None where it does not apply):

``metric``, ``value`` (None for a share of a gain that is not positive), ``band`` ([low, high] or
None), ``layer`` and ``site`` (the place), ``batch`` (the held-out split: ``select``, ``measure``,
``geometry``, ``loss``, ``search-select``, ``trajectory``; or ``cells``, the forced-token cells),
``set`` (``major``, ``minor``, ``ood``), ``step`` (a training snapshot; None for the final model), ``position`` and ``task`` (None unless per position
or per major task), ``gain``, ``unreliable`` and ``reason`` (a share of in-context gain only:
``shares.Share``), ``version`` and ``protocol`` (the key of ``keys``: the analysis's format number and the
digest of the protocol it was measured under, set by ``stamped``).

A stored file whose rows carry another key is not read (``stored_rows`` gives None): that
analysis is measured again, the run is not retrained, and the other analysis is kept. ``by_step`` sets a sweep's rows of the
training snapshots side by side, one row per (run, step).
"""

from __future__ import annotations

import json
from typing import Sequence

import pandas as pd

from taskgeom.analysis.measures.shares import Share
from taskgeom.analysis.stored.keys import is_current, key
from taskgeom.errors import RunDirError
from taskgeom.runs.folders import Run

FIELDS = (
    "metric",
    "value",
    "band",
    "layer",
    "site",
    "batch",
    "set",
    "step",
    "position",
    "task",
    "gain",
    "unreliable",
    "reason",
    "version",
    "protocol",
)


def row(
    metric: str,
    value: float | None,
    band: Sequence[float] | None = None,
    *,
    place: tuple[int, str] | None = None,
    batch: str | None = None,
    set: str | None = None,
    step: int | None = None,
    position: int | None = None,
    task: int | None = None,
    share: Share | None = None,
) -> dict:
    """One stored row (module docstring); ``share``: the share of gain this row is (or is of)."""
    layer, site = place if place is not None else (None, None)
    extra = share.fields() if share is not None else {"gain": None, "unreliable": None, "reason": None}
    return {
        "metric": metric,
        "value": None if value is None else float(value),
        "band": None if band is None else [float(band[0]), float(band[1])],
        "layer": layer,
        "site": site,
        "batch": batch,
        "set": set,
        "step": step,
        "position": position,
        "task": task,
        **extra,
        "version": None,
        "protocol": None,
    }


def stamped(rows: list[dict], analysis: str) -> list[dict]:
    """``rows`` of ``analysis`` ("m1", "dual") with its key (``keys.key``), as they are stored."""
    return [{**r, **key(analysis)} for r in rows]


def stored_rows(run: Run, analysis: str) -> list[dict] | None:
    """The rows of ``analysis/{analysis}.json`` of ``run``, or None when absent or written under
    another key than ``keys.key(analysis)`` (another format or protocol: then measured again); RunDirError naming the file
    when it is unreadable."""
    path = run.path / "analysis" / f"{analysis}.json"
    if not path.exists():
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunDirError(f"{path} is unreadable ({err}); delete it to measure the run again") from None
    return rows if rows and all(isinstance(r, dict) and is_current(r, analysis) for r in rows) else None


def by_step(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, training step): projection R^2 and the predictor-transition statistics
    (``log_ratio``, ``kl_to_memorising``, ``kl_to_generalising``; token families only)."""
    rows = table[table["step"].notna()]
    wide = rows.pivot_table(
        index=["recipe", "diversity", "seed", "step"], columns="metric", values="value"
    ).reset_index()
    return wide.rename(columns=lambda c: c.removeprefix("transition_"))

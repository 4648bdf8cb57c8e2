"""The one row layout of the stored analyses, ``analysis/m1.json`` and ``analysis/dual.json``:
tidy records that ``pandas.read_json`` loads in one call, each with every field of ``FIELDS``
(None where it does not apply):

``metric``, ``value`` (None for a share of a gain that is not positive), ``band`` ([low, high] or
None), ``layer`` and ``site`` (the place), ``batch`` (the held-out split: ``select``, ``measure``,
``geometry``, ``loss``, ``search-select``, ``trajectory``; or ``cells``, the forced-token cells),
``set`` (``major``, ``minor``, ``ood``), ``step`` (a training snapshot; None for the final model), ``position`` and ``task`` (None unless per position
or per major task), ``gain``, ``unreliable`` and ``reason`` (a share of in-context gain only:
``shares.Share``), ``version`` (the analysis' entry of ``VERSIONS``, set by ``stamped``).

A stored file whose rows are of another version is not read (``stored_rows`` gives None): that
analysis is measured again, the run is not retrained, and the other analysis is kept. ``by_step`` sets a sweep's rows of the
training snapshots side by side, one row per (run, step).
"""

from __future__ import annotations

import json
from typing import Sequence

import pandas as pd

from taskgeom.analysis.measures.shares import Share
from taskgeom.errors import RunDirError
from taskgeom.runs.folders import Run

# 4: m1.json and dual.json share one layout; shares carry their gain (null when not positive).
# 5: m1.json's P0/P1 per position (medians over the late window), P3 on mean beta, the claims' place rows.
#    and the ablations per block at resid_mid with their mean over blocks (layer null), S from the probe.
#    and dual.json's projection_r2 is the study's Fig. 4 statistic (per-task means, fixed place).
# 6: dual.json's S from the study's own probe (its dropped columns; docs/protocol.md, "S ablation"), Fig. 4 at
#    128 x 128 with E1's block one position shorter.
# 7: dual.json's Fig. 4 over the profile's OOD tasks (1,024) with its standard error, the study's 128-task draw beside it
#    (and across training), and the Bayes OOD predictor's losses on the OOD loss set (the OOD-mode precondition).
# 8: m1.json's steering as the study's injection (its vectors, written at resid_mid, 10,000 sequences), the earlier one
#    beside it (steering_at_read_site.*).
# 9: m1.json's P2 as the study's r2_additive at every place (p2.r2_additive, its random baseline, E3 after the next
#    LayerNorm), R^2_task beside it.
# 10: dual.json's ablations as the study's: S from the probe fitted on 5,056 major sequences only by _fit_ols (single
#    precision), V the moving average of the raw parameter, evaluation sets of 512 sequences (OOD from 30 tasks).
# From here on each analysis has its own version:
# m1 11: P0-P2 on the study's forced-token cells (P0/P1 at the last position it reads; the batch "cells"), P3 as its
#    trajectory figure computes it (p3.tv_trajectory; the batch "trajectory").
# dual 11: the random control as the study's band (signed 75th percentile, the change over every prediction, the largest
#    over blocks), E1's losses over every prediction and its probe from position 100 of 128, the predictor transition
#    as KL(model || reference) on 1,024 sequences of the training mixture (the batch "transition").
# m1 12: E2's r2_additive fits the task simplex to h - mu_t before x_t's map (the study's order), its random baseline too.
# dual 12: E3's token span that V avoids from the probe's W_tok (the study's svd_basis(W_tok, 0.9)).
# e4 1: E4's own measurement of one seed (``extras.dyck.measure``: P0 as the study's variance.py, the study's prefix
#    probe, the earlier constructions), kept per seed in the results folder's ``analysis/e4/``.
VERSIONS = {"m1": 12, "dual": 12, "e4": 1}
FIELDS = ("metric", "value", "band", "layer", "site", "batch", "set", "step", "position", "task", "gain", "unreliable", "reason",
          "version")


def row(metric: str, value: float | None, band: Sequence[float] | None = None, *, place: tuple[int, str] | None = None,
        batch: str | None = None, set: str | None = None, step: int | None = None, position: int | None = None,
        task: int | None = None, share: Share | None = None) -> dict:
    """One stored row (module docstring); ``share``: the share of gain this row is (or is of)."""
    layer, site = place if place is not None else (None, None)
    extra = share.fields() if share is not None else {"gain": None, "unreliable": None, "reason": None}
    return {"metric": metric, "value": None if value is None else float(value),
            "band": None if band is None else [float(band[0]), float(band[1])], "layer": layer, "site": site, "batch": batch,
            "set": set, "step": step, "position": position, "task": task, **extra, "version": None}


def stamped(rows: list[dict], analysis: str) -> list[dict]:
    """``rows`` of ``analysis`` ("m1", "dual") with its version (``VERSIONS``), as they are stored."""
    return [{**r, "version": VERSIONS[analysis]} for r in rows]


def stored_rows(run: Run, analysis: str) -> list[dict] | None:
    """The rows of ``analysis/{analysis}.json`` of ``run``, or None when absent or written under
    another version than ``VERSIONS[analysis]`` (then measured again); RunDirError naming the file
    when it is unreadable."""
    path = run.path / "analysis" / f"{analysis}.json"
    if not path.exists():
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunDirError(f"{path} is unreadable ({err}); delete it to measure the run again") from None
    return rows if rows and all(isinstance(r, dict) and r.get("version") == VERSIONS[analysis] for r in rows) else None


def by_step(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, training step): projection R^2 and the predictor-transition statistics
    (``log_ratio``, ``kl_to_memorising``, ``kl_to_generalising``; token families only)."""
    rows = table[table["step"].notna()]
    wide = rows.pivot_table(index=["recipe", "diversity", "seed", "step"], columns="metric", values="value").reset_index()
    return wide.rename(columns=lambda c: c.removeprefix("transition_"))

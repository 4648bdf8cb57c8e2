"""E2's P0 and P1 at its last position (docs/protocol.md, "The audit's open rows, closed"): the
ANCOVA the study's table reads there, on paired sequences of every major task, against a plain
least-squares fit of each state on the task's own intercept and slope in x (r2_full) and on a
shared slope (the additive fit); and the claims reading it in the protocol's form (the judged variant ``e2-p0-late-median`` reads the
late window's median)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taskgeom.analysis.measures.variants import protocol as variant_protocol
from taskgeom.analysis.study import StudyRun
from taskgeom.hooks import Place, capture
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import build_config
from taskgeom.training.train import train

PER_TASK = 40


@pytest.fixture(scope="module")
def regression(tmp_path_factory) -> StudyRun:
    raw = {
        "name": "e2",
        "task": {"family": "regression", "d": 2, "n_examples": 6},
        "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "d_mlp": 32, "max_len": 12},
        "train": {"steps": 20, "batch_size": 16, "eval_every": 20, "checkpoint_every": 20, "eval_batch": 16},
    }
    run = Run.create(build_config(raw), path=tmp_path_factory.mktemp("e2") / "run")
    train(run)
    return StudyRun(Run.open(run.path))


def residual(design: np.ndarray, h: np.ndarray) -> float:
    solution, *_ = np.linalg.lstsq(design, h, rcond=None)
    return float(((h - design @ solution) ** 2).sum())


def shares_by_hand(run: StudyRun, place: Place) -> tuple[float, float]:
    """(P0, P1) at the last prediction position: 1 - SSE_full / SST with the full fit a per-task
    intercept and slope in x, and 1 - (SSE_additive - SSE_full) / (SST - SSE_full) with one slope."""
    cells = run.heldout_tasks("major", PER_TASK, split="cells")
    with torch.no_grad(), capture(run.model, [place]) as store:
        run.model(cells.batch.tokens)
    h = cells.inputs.select(store[tuple(place)])[:, -1].double().numpy()
    x = cells.inputs.current[:, -1].double().numpy()
    task = cells.batch.task.numpy()
    onehot = np.eye(run.pool.n_major)[task]
    full = np.concatenate([onehot, (onehot[:, :, None] * x[:, None, :]).reshape(len(h), -1)], 1)
    total = float(((h - h.mean(0)) ** 2).sum())
    sse_full, sse_additive = residual(full, h), residual(np.concatenate([onehot, x], 1), h)
    return 1 - sse_full / total, 1 - (sse_additive - sse_full) / (total - sse_full)


def test_e2_p0_and_p1_at_the_last_position_by_hand(regression):
    from taskgeom.analysis.stored.m1 import last_position_rows

    places = regression.places()
    rows = last_position_rows(regression, places, PER_TASK)
    value = {(r["metric"], r["layer"], r["site"]): r["value"] for r in rows}
    last = len(regression.heldout_tasks("major", 1, split="cells").inputs.current[0]) - 1
    for place in places:
        p0, p1 = shares_by_hand(regression, place)
        assert value[("p0.cell_r2_forced", *place)] == pytest.approx(p0, rel=1e-9)
        assert value[("p1.additive_share_forced", *place)] == pytest.approx(p1, rel=1e-9)
        assert value[("cells.position", *place)] == last
        assert value[("cells.per_cell", *place)] == PER_TASK


def test_the_claims_read_the_last_position_only_in_its_form(regression):
    from taskgeom.analysis.stored.m1 import analyze
    from taskgeom.claims.m1 import claim_values

    result = analyze(regression, n_sequences=48, per_cell=PER_TASK)
    rows = result.rows
    place = result.place
    cells = {r["metric"]: r["value"] for r in rows if r["batch"] == "cells" and (r["layer"], r["site"]) == place}
    late = claim_values(rows, variant_protocol("e2-p0-late-median"))
    assert late["P0"].parts["cells"] == "natural"  # the earlier form: the late window's median
    last = claim_values(rows)
    assert last["P0"].value == cells["p0.cell_r2_forced"] and last["P1"].value == cells["p1.additive_share_forced"]
    assert last["P0"].parts["cells"] == "paired" and last["P0"].parts["per_cell"] == PER_TASK
    assert last["P0"].parts["natural_late_median"] == late["P0"].value
    assert last["P2"].value == late["P2"].value  # P2 keeps its natural states

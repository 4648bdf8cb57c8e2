"""E4 prefix probes (docs/protocol.md): in-distribution (pool) sequences, labels against a
recount of the planted string, and probes on planted geometry."""

from __future__ import annotations

import math

import pytest
import torch

from taskgeom.analysis.protocol import STUDY
from taskgeom.claims.catalog import spec
from taskgeom.rng import generator
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe
from taskgeom.studies.e4.claims import weakest_probe
from taskgeom.studies.e4.experiment import prefix_probes, probe_batch, probe_rows, probe_targets
from taskgeom.studies.e4.figures import plot_prefix_probes

torch.set_num_threads(1)

TINY = ["task.diversity=3", "model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.d_mlp=32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quick E4 recipe (10 pairs, 96 positions) with a tiny network and 3 + 8 pool tasks."""
    return Run(tmp_path_factory.mktemp("e4"), load_recipe("e4", "quick", TINY))


MAX_BACK = STUDY.dyck_max_back


def test_pool_probe_labels_match_a_recount_of_the_planted_string(run):
    """Pool sequences carry pool tasks; at every probed position the label ``back_j`` is the task's
    string at (brackets seen - j), the depth its running sum, and the mask holds exactly the
    positions with MAX_BACK..length-1 brackets placed."""
    family, pool = run.family, run.pool
    batch = probe_batch(run, "pool", 12)
    assert ((batch.task >= 0) & (batch.task < pool.size)).all()
    mask, targets = probe_targets(family, batch.tokens)
    assert set(targets) == {f"back_{j}" for j in range(1, MAX_BACK + 1)} | {"depth"}
    for b, row in enumerate(batch.tokens.tolist()):
        word = pool.params[batch.task[b]].tolist()
        seen: list[int] = []
        for t, x in enumerate(row):
            if x >= family.n_noise:
                seen.append(x - family.n_noise)
            assert seen == word[: len(seen)]  # in distribution: the sequence plants its task's string
            assert bool(mask[b, t]) == (MAX_BACK <= len(seen) < family.length)
            if mask[b, t]:
                for j in range(1, MAX_BACK + 1):
                    assert targets[f"back_{j}"][1][b, t] == word[len(seen) - j]
                assert targets["depth"][1][b, t] == sum(1 - 2 * s for s in seen)
    assert mask.sum() > 0


def test_probe_tables_cover_every_site_and_both_sets(run, tmp_path):
    """One tidy row per (set, site, layer, target): the embedding and resid_mid / resid_post of
    every layer; finite scores; the untrained network's table has the same shape; the figure draws."""
    model = run.new_model()
    tables = {which: prefix_probes(run, model, which, n_sequences=48) for which in ("pool", "ood")}
    expected = {(0, "resid_pre")} | {(layer, name) for layer in range(2) for name in ("resid_mid", "resid_post")}
    for which, rows in tables.items():
        assert {r["set"] for r in rows} == {which}
        assert {(r["layer"], r["site"]) for r in rows} == expected
        assert len(rows) == len(expected) * (MAX_BACK + 1)
        assert all(set(r) == {"set", "site", "layer", "target", "metric", "score", "control"} for r in rows)
        assert all(math.isfinite(r["score"]) and math.isfinite(r["control"]) for r in rows)
        assert {r["metric"] for r in rows if r["target"] == "depth"} == {"r2"}
    assert tables["pool"] != tables["ood"]
    path = tmp_path / "probes.png"
    baseline = [r for r in tables["pool"] + tables["ood"] if r["site"] == "resid_mid" and r["layer"] == 1]
    plot_prefix_probes(tables["pool"] + tables["ood"], baseline, path)
    assert path.stat().st_size > 0


def _planted_states(tokens: torch.Tensor, targets: dict, hold: list[str], width: int = 8) -> torch.Tensor:
    """[N, T, len(hold) + width]: the targets named in ``hold`` as (noisy) coordinates, then noise."""
    gen = generator(3, 0, "planted")
    N, T = tokens.shape
    held = [
        2 * targets[name][1].double() - 1 if name.startswith("back_") else targets[name][1].double() for name in hold
    ]
    signal = (
        torch.stack(held, -1) + 0.2 * torch.randn(N, T, len(hold), generator=gen, dtype=torch.float64)
        if hold
        else torch.zeros(N, T, 0, dtype=torch.float64)
    )
    return torch.cat([signal, torch.randn(N, T, width, generator=gen, dtype=torch.float64)], -1)


def test_probes_read_planted_geometry(run):
    """Features holding the bracket j back as a coordinate give accuracy near 1 against a control
    near chance; features without any of the labels stay at the control."""
    tokens = probe_batch(run, "pool", 128).tokens
    mask, targets = probe_targets(run.family, tokens)
    names = [f"back_{j}" for j in range(1, MAX_BACK + 1)]
    states = [
        ((0, "resid_mid"), _planted_states(tokens, targets, [])),
        ((1, "resid_mid"), _planted_states(tokens, targets, [*names, "depth"])),
    ]
    rows = {(r["layer"], r["target"]): r for r in probe_rows(states, targets, mask, "pool", seed=0)}
    for name in names:
        majority = max(float((targets[name][1][mask] == c).double().mean()) for c in (0, 1))
        planted, empty = rows[(1, name)], rows[(0, name)]
        assert planted["score"] > 0.97 and planted["control"] < majority + 0.08, planted
        assert abs(empty["score"] - empty["control"]) < 0.1 and empty["score"] < majority + 0.08, empty
    assert rows[(1, "depth")]["score"] > 0.95 and abs(rows[(1, "depth")]["control"]) < 0.05
    assert rows[(0, "depth")]["score"] < 0.05


def test_weakest_probe_is_the_target_the_claims_place_does_not_hold(run):
    """The claim's number: every target read at one place (the M1 block's resid_post), the smallest
    margin over targets. With the bracket 7 back held elsewhere only, it is the weakest target there,
    far below the held ones."""
    tokens = probe_batch(run, "pool", 128).tokens
    mask, targets = probe_targets(run.family, tokens)
    held = [f"back_{j}" for j in range(1, MAX_BACK)]
    states = [
        ((0, "resid_post"), _planted_states(tokens, targets, [])),
        ((1, "resid_post"), _planted_states(tokens, targets, [*held, "depth"])),
        ((1, "resid_mid"), _planted_states(tokens, targets, [f"back_{MAX_BACK}"])),
    ]  # another site: not read
    rows = probe_rows(states, targets, mask, "pool", seed=0)
    weakest = weakest_probe(rows, 1)
    assert weakest["target"] == f"back_{MAX_BACK}" and weakest["layer"] == 1
    assert weakest["gain"] == pytest.approx(weakest["score"] - weakest["control"])
    assert weakest["gain"] < spec("e4", "prefix_probe").threshold + 0.05
    held_gains = [
        r["score"] - r["control"] for r in rows if (r["layer"], r["site"]) == (1, "resid_post") and r["target"] in held
    ]
    assert len(held_gains) == len(held) and min(held_gains) > 0.3
    assert weakest_probe(rows, 1, "resid_mid")["target"] != f"back_{MAX_BACK}"
    first = next(r for r in rows if (r["layer"], r["site"], r["target"]) == (0, "resid_post", "back_1"))
    assert (
        weakest_probe([{**r, "score": math.nan} if r is first else r for r in rows], 1) == weakest
    )  # another layer: not read
    nan_there = [
        {**r, "score": math.nan} if (r["layer"], r["site"], r["target"]) == (1, "resid_post", "back_1") else r
        for r in rows
    ]
    assert weakest_probe(nan_there, 1)["target"] == "back_1" and math.isnan(weakest_probe(nan_there, 1)["gain"])
    with pytest.raises(ValueError, match="no probe rows"):
        weakest_probe(rows, 1, "attn_out")

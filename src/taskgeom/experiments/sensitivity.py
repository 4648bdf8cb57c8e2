"""How the claims move under the earlier conventions of docs/protocol.md#variants, each measured on the
same run (``taskgeom sensitivity``). It reports, it does not decide: the claims keep the study's
protocol (docs/protocol.md).

``ablation_variants(run)`` covers the double dissociation (``ablate_S_major``, ``ablate_S_ood``,
``ablate_V_ood``, ``ablate_V_major``, ``random_control``) at the run's own diversity: one row per
(claim, convention) with the claim's value and status (``claims.dual_modes.ablation_claims``,
the very rule of the claims) under the protocol and under each variant of ``ABLATION_VARIANTS`` that
can move it (``Variant.claims``):

- ``centred-S``: S ablated as ``h - P_S (h - mu_t)`` on the task vectors' span, at the place the
  M1 analysis selects (``StudyRun.select_place`` on the ``select`` split), one place;
- ``s-with-mean``, ``probe-exact``: S the earlier rank-K probe's, or the probe's exact
  double-precision fit's, at every block, ablated (V avoids the search probe's span, not S: the same
  V), summarised by the block mean;
- ``v-avoids-tokens``, ``v-searched-on-minors``, ``v-searched-on-ood``, ``v-avoids-major-span``,
  ``v-earlier-search``: V searched again at every block under that choice, with its random controls,
  summarised by the block mean;
- ``v-best-block``: the protocol's V and controls read at the one block whose V raises the OOD loss
  most on the ``search-select`` split, instead of the mean over blocks.

Each row: ``{claim, variant, value, status, comparison, threshold, reason, place, parts, v_search}``;
``place`` names where the value was read ("mean over blocks", or a block or place), ``parts`` the
claim's parts, ``v_search`` each block's V search as "layer: steps run/best step" (0-based; None where
no V was searched). The judged variants (the claims' forms) are ``taskgeom rejudge``'s. A caller judges a claim over
runs of several seeds with ``claims.rules.verdict``.

``stored_variants(run)`` reads the other variants from the run's stored analyses, without measuring
anything: the M1 claims P0-P3 (``m1.json``; ``claims.m1.claim_values``, the claims' own rule in
``claims.m1.retrieval_claims``) under the protocol and ``selected-place``, ``site-mid``,
``natural-cells``, ``pooled-anova``, ``p2-task-only``, ``p3-late-window``; steering under the protocol and ``steer-at-read-site`` (both stored in ``m1.json``);
and projection R^2 at the run's diversity (``dual.json``; the high-diversity claim's threshold)
under the protocol and ``per-sequence-r2``. Steering under another place would have to be measured
again there, and the projection drop needs two runs: neither is listed.

``sensitivity(run_dirs, variants, places, threads)`` is ``taskgeom sensitivity``: every run's rows, then
``summarise`` (each claim judged over the runs) or ``place_summary`` (the place-dependent values).
What it measures again it measures with ``threads`` torch threads, because the V search's result
depends on the thread count: with one, a reproduction's sweep analyses' count (``--cpus-per-run``,
1 with the default ``--workers``), the protocol's rows are ``claims.json``'s bit for bit; with two, E3's quick
``ablate_V_major`` moves from 1.35 to 2.13 on seed 0 (docs/results.md).

``place_choices`` reads, from a run's stored analyses, the values the place-dependent claims would
have at every other (layer, site): P0-P2 as the claims read them (``m1.json``: a token family's
forced-token cells, E2's measurement batch) and projection
R^2, the protocol's and the ``per-sequence-r2`` variant (``dual.json``).
"""

from __future__ import annotations

import pandas as pd

from taskgeom.analysis.measures.shares import loss_window, share_of_gain
from taskgeom.analysis.measures.variants import (
    BY_NAME,
    DATA_VARIANTS,
    JUDGED_VARIANTS,
    MEASURED_AGAIN,
    STORED_VARIANTS,
    protocol,
)
from taskgeom.analysis.protocol import STUDY, Protocol, active, measured_under
from taskgeom.analysis.stored.ablations import Block, ablation_rows, block_places, find_blocks, v_block
from taskgeom.analysis.stored.m1 import READ_SITE_PREFIX
from taskgeom.analysis.stored.rows import row, stored_rows
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.catalog import spec
from taskgeom.claims.dual_modes import ablation_claims
from taskgeom.claims.m1 import claim_values, retrieval_claims, stored_steering
from taskgeom.claims.rules import verdict
from taskgeom.errors import AnalysisError, TaskgeomError
from taskgeom.report.geometry import claimed_by_layer
from taskgeom.runs.folders import Run
from taskgeom.settings.config import ConfigError
from taskgeom.settings.devices import torch_threads
from taskgeom.settings.recipes import DEFAULT_PROFILE, load_measure, recipe_path

ABLATION_VARIANTS = MEASURED_AGAIN  # the dissociation's variants, measured again on each run
SETS = ("major", "ood")  # the sets the dissociation's claims read


def _centred_s_rows(run: StudyRun, n_seq: int, sets: dict, clean: dict, protocol: Protocol) -> tuple[list[dict], str]:
    """The S rows of ``centred-S`` (``protocol``) as summary rows (``layer`` null), at the selected
    place, and that place in words."""
    place = run.select_place(run.selection_batch(), n_random=0).best
    geometry = run.geometry(run.heldout("major", n_seq, split="geometry"), place)
    rows, window = [], loss_window(run.family)
    for name, sequences in sets.items():
        with geometry.ablate(protocol):
            ablated = run.loss(sequences, per_position=True)
        share = share_of_gain(ablated, clean[name], window)
        where = {"place": (None, place.site), "batch": "loss", "set": name}
        rows += [
            row("loss_ablate_S", ablated[window].mean(), **where),
            row("gain_removed_ablate_S", share.value, share=share, **where),
        ]
    return rows, f"layer {place.layer} {place.site} (selected)"


def ablation_variants(
    run: StudyRun,
    variants: tuple[str, ...] = ABLATION_VARIANTS,
    *,
    n_seq: int | None = None,
    search_steps: int | None = None,
) -> list[dict]:
    """The dissociation's claims under the protocol and each of ``variants`` on ``run`` (module
    docstring); ``n_seq`` and ``search_steps``: the active protocol's ``geometry_sequences`` and
    ``search_steps`` when None."""
    n_seq = active().geometry_sequences if n_seq is None else n_seq
    unknown = [v for v in variants if v not in ABLATION_VARIANTS]
    if unknown:
        raise AnalysisError(f"sensitivity measures the ablation variants {list(ABLATION_VARIANTS)}, not {unknown}")
    geometries = list(run.geometries(run.heldout("major", n_seq, split="geometry"), block_places(run)))
    sets = {name: run.heldout(name, active().eval_sequences, split="loss") for name in SETS}
    clean = {name: run.loss(sequences, per_position=True) for name, sequences in sets.items()}
    blocks: list[Block] = find_blocks(run, geometries, steps=search_steps)
    mean = "mean over blocks"
    measured = {"protocol": (ablation_rows(run, blocks, sets, clean), mean, blocks)}
    for name in variants:
        chosen = BY_NAME[name].protocol
        if chosen.s_probe == "centred":
            measured[name] = (*_centred_s_rows(run, n_seq, sets, clean, chosen), None)
        elif chosen.v_block == "best":
            best = v_block(run, blocks, n_seq)
            measured[name] = (
                ablation_rows(run, blocks, sets, clean, v_block=best),
                f"block {blocks[best].place.layer}",
                blocks,
            )
        else:
            searched = find_blocks(run, geometries, steps=search_steps, protocol=chosen)
            measured[name] = (ablation_rows(run, searched, sets, clean, protocol=chosen), mean, searched)

    k, recipe, rows, window = run.config.task.diversity, run.config.name, [], loss_window(run.family)
    for name, (variant_rows, where, searched) in measured.items():
        clean_rows = [
            row(metric, value, batch="loss", set=s)
            for s in SETS
            for metric, value in (("loss", clean[s][window].mean()), ("loss_first", clean[s][0]))
        ]
        table = pd.DataFrame([*variant_rows, *clean_rows]).assign(diversity=k, step=float("nan"))
        for claim in ablation_claims(table, recipe, k):
            if name == "protocol" or BY_NAME[name].moves(claim.id.split(".", 1)[1]):
                rows.append({**_variant_row(claim, name, where), "v_search": _search_text(searched)})
    return rows


def _search_text(blocks: list[Block] | None) -> str | None:
    """Each block's V search as "layer: steps run/best step" (the kept V is the average of the raw
    iterate at the best step, 0-based; "no room" where the span V avoids leaves it none), or None
    where no V was searched."""
    if blocks is None:
        return None
    return ", ".join(
        f"{b.place.layer}: " + ("no room" if b.search is None else f"{b.search.steps}/{b.search.best_step}")
        for b in blocks
    )


def stored_variants(run: Run) -> list[dict]:
    """The rows of ``ablation_variants``' layout for the variants read from ``run``'s stored
    ``m1.json`` and ``dual.json`` (module docstring); none for an analysis the run lacks."""
    recipe, rows = run.config.name, []
    m1 = stored_rows(run, "m1")
    if m1 is not None:
        for name in ("protocol", *STORED_VARIANTS):  # those that move no P0-P3 claim give no row here
            values = claim_values(m1, protocol(name))
            claims = [
                c
                for c in retrieval_claims(values, recipe)
                if name == "protocol" or BY_NAME[name].moves(c.id.split(".", 1)[1])
            ]
            for claim in claims:
                reading = values[claim.id.split(".", 1)[1]]
                where = f"layer {reading.parts['layer']} {reading.parts['site']}"
                rows.append(_variant_row(claim, name, where))
        for name, prefix in (("protocol", "steering"), ("steer-at-read-site", READ_SITE_PREFIX)):
            stored = stored_steering(m1, prefix)
            if stored is not None:
                written = next(r for r in m1 if r["metric"].startswith(f"{prefix}."))
                claim = spec("m1", "steering").judge(recipe, stored[0], stored[1])
                rows.append(_variant_row(claim, name, f"layer {written['layer']} {written['site']}"))
    dual = stored_rows(run, "dual")
    if dual is not None:
        final = {
            r["metric"]: r
            for r in dual
            if r["step"] is None and r["metric"] in ("projection_r2", "projection_r2_per_sequence")
        }
        for name, metric in (("protocol", "projection_r2"), ("per-sequence-r2", "projection_r2_per_sequence")):
            if metric in final:
                r = final[metric]
                claim = spec("dual_modes", "projection_r2_high_diversity").judge(recipe, r["value"])
                rows.append(_variant_row(claim, name, f"layer {r['layer']} {r['site']}"))
    return rows


def _variant_row(claim, name: str, place: str) -> dict:
    """One claim under one variant: its value, status, threshold, where it was read and its parts."""
    return {
        "claim": claim.id,
        "variant": name,
        "value": claim.value,
        "status": claim.status,
        "comparison": claim.comparison,
        "threshold": claim.threshold,
        "reason": claim.reason,
        "place": place,
        "parts": claim.parts,
    }


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (claim, diversity, variant) of ``ablation_variants``' rows over several runs
    (``run`` a column; seeds, as a rule): the median and range of the value over the runs where
    the claim applies, the verdict over them (``claims.rules.verdict``: pass on every run, fail on every
    run, else unstable), the number of runs and where the value was read."""
    lines = []
    for (claim, k, name), group in rows.groupby(["claim", "diversity", "variant"], sort=False):
        values = group.loc[group["status"] != "n/a", "value"].dropna()
        spread = [
            round(float(f(values)), 3) if len(values) else None
            for f in (pd.Series.median, pd.Series.min, pd.Series.max)
        ]
        lines.append(
            {
                "claim": claim,
                "k": k,
                "variant": name,
                "median": spread[0],
                "min": spread[1],
                "max": spread[2],
                "verdict": verdict(group["status"]),
                "runs": len(group),
                "place": group["place"].iloc[0],
            }
        )
    return pd.DataFrame(lines)


PLACE_METRICS = {
    "m1": ("p0.cell_r2", "p1.additive_share", "p2.r2_additive"),
    "dual": ("projection_r2", "projection_r2_per_sequence"),
}


def place_choices(run: Run) -> list[dict]:
    """``{analysis, metric, layer, site, value, pinned}`` for every (layer, site) a stored analysis
    of ``run`` measured (``m1.json``: P0-P2 as the claims read them, ``claimed_by_layer``: a token
    family's forced-token cells, E2's measurement batch; ``dual.json``: projection R^2 of the final
    model, the protocol's and the ``per-sequence-r2`` variant); ``pinned``: the place the claims
    read. A file of an earlier row version is left out (measure it again)."""
    rows = []
    for analysis, metrics in PLACE_METRICS.items():
        stored = stored_rows(run, analysis)
        if stored is None:
            continue
        if analysis == "m1":
            chosen = next(r for r in stored if r["metric"] == "place.m1")  # where the M1 claims read
            claimed, _ = claimed_by_layer(pd.DataFrame(stored))
            values = [
                {**r, "layer": int(r["layer"])} for r in claimed[claimed["metric"].isin(metrics)].to_dict("records")
            ]
        else:
            chosen = next(
                r for r in stored if r["metric"] == "projection_r2" and r["step"] is None
            )  # the protocol's place
            values = [
                {**r, "metric": r["metric"].removeprefix("table.")}
                for r in stored
                if r["metric"].removeprefix("table.") in metrics and r["metric"].startswith("table.")
            ]
        rows += [
            {
                "analysis": analysis,
                "metric": r["metric"],
                "layer": r["layer"],
                "site": r["site"],
                "value": r["value"],
                "pinned": (r["layer"], r["site"]) == (chosen["layer"], chosen["site"]),
            }
            for r in values
        ]
    return rows


def chosen_variants(asked: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The variants ``taskgeom sensitivity`` lists (default: every one it covers); TaskgeomError for a
    variant of the data (its runs are other runs) or one it does not cover."""
    chosen = tuple(asked or (*STORED_VARIANTS, *ABLATION_VARIANTS))
    data = [v for v in chosen if v in DATA_VARIANTS]
    if data:
        raise TaskgeomError(
            f"--variant: {', '.join(data)} changes the data, so its runs are other runs: train them with `taskgeom "
            f"reproduce --variant {data[0]}` and set its claims beside the protocol's with `taskgeom ladder results "
            f"results-{data[0]}`"
        )
    judged = [v for v in chosen if v in JUDGED_VARIANTS]
    if judged:
        raise TaskgeomError(
            f"--variant: {', '.join(judged)} is a form of the claims, judged on a whole reproduction's stored analyses: "
            f"`taskgeom rejudge results --variant {judged[0]}`"
        )
    unknown = [v for v in chosen if v not in (*STORED_VARIANTS, *ABLATION_VARIANTS)]
    if unknown:
        raise TaskgeomError(
            f"--variant: sensitivity lists the variants {', '.join((*STORED_VARIANTS, *ABLATION_VARIANTS))}; not "
            f"{', '.join(unknown)}"
        )
    return chosen


def profile_protocol(run: Run, profile: str) -> Protocol:
    """The protocol ``run`` was reproduced under at ``profile``: its recipe's sample sizes there (the
    study's for a run of no recipe found here at the default profile)."""
    try:
        return load_measure(recipe_path(run.config.name), profile).analysis_protocol
    except ConfigError:
        if profile == DEFAULT_PROFILE:
            return STUDY
        raise


def sensitivity(
    run_dirs: list, variants: tuple[str, ...], places: bool = False, threads: int = 1, profile: str = DEFAULT_PROFILE
) -> pd.DataFrame:
    """Every run's rows, with its run, recipe, diversity and seed: under the protocol and each of
    ``variants`` (``stored_variants``, and ``ablation_variants`` measured again with ``threads`` torch
    threads, 0: as torch has it, at the sample sizes of ``profile`` in the run's recipe: those its
    reproduction measured with), or with ``places`` the place-dependent values at every layer and site
    (``place_choices``)."""
    ablations = tuple(v for v in variants if v in ABLATION_VARIANTS)
    rows = []
    for run_dir in run_dirs:
        run = Run.open(run_dir)
        with measured_under(profile_protocol(run, profile)):  # what its stored rows are keyed by
            if places:
                measured = place_choices(run)
            else:
                measured = [r for r in stored_variants(run) if r["variant"] in ("protocol", *variants)]
                if ablations:
                    with torch_threads(threads):
                        measured += ablation_variants(StudyRun(run), ablations)
        rows += [
            {
                "run": run.path.name,
                "recipe": run.config.name,
                "diversity": run.config.task.diversity,
                "seed": run.config.train.seed,
                **row,
            }
            for row in measured
        ]
    return pd.DataFrame(rows)


def place_summary(table: pd.DataFrame) -> pd.DataFrame:
    """``place_choices`` rows of several runs summarised per (recipe, diversity, analysis, metric):
    the value at the place the claims read, the lowest and the highest over all places, each the
    median over the runs; TaskgeomError when no run had stored analyses."""
    if table.empty:
        raise TaskgeomError(
            "none of the runs has analysis/m1.json or analysis/dual.json; run `taskgeom analyze` or a sweep first"
        )
    keys = ["recipe", "diversity", "analysis", "metric"]
    per_run = table.groupby([*keys, "run"], sort=False)["value"]
    return (
        pd.DataFrame(
            {
                "pinned": table[table["pinned"]].groupby([*keys, "run"], sort=False)["value"].first(),
                "lowest": per_run.min(),
                "highest": per_run.max(),
            }
        )
        .groupby(keys, sort=False)
        .median()
        .reset_index()
    )

"""The dual modes across task diversity (docs/concepts.md#m2-the-nearly-orthogonal-subspace): projection R^2, the double
dissociation, the predictor transition and Theorem 2, for the recipes that declare ``dual_modes``
at the profile (E1 and E3; E2 at paper), measured where docs/protocol.md pins them (``analysis.stored.dual``). Projection R^2 claims read the study's Fig. 4 statistic
(``analysis.reading.projection``), with its place, task counts, interquartile range, linear-code reference
and the ``per-sequence-r2`` variant in their parts; every share of in-context gain carries its
parts (clean, ablated and first losses, the gain in nats, and ``unreliable`` when the gain is below
``MIN_RELIABLE_GAIN``), and a claim on a share of a gain that is not positive is ``n/a`` with that
reason."""

from __future__ import annotations

import pandas as pd

from taskgeom.analysis.stored.ablations import N_RANDOM_CONTROLS
from taskgeom.analysis.stored.rows import FIELDS
from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN
from taskgeom.claims.catalog import evidence, spec
from taskgeom.claims.rules import gain_parts
from taskgeom.settings.config import ConfigError, load_measure
from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import TrainTask
from taskgeom.experiments.sweep import Job, by_step, job_seconds, run_sweep
from taskgeom.report.dual import (plot_dissociation, plot_projection_r2, plot_projection_r2_steps, plot_rank_curve, plot_theorem2,
                                  plot_transition, rank_curve)
from taskgeom.runs.storage import atomic_write_text

def grid(ctx: Context) -> tuple[list[int], tuple[str, ...]]:
    """The sweep's diversities (``--grid``, else the profile's ``measure.grid`` in the recipes, which
    must agree) and the recipes it measures."""
    studies = ctx.taking_part("dual_modes")
    recipes = tuple(study.name for study in studies)
    if ctx.diversities:
        return list(ctx.diversities), recipes
    grids = {study.name: load_measure(study.path, ctx.profile).grid for study in studies}
    if len({tuple(g) for g in grids.values()}) > 1:
        raise ConfigError(f"the recipes' profiles {ctx.profile!r} name different diversity grids ({grids}); give one with --grid")
    return (next(iter(grids.values())) if grids else []), recipes

DUAL_EVIDENCE = evidence("dual_modes")


def _pick(rows: pd.DataFrame, metric: str, diversity: int, set_name: str | None = None, summary: bool | None = None) -> pd.DataFrame:
    """Final-model rows of ``metric`` at ``diversity`` among ``rows`` (one seed's), of ``set_name``
    when given; ``summary``: only the ablations' summary rows over blocks (``layer`` null, True) or
    only per-block rows (False)."""
    pick = rows[(rows["metric"] == metric) & (rows["diversity"] == diversity) & rows["step"].isna()]
    if set_name is not None:
        pick = pick[pick["set"] == set_name]
    if summary is not None:
        pick = pick[pick["layer"].isna() == summary]
    return pick


def _value(rows: pd.DataFrame, metric: str, diversity: int, set_name: str | None = None, summary: bool | None = None) -> float:
    """A final-model metric of the run at ``diversity`` among ``rows`` (one seed's), NaN if absent."""
    pick = _pick(rows, metric, diversity, set_name, summary)
    return float(pick["value"].mean()) if len(pick) else float("nan")


def _per_block(rows: pd.DataFrame, metric: str, diversity: int, set_name: str, prefix: str = "") -> dict[str, float]:
    """{``{prefix}block{l}``: value} of a metric's per-block rows (one seed's), in block order."""
    pick = _pick(rows, metric, diversity, set_name, summary=False).sort_values("layer")
    return {f"{prefix}block{int(layer)}": float(value) for layer, value in zip(pick["layer"], pick["value"])}


def _reason(rows: pd.DataFrame, metric: str, diversity: int, set_name: str) -> str | None:
    """Why a final-model share of gain in ``rows`` (one seed's) counts neither way (docs/protocol.md,
    "Shares of in-context gain"): it is null (its gain is not positive) or unreliable (its gain is
    below ``MIN_RELIABLE_GAIN``); else None."""
    pick = _pick(rows, metric, diversity, set_name, summary=True)
    reasons = [r for r in pick["reason"] if isinstance(r, str)] if "reason" in pick else []
    if reasons:
        return reasons[0]
    if "unreliable" in pick and pick["unreliable"].eq(True).any():
        gain = float(pick["gain"].iloc[0])
        return f"the in-context gain L_0 - L = {gain:.3g} is below {MIN_RELIABLE_GAIN} nats: its share is unreliable"
    return None


def projection_parts(rows: pd.DataFrame, diversity: int) -> dict:
    """The parts of projection R^2 at ``diversity`` in ``rows`` (one seed's): its value, the place it
    was read (block and site), the OOD task count and sequences per task, the interquartile range
    over OOD tasks, the linear-code reference (or why there is none) and the ``per-sequence-r2``
    variant's value."""
    def final(metric: str) -> pd.DataFrame:
        return rows[(rows["metric"] == metric) & (rows["diversity"] == diversity) & rows["step"].isna() & (rows["set"] == "ood")]

    def band(row: pd.Series) -> tuple[float, float]:
        return tuple(row["band"]) if isinstance(row["band"], (list, tuple)) else (float("nan"),) * 2

    pick = final("projection_r2")
    if pick.empty:
        return {}
    measured = pick.iloc[0]
    low, high = band(measured)
    parts = {"value": measured["value"], "block": int(measured["layer"]), "site": measured["site"],
             "ood_tasks": int(_value(rows, "projection_r2_tasks", diversity, "ood")),
             "sequences_per_task": int(_value(rows, "projection_r2_per_task", diversity, "ood")), "iqr_low": low, "iqr_high": high,
             "per_sequence_r2": _value(rows, "projection_r2_per_sequence", diversity, "ood")}
    reason = _reason(rows, "projection_r2_reference", diversity, "ood")
    if reason or final("projection_r2_reference").empty:
        return {**parts, "reference_unavailable": reason or "not measured"}
    reference = final("projection_r2_reference").iloc[0]
    ref_low, ref_high = band(reference)
    return {**parts, "reference": reference["value"], "reference_iqr_low": ref_low, "reference_iqr_high": ref_high}


def _each_recipe(ctx: Context, *claims: str) -> tuple[str, ...]:
    """The ids of ``claims`` for every recipe of the profile's grid (``e1.ablate_V_ood``, ...)."""
    return tuple(f"{recipe}.{claim}" for recipe in grid(ctx)[1] for claim in claims)


def _jobs(ctx: Context) -> list[Job]:
    diversities, recipes = grid(ctx)
    paths = {study.name: str(study.path) for study in ctx.studies}
    return [Job(paths[recipe], k, seed, ctx.profile, str(ctx.runs_root), ctx.overrides, ctx.device, ctx.tracker)
            for recipe in recipes for k in diversities for seed in ctx.seeds]


def runs(ctx: Context) -> list[TrainTask]:
    """The sweep's runs, for the schedule, each with the thread count the sweep gives it, and their
    dual-mode analysis (done there, the sweep then reads it)."""
    return [TrainTask(config, job.root, job.device, job.tracker, config.train.threads or ctx.executor.threads, analyse=True,
                      projection_sizes=job.measure().projection_sizes)
            for job in _jobs(ctx) for config in [job.config()]]


def claims(rows: pd.DataFrame, recipe: str, low: int, high: int, profile: str) -> list:
    """The dual-mode claims of ``recipe`` from the sweep rows of one seed (its runs at every k)."""
    made = []

    def claim(name, description, value, parts=None):
        made.append(spec("dual_modes", name).judge(recipe, description, value, profile, parts))

    r2_high, r2_low = _value(rows, "projection_r2", high, "ood"), _value(rows, "projection_r2", low, "ood")
    what = "projection R^2 of OOD task means onto the major task means (the study's Fig. 4)"
    claim("projection_r2_high_diversity", f"{what} at k = {high}", r2_high, projection_parts(rows, high))
    claim("projection_r2_drop", f"{what} at k = {low} minus at k = {high}", r2_low - r2_high,
          {**{f"k={low}.{name}": v for name, v in projection_parts(rows, low).items()},
           **{f"k={high}.{name}": v for name, v in projection_parts(rows, high).items()}})
    made += ablation_claims(rows, recipe, high, profile)
    if len(rows) and rows["metric"].str.startswith("transition_").any():  # token families only
        final = by_step(rows).sort_values("step").groupby("diversity").last()
        for name, k, word in (("transition_memorising", low, "negative: memorising"), ("transition_generalising", high, "positive: generalising")):
            parts = ({"kl_to_memorising": final.loc[k, "kl_to_memorising"], "kl_to_generalising": final.loc[k, "kl_to_generalising"]}
                     if k in final.index else None)
            claim(name, f"log(KL_mem / KL_gen) of the final model at k = {k} ({word})",
                  final["log_ratio"].get(k, float("nan")), parts)
    return made


def ablation_claims(rows: pd.DataFrame, recipe: str, high: int, profile: str) -> list:
    """The double dissociation's claims of ``recipe`` (one seed's rows): the share of the major and
    OOD gain that ablating S and V removes, and the random control, each read from the summary
    over blocks (``analysis.stored.ablations``: the block mean) at k = ``high``, with its parts: the
    summary's losses and gain, each block's share and their mean."""
    made = []
    for ablation, target, spared in (("ablate_S", "major", "ood"), ("ablate_V", "ood", "major")):
        what = "task subspace S" if ablation == "ablate_S" else "orthogonal directions V"
        for set_name in (target, spared):
            metric = f"gain_removed_{ablation}"
            value = _value(rows, metric, high, set_name, summary=True)
            parts = {**gain_parts(_value(rows, "loss", high, set_name), _value(rows, f"loss_{ablation}", high, set_name, summary=True),
                                  _value(rows, "loss_first", high, set_name)),
                     **_per_block(rows, metric, high, set_name), "block_mean": value}
            description = f"% of {set_name} in-context gain removed by ablating the {what}, mean over blocks (k = {high})"
            made.append(spec("dual_modes", f"{ablation}_{set_name}").judge(recipe, description, value, profile, parts,
                                                                             _reason(rows, metric, high, set_name)))
    sets = ("major", "ood")
    stats = {s: _value(rows, "gain_removed_random", high, s, summary=True) for s in sets}
    parts = {part: v for s in sets for part, v in
             {f"{s}_block_mean": stats[s], **_per_block(rows, "gain_removed_random", high, s, f"{s}_")}.items()}
    reasons = [f"{s}: {r}" for s in sets if (r := _reason(rows, "gain_removed_random", high, s))]
    made.append(spec("dual_modes", "random_control").judge(recipe,
                       f"largest over major and OOD of the mean over blocks of the 75th percentile of |% gain removed| by "
                       f"{N_RANDOM_CONTROLS} random same-rank directions (k = {high})",
                       float("nan") if any(v != v for v in stats.values()) else max(stats.values()),
                       profile, parts, "; ".join(reasons) or None))
    return made


def dual_modes(ctx: Context) -> None:
    diversities, recipes = grid(ctx)
    if not recipes:  # --recipes named none of the sweep's
        return
    jobs = _jobs(ctx)
    table = run_sweep(jobs, ctx.executor, out=ctx.out / "tables")
    for job in job_seconds(table).itertuples():
        name = f"{job.recipe} k={job.diversity} seed={job.seed}"
        ctx.timings.add(ctx.experiment, f"train {name}", job.train_wall_s, job.train_cpu_s)
        ctx.timings.add(ctx.experiment, f"analyse {name}", job.analysis_wall_s, job.analysis_cpu_s)
    ok = table[table["status"] == "ok"]
    ok = ok.reindex(columns=list(dict.fromkeys([*ok.columns, *FIELDS])))  # none finished: no row columns, the claims are n/a
    low, high = min(diversities), max(diversities)
    for recipe in recipes:
        rows = ok[ok["recipe"] == recipe]
        for seed in ctx.seeds:
            ctx.claim(seed, *claims(rows[rows["seed"] == seed], recipe, low, high, ctx.profile))
        if len(rows):
            plot_dissociation(rows[rows["diversity"] == high], ctx.figure(f"{recipe}_double_dissociation.png",
                              f"{recipe.upper()}, k = {high}: share of in-context gain removed by ablating S, V or a random direction "
                              "at each block and their mean",
                              tuple(f"{recipe}.{name}" for name in DUAL_EVIDENCE["dissociation"])),
                              f"{recipe.upper()} double dissociation (k = {high})")
    if len(ok):
        plot_projection_r2(ok, ctx.figure("projection_r2.png", "Projection R^2 of OOD task means onto the major task means (the study's "
                                          "Fig. 4 statistic) across diversity: the claims' value (solid, IQR band over OOD tasks), the "
                                          "linear-code reference (dashed) and the per-sequence-r2 variant (dotted)",
                                          _each_recipe(ctx, *DUAL_EVIDENCE["projection"])))
        curve = rank_curve(ok)
        atomic_write_text(ctx.out / "tables" / "rank_curve.csv", curve.to_csv(index=False))
        plot_rank_curve(curve, ctx.figure("rank_curve.png", "Share of OOD in-context gain removed by ablating orthogonal directions V of "
                                          "rank r = 1..ceil(d0), mean over blocks (tables/rank_curve.csv: every block)",
                                          _each_recipe(ctx, *DUAL_EVIDENCE["rank"])))
        plot_transition(by_step(ok), ctx.figure("predictor_transition.png",
                        "Predictor transition: log(KL to memorising / KL to generalising Bayes) over diversity and training step",
                        _each_recipe(ctx, *DUAL_EVIDENCE["transition"])))
        plot_projection_r2_steps(ok, ctx.figure("projection_r2_steps.png",
                                 "The study's Fig. 4: projection R^2 of OOD task means across training, one line per diversity k "
                                 "(IQR band over OOD tasks), the linear-code reference dashed",
                                 _each_recipe(ctx, *DUAL_EVIDENCE["projection"])))
        plot_theorem2(ok, ctx.figure("theorem2.png", "Theorem 2: distance of OOD states from S beside (c - delta)/L (last layer)"))


dual_modes.runs = runs

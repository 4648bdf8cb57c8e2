"""The dual modes across task diversity (PAPER.md section 5): projection R^2, the double
dissociation, the predictor transition and Theorem 2, for E1 and E3."""

from __future__ import annotations

import pandas as pd

from taskgeom.claims import check
from taskgeom.experiments.base import Context
from taskgeom.experiments.sweep import Job, run_sweep, by_step
from taskgeom.report.dual import plot_dissociation, plot_projection_r2, plot_projection_r2_steps, plot_theorem2, plot_transition

# (diversity grid, seeds, recipes) per profile. [ours] The quick profile leaves E2 out: its runs
# cost about 5 CPU-minutes each, and the whole quick reproduction aims at 20 minutes.
GRIDS = {"quick": ([-1, 3, 8], [0], ("e1", "e3")), "paper": (list(range(-1, 11)), [0, 1, 2], ("e1", "e2", "e3"))}

# Projection R^2 of OOD states onto S: below this at the highest diversity of the grid ...
MAX_R2_HIGH_DIVERSITY = 0.2
# ... and at least this much lower than at k = -1.
MIN_R2_DROP = 0.4
# Double dissociation on the highest-diversity model, in percent of the in-context gain removed:
# the targeted set loses at least this much ...
MIN_TARGETED_GAIN_REMOVED = 50.0
# ... the other set less than this ...
MAX_SPARED_GAIN_REMOVED = 20.0
# ... and a random direction of the same rank moves neither by more than this.
MAX_RANDOM_GAIN_REMOVED = 10.0


def _value(rows: pd.DataFrame, metric: str, diversity: int, set_name: str | None = None) -> float:
    pick = rows[(rows["metric"] == metric) & (rows["diversity"] == diversity) & rows["step"].isna()]
    if set_name is not None:
        pick = pick[pick["set"] == set_name]
    return float(pick["value"].mean()) if len(pick) else float("nan")


def dual_modes(ctx: Context) -> None:
    diversities, seeds, recipes = GRIDS[ctx.profile]
    jobs = [Job(recipe, k, seed, ctx.profile, str(ctx.runs_root), device=ctx.device, tracker=ctx.tracker)
            for recipe in recipes for k in diversities for seed in seeds]
    table = run_sweep(jobs, ctx.executor, out=ctx.out / "tables")
    ok = table[table["status"] == "ok"]
    low, high = min(diversities), max(diversities)
    for recipe in recipes:
        rows = ok[ok["recipe"] == recipe]
        claim = lambda name, description, value, op, threshold: ctx.claims.append(  # noqa: E731
            check(f"{recipe}.{name}", recipe, description, value, op, threshold, ctx.profile))
        r2_high, r2_low = _value(rows, "projection_r2", high, "ood"), _value(rows, "projection_r2", low, "ood")
        claim("projection_r2_high_diversity", f"projection R^2 of OOD states onto S at k = {high}", r2_high, "<", MAX_R2_HIGH_DIVERSITY)
        claim("projection_r2_drop", f"projection R^2 at k = {low} minus at k = {high}", r2_low - r2_high, ">=", MIN_R2_DROP)
        for ablation, target, spared in (("ablate_S", "major", "ood"), ("ablate_V", "ood", "major")):
            what = "task subspace S" if ablation == "ablate_S" else "orthogonal directions V"
            claim(f"{ablation}_{target}", f"% of {target} in-context gain removed by ablating the {what} (k = {high})",
                  _value(rows, f"gain_removed_{ablation}", high, target), ">=", MIN_TARGETED_GAIN_REMOVED)
            claim(f"{ablation}_{spared}", f"% of {spared} in-context gain removed by ablating the {what} (k = {high})",
                  _value(rows, f"gain_removed_{ablation}", high, spared), "<", MAX_SPARED_GAIN_REMOVED)
        random = max(abs(_value(rows, "gain_removed_random", high, s)) for s in ("major", "ood"))
        claim("random_control", f"largest |% gain removed| by a random same-rank direction, major and OOD (k = {high})",
              random, "<", MAX_RANDOM_GAIN_REMOVED)
        if len(rows):
            plot_dissociation(rows[rows["diversity"] == high], ctx.figure(f"{recipe}_double_dissociation.png",
                              f"{recipe.upper()}, k = {high}: share of in-context gain removed by ablating S, V or a random direction"),
                              f"{recipe.upper()} double dissociation (k = {high})")
        if len(rows) and rows["metric"].str.startswith("transition_").any():  # token families only
            final = by_step(rows).sort_values("step").groupby("diversity").last()["log_ratio"]
            claim("transition_memorising", f"log(KL_mem / KL_gen) of the final model at k = {low} (negative: memorising)",
                  final.get(low, float("nan")), "<", 0.0)
            claim("transition_generalising", f"log(KL_mem / KL_gen) of the final model at k = {high} (positive: generalising)",
                  final.get(high, float("nan")), ">", 0.0)
    if len(ok):
        plot_projection_r2(ok, ctx.figure("projection_r2.png", "Projection R^2 of OOD states onto the task subspace across diversity (IQR bands)"))
        plot_transition(by_step(ok), ctx.figure("predictor_transition.png",
                        "Predictor transition: log(KL to memorising / KL to generalising Bayes) over diversity and training step"))
        plot_projection_r2_steps(by_step(ok), ctx.figure("projection_r2_steps.png",
                                 "Projection R^2 of OOD states onto the task subspace across training, one line per diversity k"))
        plot_theorem2(ok, ctx.figure("theorem2.png", "Theorem 2: distance of OOD states from S beside (c - delta)/L (last layer)"))

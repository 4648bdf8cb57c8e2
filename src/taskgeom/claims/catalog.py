"""Every claim of the study in one table: its name (a claim's id is its recipe's name, a dot, then
this name: ``e1.P0``), the experiment that measures it, what it compares, against which threshold,
and the figures that show it. The thresholds are ours, fixed before measuring and the same for
every family; docs/protocol.md#thresholds is generated from this table (``thresholds_table``) and
a test holds the page to it.

An experiment measures a value and calls ``spec(experiment, name).judge(...)``: the comparison and
the threshold come from here, the run-specific description (the place read, k) from the experiment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from taskgeom.claims.rules import Claim, Comparison, Part, check, not_applicable

# Steering's normalisation: the steered readout must be at most 1 / factor of the unsteered one (KL of
# next-token laws; E2: RMSE of the prediction of y), and below the mode task's. The claim's value is
# max(factor x steered / unsteered, steered / mode); a value <= 1 passes.
STEERING_FACTOR = {"kl": 3.0, "rmse": 2.0}


@dataclass(frozen=True)
class Spec:
    """One claim: ``name`` (its id after the recipe), the ``experiment`` that measures it, the
    ``recipes`` it is measured for (in words), the ``quantity`` compared (in words), ``comparison``
    and ``threshold``, and the kinds of figure that show it (``figures``: an M1 or dual-mode figure
    kind, else a figure's file stem)."""

    name: str
    experiment: str
    recipes: str
    quantity: str
    comparison: Comparison
    threshold: float
    figures: tuple[str, ...] = ()

    def judge(self, recipe: str, description: str, value: float, profile: str, parts: Optional[dict[str, Part]] = None,
              reason: Optional[str] = None) -> Claim:
        """The claim ``{recipe}.{name}`` of one seed: checked against the threshold, or ``n/a`` with ``reason``."""
        claim_id = f"{recipe}.{self.name}"
        if reason is not None:
            return not_applicable(claim_id, recipe, description, self.comparison, self.threshold, profile, reason, parts)
        return check(claim_id, recipe, description, value, self.comparison, self.threshold, profile, parts)


_M1 = "E1, E2, E3 (k = -1)"
_DUAL = "E1, E3 (the highest k of the grid)"
_SHARE = "% of the {target} in-context gain removed by ablating {what}, mean over blocks"
CLAIMS: tuple[Spec, ...] = (
    Spec("bayes_optimal", "bayes_optimum", "E1, E3 (k = -1)",
         "excess loss over the ID-Bayes predictor on held-out major-task sequences (nats/token, mean over positions)", "<=", 0.02,
         ("loss_by_position",)),
    Spec("P0", "m1", _M1, "P0, stability: cell-means R^2 of (task, current token), median over the late window", ">=", 0.9, ("layers",)),
    Spec("P1", "m1", _M1, "P1, decoupling: additive share of the variance P0's model explains, median over the late window", ">=", 0.9,
         ("layers",)),
    Spec("P2", "m1", _M1, "P2, interpolation: R^2_task of the sum-to-one simplex fit, late window (E2: r2_additive)", ">=", 0.8,
         ("layers", "positions")),
    Spec("P2.vs_random", "m1", _M1, "P2's R^2_task minus that of a random subspace of equal dimension", ">=", 0.3, ("layers",)),
    Spec("P3", "m1", _M1, "P3, alignment: TV between the per-task mean beta_t and mean posterior alpha_t, last quarter of positions",
         "<=", 0.1, ("simplex",)),
    Spec("P3.shrinks", "m1", _M1, "P3's TV over the last quarter of the uncertain positions divided by that over their first quarter "
         "(n/a with fewer than 5 uncertain positions)", "<", 1.0, ("simplex",)),
    Spec("steering", "m1", _M1, "steering: max(3 x steered / unsteered, steered / mode task) of the mean KL(model || q_a) over target "
         "points (E2: RMSE to y_a, factor 2); <= 1: steered at most a third (E2: half) of unsteered and below the mode task's", "<=", 1.0,
         ("steering",)),
    Spec("projection_r2_high_diversity", "dual_modes", _DUAL, "projection R^2 of OOD task means onto the major task means (Fig. 4)",
         "<", 0.2, ("projection",)),
    Spec("projection_r2_drop", "dual_modes", _DUAL, "projection R^2 at k = -1 minus at the highest k", ">=", 0.4, ("projection",)),
    Spec("ablate_S_major", "dual_modes", _DUAL, _SHARE.format(target="major", what="the task subspace S"), ">=", 50.0, ("dissociation",)),
    Spec("ablate_S_ood", "dual_modes", _DUAL, _SHARE.format(target="OOD", what="the task subspace S"), "<", 20.0, ("dissociation",)),
    Spec("ablate_V_ood", "dual_modes", _DUAL, _SHARE.format(target="OOD", what="the orthogonal directions V"), ">=", 50.0,
         ("dissociation", "rank")),
    Spec("ablate_V_major", "dual_modes", _DUAL, _SHARE.format(target="major", what="the orthogonal directions V"), "<", 20.0,
         ("dissociation",)),
    Spec("random_control", "dual_modes", _DUAL, "largest over major and OOD of the block mean of the 75th percentile of |% gain removed| "
         "by random same-rank directions", "<", 10.0, ("dissociation",)),
    Spec("transition_memorising", "dual_modes", "E1, E3 (k = -1)", "log(KL_mem / KL_gen) of the final model (negative: memorising)",
         "<", 0.0, ("transition",)),
    Spec("transition_generalising", "dual_modes", "E1, E3 (the highest k)", "log(KL_mem / KL_gen) of the final model "
         "(positive: generalising)", ">", 0.0, ("transition",)),
    Spec("bayes_optimal", "e2", "E2 (k = -1)", "model MSE / dMMSE MSE - 1 on held-out major-task prompts, last half of the examples",
         "<=", 0.10, ("mse_by_example",)),
    Spec("ood_between", "e2", "E2 (k = -1)", "|g - 1/2|, g = (MSE_dMMSE - MSE_model) / (MSE_dMMSE - MSE_ridge) on OOD prompts: the "
         "model's error between dMMSE's and ridge's", "<=", 0.5, ("mse_by_example",)),
    Spec("ood_near_dmmse", "e2", "E2 (k = -1)", "g (above): closer to dMMSE than to ridge at low diversity", "<=", 0.5,
         ("mse_by_example",)),
    Spec("P0_failure", "e4", "E4 (k = -1)", "E4's within-cell share at its M1 block divided by the larger of E1's and E3's", ">=", 3.0,
         ("p0_across_families",)),
    Spec("prefix_probe", "e4", "E4 (k = 8)", "smallest over targets of a prefix probe's score minus its shuffled-label control", ">=", 0.10,
         ("prefix_probes",)),
)


def spec(experiment: str, name: str) -> Spec:
    """The claim ``name`` that ``experiment`` measures (``spec("m1", "P0")``)."""
    for claim in CLAIMS:
        if (claim.experiment, claim.name) == (experiment, name):
            return claim
    raise KeyError(f"no claim {name!r} of experiment {experiment!r} in the catalog")


def evidence(experiment: str) -> dict[str, tuple[str, ...]]:
    """{figure kind: the names of the claims it shows} for ``experiment``'s claims, in the catalog's order."""
    shown: dict[str, tuple[str, ...]] = {}
    for claim in CLAIMS:
        if claim.experiment == experiment:
            for figure in claim.figures:
                shown[figure] = (*shown.get(figure, ()), claim.name)
    return shown


def thresholds_table() -> str:
    """The Markdown table of docs/protocol.md#thresholds: one row per claim of the catalog."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| claim | experiment | measured on | quantity | passes when | figures |", "|---|---|---|---|---|---|"]
    lines += [f"| `{c.name}` | {c.experiment} | {c.recipes} | {cell(c.quantity)} | {c.comparison} {c.threshold:g} | {', '.join(c.figures)} |"
              for c in CLAIMS]
    return "\n".join(lines)

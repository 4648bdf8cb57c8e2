"""The claims of the dual modes across task diversity (docs/concepts.md#m2-the-nearly-orthogonal-subspace),
for the recipes that declare ``dual_modes`` (E1 and E3; E2 at paper): each claim's spec, how its
value is read from one seed's sweep rows (the runs' ``analysis/dual.json`` rows at every k) and its
judgement (``claims``; ``ablation_claims``, which ``taskgeom sensitivity``
reads too). Projection R^2 claims read the study's Fig. 4 statistic, with its place, task counts,
interquartile range, linear-code reference and the ``per-sequence-r2`` variant in their parts
(``projection_parts``); every share of in-context gain carries its parts (clean, ablated and
first losses, the gain in nats, and ``unreliable`` when the gain is below ``MIN_RELIABLE_GAIN``),
and a claim on a share of a gain that is not positive is ``n/a`` with that reason. The claims that
read OOD states (``OOD_CLAIMS``) carry their run's OOD mode as a precondition (``ood_mode``: its OOD
in-context gain against the Bayes OOD predictor's), and the projection claims their standard error
over OOD tasks and whether the threshold lies within two of them (``within_2se``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd

from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN
from taskgeom.analysis.protocol import active
from taskgeom.analysis.stored.rows import by_step
from taskgeom.claims.rules import Claim, Spec, gain_parts

_RECIPES = "E1, E3 (the highest k of the grid)"
_SHARE = "% of the {target} in-context gain removed by ablating {what}, mean over blocks, at the highest k of the grid"
SPECS: tuple[Spec, ...] = (
    Spec(
        "projection_r2_high_diversity",
        "dual_modes",
        _RECIPES,
        "projection R^2 of OOD task means onto the major task means (the study's Fig. 4) at the highest k of the grid",
        "<",
        0.2,
        ("projection",),
    ),
    Spec(
        "projection_r2_drop",
        "dual_modes",
        _RECIPES,
        "projection R^2 of OOD task means onto the major task means (the study's Fig. 4): the share of its value at "
        "k = -1 lost at the highest k of the grid, (r2(k=-1) - r2(k_top)) / r2(k=-1) (n/a when r2(k=-1) is within 2 se "
        "of 0)",
        ">=",
        0.4,
        ("projection",),
    ),
    Spec(
        "ablate_S_major",
        "dual_modes",
        _RECIPES,
        _SHARE.format(target="major", what="the task subspace S"),
        ">=",
        50.0,
        ("dissociation",),
    ),
    Spec(
        "ablate_S_ood",
        "dual_modes",
        _RECIPES,
        _SHARE.format(target="OOD", what="the task subspace S"),
        "<",
        20.0,
        ("dissociation",),
    ),
    Spec(
        "ablate_V_ood",
        "dual_modes",
        _RECIPES,
        _SHARE.format(target="OOD", what="the orthogonal directions V"),
        ">=",
        50.0,
        ("dissociation", "rank"),
    ),
    Spec(
        "ablate_V_major",
        "dual_modes",
        _RECIPES,
        _SHARE.format(target="major", what="the orthogonal directions V"),
        "<",
        20.0,
        ("dissociation",),
    ),
    Spec(
        "random_control",
        "dual_modes",
        _RECIPES,
        "largest over blocks of the 75th percentile of the % of OOD in-context gain removed by the protocol's random "
        "same-rank directions (5 at the study's sizes; the study's random band), at the highest k of the grid",
        "<",
        10.0,
        ("dissociation",),
    ),
    Spec(
        "transition_memorising",
        "dual_modes",
        "E1, E3 (k = -1)",
        "log(KL_mem / KL_gen) of the final model at k = -1 (negative: memorising)",
        "<",
        0.0,
        ("transition",),
    ),
    Spec(
        "transition_generalising",
        "dual_modes",
        "E1, E3 (the highest k)",
        "log(KL_mem / KL_gen) of the final model at the highest k of the grid (positive: generalising)",
        ">",
        0.0,
        ("transition",),
    ),
)
_SPEC = {spec.name: spec for spec in SPECS}
# A run has an OOD mode when its OOD in-context gain is at least this share of the Bayes OOD-optimal
# predictor's on the same sequences [ours]: the precondition of the claims that read OOD states
OOD_MODE_SHARE = 0.5
OOD_CLAIMS = ("projection_r2_high_diversity", "projection_r2_drop", "ablate_S_ood", "ablate_V_ood", "random_control")


def _pick(
    rows: pd.DataFrame, metric: str, diversity: int, set_name: str | None = None, summary: bool | None = None
) -> pd.DataFrame:
    """Final-model rows of ``metric`` at ``diversity`` among ``rows`` (one seed's), of ``set_name``
    when given; ``summary``: only the ablations' summary rows over blocks (``layer`` null, True) or
    only per-block rows (False)."""
    pick = rows[(rows["metric"] == metric) & (rows["diversity"] == diversity) & rows["step"].isna()]
    if set_name is not None:
        pick = pick[pick["set"] == set_name]
    if summary is not None:
        pick = pick[pick["layer"].isna() == summary]
    return pick


def _value(
    rows: pd.DataFrame, metric: str, diversity: int, set_name: str | None = None, summary: bool | None = None
) -> float:
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


def ood_mode(rows: pd.DataFrame, recipe: str, diversity: int) -> dict | None:
    """The OOD-mode precondition of a claim read on the run at ``diversity`` (one seed's rows): the
    run's OOD in-context gain ``L_0 - L`` on the ``loss`` split's OOD sequences, the Bayes OOD-optimal
    predictor's on the same sequences, and their ratio (``value``; status ``pass`` at
    ``OOD_MODE_SHARE`` or more); None when the rows hold no Bayes OOD losses."""
    gain = _value(rows, "loss_first", diversity, "ood") - _value(rows, "loss", diversity, "ood")
    bayes = _value(rows, "bayes_ood_loss_first", diversity, "ood") - _value(rows, "bayes_ood_loss", diversity, "ood")
    if math.isnan(bayes) or bayes <= 0:
        return None
    ratio = gain / bayes
    return {
        "claim": f"{recipe}.ood_mode",
        "value": ratio,
        "status": "pass" if ratio >= OOD_MODE_SHARE else "fail",
        "ood_gain": gain,
        "bayes_ood_gain": bayes,
        "diversity": diversity,
    }


def with_ood_mode(claims: list[Claim], rows: pd.DataFrame, recipe: str, diversity: int) -> list[Claim]:
    """``claims`` with each of ``OOD_CLAIMS`` given the OOD-mode precondition of the run at
    ``diversity`` (``ood_mode``), where the rows hold it. The verdict rule does not read it."""
    precondition = ood_mode(rows, recipe, diversity)
    if precondition is None:
        return claims
    return [replace(c, precondition=precondition) if c.id.partition(".")[2] in OOD_CLAIMS else c for c in claims]


def _near(value: float, threshold: float, se: float) -> bool:
    """Whether ``threshold`` lies within two standard errors ``se`` of ``value``."""
    return bool(abs(value - threshold) <= 2 * se)


def projection_parts(rows: pd.DataFrame, diversity: int) -> dict:
    """The parts of projection R^2 at ``diversity`` in ``rows`` (one seed's): its value and standard
    error over OOD tasks, the place it was read (block and site), the OOD task count and sequences
    per task, the interquartile range over OOD tasks, the study's 128-task draw, the linear-code
    reference (or why there is none) and the ``per-sequence-r2`` variant's value."""

    def final(metric: str) -> pd.DataFrame:
        return rows[
            (rows["metric"] == metric) & (rows["diversity"] == diversity) & rows["step"].isna() & (rows["set"] == "ood")
        ]

    def band(row: pd.Series) -> tuple[float, float]:
        return tuple(row["band"]) if isinstance(row["band"], (list, tuple)) else (float("nan"),) * 2

    pick = final("projection_r2")
    if pick.empty:
        return {}
    measured = pick.iloc[0]
    low, high = band(measured)
    parts = {
        "value": measured["value"],
        "se": _value(rows, "projection_r2_se", diversity, "ood"),
        "block": int(measured["layer"]),
        "site": measured["site"],
        "ood_tasks": int(_value(rows, "projection_r2_tasks", diversity, "ood")),
        "sequences_per_task": int(_value(rows, "projection_r2_per_task", diversity, "ood")),
        "iqr_low": low,
        "iqr_high": high,
        "study_draw": _value(rows, "projection_r2_study_draw", diversity, "ood"),
        "per_sequence_r2": _value(rows, "projection_r2_per_sequence", diversity, "ood"),
    }
    reason = _reason(rows, "projection_r2_reference", diversity, "ood")
    if reason or final("projection_r2_reference").empty:
        return {**parts, "reference_unavailable": reason or "not measured"}
    reference = final("projection_r2_reference").iloc[0]
    ref_low, ref_high = band(reference)
    return {**parts, "reference": reference["value"], "reference_iqr_low": ref_low, "reference_iqr_high": ref_high}


def projection_drop(r2_low: float, r2_high: float, se_low: float, se_high: float) -> tuple[float, float, str | None]:
    """(value, its standard error, why it does not apply or None) of ``projection_r2_drop`` from projection
    R^2 at k = -1 (``r2_low``) and at the highest k, with their standard errors, in the active protocol's
    ``drop_form``: "absolute", r2_low - r2_high; "share", (r2_low - r2_high) / r2_low, the share of the
    start that is lost (the threshold's range whatever the start; n/a when the start is within two standard
    errors of 0; at most 1, negative where R^2 rises), its error to first order. Both ends read the same OOD
    tasks, so the errors are added in quadrature as an upper bound."""
    if active().drop_form == "absolute":
        return r2_low - r2_high, math.hypot(se_low, se_high), None
    if not r2_low > 2 * se_low:
        return math.nan, math.nan, f"no start to lose: R^2 at k = -1 ({r2_low:.3g}) is within 2 se ({se_low:.3g}) of 0"
    return 1 - r2_high / r2_low, math.hypot(se_high / r2_low, r2_high * se_low / r2_low**2), None


def _drop_spec() -> Spec:
    """``projection_r2_drop``'s spec in the active protocol's ``drop_form`` (its description says the form)."""
    if active().drop_form == "share":
        return _SPEC["projection_r2_drop"]
    return replace(
        _SPEC["projection_r2_drop"],
        description="projection R^2 of OOD task means onto the major task means (the study's Fig. 4) at k = -1 minus "
        "at the highest k of the grid",
    )


def claims(rows: pd.DataFrame, recipe: str, low: int, high: int) -> list[Claim]:
    """The dual-mode claims of ``recipe`` from the sweep rows of one seed (its runs at every k)."""
    made = []

    def claim(name, value, parts):
        made.append(_SPEC[name].judge(recipe, value, parts))

    r2_high, r2_low = _value(rows, "projection_r2", high, "ood"), _value(rows, "projection_r2", low, "ood")
    se_high, se_low = _value(rows, "projection_r2_se", high, "ood"), _value(rows, "projection_r2_se", low, "ood")
    claim(
        "projection_r2_high_diversity",
        r2_high,
        {
            "diversity": high,
            **projection_parts(rows, high),
            "within_2se": _near(r2_high, _SPEC["projection_r2_high_diversity"].threshold, se_high),
        },
    )
    value, se_drop, reason = projection_drop(r2_low, r2_high, se_low, se_high)
    made.append(
        _drop_spec().judge(
            recipe,
            value,
            {
                **{f"k={low}.{name}": v for name, v in projection_parts(rows, low).items()},
                **{f"k={high}.{name}": v for name, v in projection_parts(rows, high).items()},
                **({} if active().drop_form == "absolute" else {"drop": r2_low - r2_high}),
                "se": se_drop,
                "within_2se": _near(value, _drop_spec().threshold, se_drop),
            },
            reason,
        )
    )
    made += ablation_claims(rows, recipe, high)
    if len(rows) and rows["metric"].str.startswith("transition_").any():  # token families only
        final = by_step(rows).sort_values("step").groupby("diversity").last()
        for name, k in (("transition_memorising", low), ("transition_generalising", high)):
            parts = (
                {
                    "diversity": k,
                    "kl_to_memorising": final.loc[k, "kl_to_memorising"],
                    "kl_to_generalising": final.loc[k, "kl_to_generalising"],
                }
                if k in final.index
                else None
            )
            claim(name, final["log_ratio"].get(k, float("nan")), parts)
    return with_ood_mode(made, rows, recipe, high)


def ablation_claims(rows: pd.DataFrame, recipe: str, high: int) -> list[Claim]:
    """The double dissociation's claims of ``recipe`` (one seed's rows): the share of the major and
    OOD gain that ablating S and V removes, and the random control, each read from the summary
    over blocks (``analysis.stored.ablations``: the block mean) at k = ``high``, with its parts: the
    summary's losses and gain, each block's share and their mean."""
    made = []
    for ablation, target, spared in (("ablate_S", "major", "ood"), ("ablate_V", "ood", "major")):
        for set_name in (target, spared):
            metric = f"gain_removed_{ablation}"
            value = _value(rows, metric, high, set_name, summary=True)
            parts = {
                "diversity": high,
                **gain_parts(
                    _value(rows, "loss", high, set_name),
                    _value(rows, f"loss_{ablation}", high, set_name, summary=True),
                    _value(rows, "loss_first", high, set_name),
                ),
                **_per_block(rows, metric, high, set_name),
                "block_mean": value,
            }
            made.append(
                _SPEC[f"{ablation}_{set_name}"].judge(recipe, value, parts, _reason(rows, metric, high, set_name))
            )
    value = _value(rows, "gain_removed_random", high, "ood", summary=True)
    parts = {
        "diversity": high,
        "ood_block_max": value,
        **_per_block(rows, "gain_removed_random", high, "ood", "ood_"),
        "major_block_max": _value(rows, "gain_removed_random", high, "major", summary=True),
    }
    made.append(
        _SPEC["random_control"].judge(
            recipe,
            value,
            parts,
            _reason(rows, "gain_removed_random", high, "ood"),
        )
    )
    return made

"""Interactive figures and sortable tables of the report, built from the long table
(``tables.analysis_table``) alone: Plotly figures with values on hover and one legend entry per
family, layer, site or set (a click hides or shows it).

Each piece is an ``Evidence``: an anchor, a title, the report section it belongs to, the ids of
the claims it supports, and either a Plotly figure (as JSON) or a table (a DataFrame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from taskgeom.claims import dual_modes, m1
from taskgeom.claims.catalog import evidence
from taskgeom.claims.registry import experiments
from taskgeom.report.manifest import DUAL_EXPERIMENT

# The claims each kind of figure is evidence for, as names after the recipe (``e1.`` + ``P0``)
M1_EVIDENCE, DUAL_EVIDENCE = evidence(m1.SPECS), evidence(dual_modes.SPECS)

COLORS = qualitative.Plotly  # '#rrggbb' strings
_LAYOUT = {"template": "plotly_white", "height": 380, "margin": {"l": 60, "r": 20, "t": 50, "b": 50}}
M1_LAYER_METRICS = {
    "p0.cell_r2": "P0 cell-means R^2",
    "p1.additive_share": "P1 additive share",
    "p2.r2_additive": "P2 r2_additive",
    "p2.r2_additive_random": "P2 random subspace",
}
DUAL_MEASURES = {
    "projection_r2@ood": "projection R^2 (Fig. 4)",
    "projection_r2_reference@ood": "projection R^2, linear-code ref.",
    "projection_r2_per_sequence@ood": "projection R^2 (per-sequence-r2)",
    "gain_removed_ablate_S@major": "% major gain, ablate S",
    "gain_removed_ablate_S@ood": "% OOD gain, ablate S",
    "gain_removed_ablate_V@major": "% major gain, ablate V",
    "gain_removed_ablate_V@ood": "% OOD gain, ablate V",
    "gain_removed_random@major": "% major gain, random",
    "gain_removed_random@ood": "% OOD gain, random",
    "loss@ood": "OOD loss",
    "loss_first@ood": "OOD loss at t = 1",
    "d0@": "d0",
}


@dataclass
class Evidence:
    """One figure or table of a section; ``figure`` is a Plotly figure as JSON, ``table`` a frame."""

    anchor: str
    title: str
    section: str
    claims: tuple[str, ...]
    figure: Optional[str] = None  # Plotly JSON
    table: Optional[pd.DataFrame] = None


def _rgba(color: str, alpha: float) -> str:
    """'#rrggbb' as 'rgba(r,g,b,alpha)'."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def lines(
    rows: pd.DataFrame,
    x: str,
    name: Callable[[tuple], str],
    by: list[str],
    title: str,
    xaxis: str,
    yaxis: str,
    dash: Callable[[tuple], str] = lambda key: "solid",
) -> str:
    """A line per group of ``rows`` (grouped by ``by``; ``name(key)`` its legend entry) of value
    against column ``x``: the median over the rows at each x (the seeds), with their range drawn as
    a band of the same colour where there is more than one."""
    fig = go.Figure()
    for index, (key, group) in enumerate(rows.groupby(by, sort=True, dropna=False)):
        key = key if isinstance(key, tuple) else (key,)
        stats = group.groupby(x)["value"].agg(["median", "min", "max", "count"]).sort_index()
        color, label, xs = COLORS[index % len(COLORS)], name(key), stats.index.tolist()
        if (stats["count"] > 1).any():
            fig.add_trace(
                go.Scatter(
                    x=xs + xs[::-1],
                    y=stats["max"].tolist() + stats["min"].tolist()[::-1],
                    fill="toself",
                    fillcolor=_rgba(color, 0.18),
                    line={"width": 0},
                    hoverinfo="skip",
                    legendgroup=label,
                    showlegend=False,
                    name=f"{label} (range over seeds)",
                )
            )
        n = int(stats["count"].max())
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=stats["median"].tolist(),
                mode="lines+markers",
                name=label,
                legendgroup=label,
                line={"dash": dash(key), "color": color},
                customdata=stats[["min", "max"]].values.tolist(),
                hovertemplate=f"{label}<br>{xaxis} %{{x}}<br>{yaxis} %{{y:.4g}}"
                + (f" (median of {n}; range %{{customdata[0]:.4g}} .. %{{customdata[1]:.4g}})" if n > 1 else "")
                + "<extra></extra>",
            )
        )
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, legend={"font": {"size": 11}}, **_LAYOUT)
    if x in ("layer", "rank"):  # whole numbers only
        fig.update_xaxes(dtick=1)
    return fig.to_json()


def _bars(rows: pd.DataFrame, x: str, by: str, title: str, yaxis: str) -> str:
    """Grouped bars of value against column ``x``, one colour per value of column ``by``."""
    fig = go.Figure()
    for key, group in rows.groupby(by, sort=True):
        fig.add_trace(
            go.Bar(
                x=group[x].tolist(),
                y=group["value"].tolist(),
                name=str(key),
                hovertemplate=f"{key}<br>%{{x}}: %{{y:.4g}}<extra></extra>",
            )
        )
    fig.update_layout(title=title, yaxis_title=yaxis, barmode="group", **_LAYOUT)
    return fig.to_json()


def _m1(table: pd.DataFrame, family: str, loss_claims: tuple[str, ...]) -> list[Evidence]:
    """The M1 figures and table of ``family``'s k = -1 run (from its m1.json rows), and its losses
    (evidence for ``loss_claims``)."""
    rows = table[(table["analysis"] == "m1") & (table["recipe"] == family) & (table["diversity"] == -1)]
    if rows.empty:
        return []
    measure = rows[rows["batch"] == "measure"]
    places = measure[measure["metric"].isin(list(M1_LAYER_METRICS)) & measure["position"].isna()]
    per_position = measure[(measure["metric"] == "p2.r2_additive") & measure["position"].notna()]
    p3 = measure[
        measure["metric"].isin(["p3.tv_mean_beta", "p3.tv", "p3.kl"])
        & measure["position"].notna()
        & measure["task"].isna()
    ]  # over all tasks
    steering = measure[measure["metric"].str.fullmatch(r"steering\.(kl|rmse)_(unsteered|steered|mode|random)")]
    claim = lambda *names: tuple(f"{family}.{n}" for n in names)  # noqa: E731
    label = lambda key: f"{M1_LAYER_METRICS[key[0]]}, {key[1]}"  # noqa: E731
    evidence = [
        Evidence(
            f"{family}-layers",
            f"{family.upper()}: P0-P2 per layer and site (measurement batch)",
            family,
            claim(*M1_EVIDENCE["layers"]),
            figure=lines(
                places,
                "layer",
                label,
                ["metric", "site"],
                f"{family.upper()}: P0-P2 per layer",
                "layer",
                "value",
                dash=lambda key: "dot" if key[1] == "resid_post" else "solid",
            ),
        ),
        Evidence(
            f"{family}-positions",
            f"{family.upper()}: r2_additive of P2 per position, every layer and site",
            family,
            claim(*M1_EVIDENCE["positions"]),
            figure=lines(
                per_position,
                "position",
                lambda key: f"layer {int(key[0])} {key[1]}",
                ["layer", "site"],
                f"{family.upper()}: r2_additive per position",
                "position",
                "r2_additive",
            ),
        ),
        Evidence(
            f"{family}-p3",
            f"{family.upper()}: TV between the per-task mean beta_t and mean posterior alpha_t (what P3 reads), and the median per-state TV and KL per position",
            family,
            claim(*M1_EVIDENCE["simplex"]),
            figure=lines(
                p3,
                "position",
                lambda key: key[0],
                ["metric"],
                f"{family.upper()}: P3 per position",
                "position",
                "divergence",
            ),
        ),
        Evidence(
            f"{family}-steering",
            f"{family.upper()}: steering, distance to the target mixture",
            family,
            claim(*M1_EVIDENCE["steering"]),
            figure=_bars(
                steering.assign(
                    kind=steering["metric"].str.split("_").str[-1], run_seed="seed " + steering["seed"].astype(str)
                ),
                "kind",
                "run_seed",
                f"{family.upper()}: unsteered, steered, mode task, random direction",
                "mean readout",
            ),
        ),
        Evidence(
            f"{family}-layer-table",
            f"{family.upper()}: P0-P2 per layer and site, selection and measurement batches",
            family,
            claim(*M1_EVIDENCE["layers"]),
            table=rows[
                rows["metric"].isin(list(M1_LAYER_METRICS) + ["p0.within_share", "p2.r2_task_exact"])
                & rows["position"].isna()
            ]
            .pivot_table(index=["seed", "batch", "layer", "site"], columns="metric", values="value")
            .reset_index(),
        ),
    ]
    return evidence + _loss(table, family, loss_claims)


def _loss(table: pd.DataFrame, family: str, claims: tuple[str, ...]) -> list[Evidence]:
    """The per-position losses of ``family``'s k = -1 run against the Bayes predictors (eval.json),
    evidence for ``claims``."""
    rows = table[(table["analysis"] == "eval") & (table["recipe"] == family) & (table["diversity"] == -1)]
    rows = rows[rows["metric"].isin(["loss", "bayes_id_loss", "bayes_ood_loss"])]
    if rows.empty:
        return []
    return [
        Evidence(
            f"{family}-loss",
            f"{family.upper()}: per-position loss of the model and the Bayes predictors",
            family,
            claims,
            figure=lines(
                rows,
                "position",
                lambda key: f"{key[0]}: {key[1]}",
                ["set", "metric"],
                f"{family.upper()}: loss by position (k = -1)",
                "position",
                "loss",
                dash=lambda key: {"loss": "solid", "bayes_id_loss": "dash"}.get(key[1], "dot"),
            ),
        )
    ]


def _dual(table: pd.DataFrame) -> list[Evidence]:
    """The dual-mode figures and tables over the sweep's runs (dual.json rows), one line per recipe,
    seed and diversity or form."""
    rows = table[table["analysis"] == "dual"]
    if rows.empty:
        return []
    final = rows[rows["step"].isna()]
    recipes = sorted(rows["recipe"].unique())
    claim = lambda *names: tuple(f"{r}.{n}" for r in recipes for n in names)  # noqa: E731
    projection = final[final["metric"].isin(["projection_r2", "projection_r2_reference"]) & (final["set"] == "ood")]
    high = final.groupby("recipe")["diversity"].transform("max")
    summary = final["layer"].isna()  # the ablations' mean over blocks, which the claims read
    ablations = final[
        (final["diversity"] == high)
        & final["metric"].isin(["gain_removed_ablate_S", "gain_removed_ablate_V", "gain_removed_random"])
        & final["set"].isin(["major", "ood"])
        & summary
    ]
    ablations = ablations.assign(
        what=ablations["recipe"]
        + " seed "
        + ablations["seed"].astype(str)
        + " "
        + ablations["metric"].str.replace("gain_removed_", ""),
        where=ablations["set"],
    )
    rank = final[final["metric"].str.startswith("gain_removed_ablate_V_rank") & summary]
    rank = rank.assign(rank=rank["metric"].str.replace("gain_removed_ablate_V_rank", "").astype(int))
    steps = rows[rows["step"].notna() & rows["metric"].isin(["projection_r2", "transition_log_ratio"])]
    key = final["metric"] + "@" + final["set"].fillna("")
    measures = (
        final.assign(measure=key)[key.isin(list(DUAL_MEASURES))]
        .pivot_table(index=["recipe", "diversity", "seed"], columns="measure", values="value")
        .reset_index()
        .rename(columns=DUAL_MEASURES)
    )
    places = (
        final[final["metric"].str.startswith("table.")]
        .pivot_table(index=["recipe", "diversity", "seed", "layer", "site"], columns="metric", values="value")
        .reset_index()
    )
    return [
        Evidence(
            "dual-projection",
            "Projection R^2 of OOD states onto the task subspace across diversity",
            "dual",
            claim(*DUAL_EVIDENCE["projection"]),
            figure=lines(
                projection,
                "diversity",
                lambda k: f"{k[0]} {k[1].replace('projection_r2', 'R^2')}",
                ["recipe", "metric"],
                "Projection R^2 (OOD) against diversity k (median; band: range over seeds)",
                "diversity k",
                "projection R^2",
                dash=lambda k: "dash" if k[1].endswith("reference") else "solid",
            ),
        ),
        Evidence(
            "dual-ablations",
            "Double dissociation: % of in-context gain removed at the highest diversity",
            "dual",
            claim(*DUAL_EVIDENCE["dissociation"]),
            figure=_bars(
                ablations, "where", "what", "% of in-context gain removed (highest diversity)", "% gain removed"
            ),
        ),
        Evidence(
            "dual-rank",
            "% of OOD gain removed by V of rank r",
            "dual",
            claim(*DUAL_EVIDENCE["rank"]),
            figure=lines(
                rank,
                "rank",
                lambda k: f"{k[0]} k = {k[1]}",
                ["recipe", "diversity"],
                "OOD gain removed by V of rank r (median; band: range over seeds)",
                "rank r",
                "% OOD gain removed",
            ),
        ),
        Evidence(
            "dual-steps",
            "Projection R^2 and the predictor transition across training",
            "dual",
            claim(*DUAL_EVIDENCE["transition"]),
            figure=lines(
                steps,
                "step",
                lambda k: f"{k[0]} k = {k[1]}: {k[2]}",
                ["recipe", "diversity", "metric"],
                "Across training: projection R^2 (solid) and log(KL_mem / KL_gen) (dashed); band: range over seeds",
                "step",
                "value",
                dash=lambda k: "dash" if k[2] == "transition_log_ratio" else "solid",
            ),
        ),
        Evidence(
            "dual-table",
            "Dual-mode measures per run (final model)",
            "dual",
            claim(*DUAL_EVIDENCE["projection"], *DUAL_EVIDENCE["dissociation"]),
            table=measures,
        ),
        Evidence(
            "dual-place-table",
            "Projection R^2 (OOD) at every layer and site",
            "dual",
            claim(DUAL_EVIDENCE["projection"][0]),
            table=places,
        ),
    ]


def evidence(table: pd.DataFrame, manifest: dict) -> list[Evidence]:
    """Every interactive figure and sortable table the long table supports, in section order: M1's
    per recipe, then those of the other registered experiments the reproduction ran (their
    ``Experiment.evidence``), then the dual modes'."""
    recipes = [
        recipe for recipe in manifest["sections"] if ((table["analysis"] == "m1") & (table["recipe"] == recipe)).any()
    ]
    own = {
        recipe: tuple(
            claim
            for claim, experiment in manifest["claims"].items()
            if claim.startswith(f"{recipe}.") and experiment not in ("m1", DUAL_EXPERIMENT)
        )
        for recipe in recipes
    }
    pieces = [piece for recipe in recipes for piece in _m1(table, recipe, own[recipe])]
    known = experiments()
    own_pieces = [
        piece
        for name in manifest["experiments"]
        if name not in ("m1", DUAL_EXPERIMENT) and name in known and known[name].evidence is not None
        for piece in known[name].evidence(table)
    ]
    return pieces + own_pieces + _dual(table)

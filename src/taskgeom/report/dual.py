"""Figures of the dual modes (docs/concepts.md#m2-the-nearly-orthogonal-subspace), from the sweep's tables."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from taskgeom.report.figures import save  # noqa: E402


def _any_unreliable(flags: pd.Series) -> bool:
    """Whether any of these rows' shares is unreliable (a row without the flag counts as one)."""
    return bool(flags.fillna(True).astype(bool).any())


def _per_k(rows: pd.DataFrame, metric: str, set_name: str | None = "ood") -> pd.DataFrame:
    """Mean value and band over seeds per diversity k for one metric."""
    pick = rows[(rows["metric"] == metric) & (rows["step"].isna())]
    if set_name is not None:
        pick = pick[pick["set"] == set_name]
    band = pick["band"].map(lambda b: b if isinstance(b, (list, tuple)) else [np.nan, np.nan])
    pick = pick.assign(low=band.map(lambda b: b[0]), high=band.map(lambda b: b[1]))
    return pick.groupby("diversity")[["value", "low", "high"]].mean().reset_index()


def _finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    """Label, grid and legend one axis, then save the figure to ``path`` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=legend_size)
    ax.set_title(title)
    fig.tight_layout()
    save(fig, path)


def plot_projection_r2(rows: pd.DataFrame, path: Path) -> None:
    """Projection R^2 (the study's Fig. 4 statistic) of the final models against diversity k, one
    colour per recipe: the mean over seeds (solid, band: the interquartile range over OOD tasks,
    averaged over seeds), the linear-code reference (dashed) and the ``per-sequence-r2`` variant (dotted)."""
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for i, (recipe, group) in enumerate(rows.groupby("recipe")):
        for metric, style, what in (
            ("projection_r2", "o-", "Fig. 4 (claims)"),
            ("projection_r2_reference", "s--", "linear-code reference"),
            ("projection_r2_per_sequence", ":", "per-sequence-r2 variant"),
        ):
            table = _per_k(group, metric)
            ax.plot(table["diversity"], table["value"], style, color=f"C{i}", label=f"{recipe.upper()} {what}")
            if metric == "projection_r2":
                ax.fill_between(table["diversity"], table["low"], table["high"], color=f"C{i}", alpha=0.2)
    ax.set_ylim(0, 1)
    _finish(
        fig,
        ax,
        path,
        "task diversity k (2^k minor tasks; -1: majors only)",
        "projection R$^2$ of OOD task means",
        "OOD states leave the task subspace as diversity grows",
    )


SHARE_FIELDS = ["gain", "unreliable", "reason"]  # what a share of in-context gain carries (``shares.Share``)


def rank_curve(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (recipe, diversity, seed, block, rank r): the % of OOD gain removed by V of rank
    r at that block (``layer`` empty: the mean over blocks), with the gain it divides by (empty,
    with the reason, where the gain is not positive; ``unreliable`` below ``MIN_RELIABLE_GAIN``)."""
    pick = rows[rows["metric"].str.startswith("gain_removed_ablate_V_rank") & rows["step"].isna()]
    rank = pick["metric"].str.removeprefix("gain_removed_ablate_V_rank").astype(int)
    pick = pick.assign(rank=rank, **{field: pick[field] if field in pick else None for field in SHARE_FIELDS})
    return (
        pick[["recipe", "diversity", "seed", "layer", "site", "rank", "value", *SHARE_FIELDS]]
        .sort_values(["recipe", "diversity", "seed", "rank"])
        .reset_index(drop=True)
    )


def plot_rank_curve(curve: pd.DataFrame, path: Path) -> None:
    """% of OOD in-context gain removed by ablating V of rank r = 1..ceil(d0), mean over blocks, one
    line per recipe and diversity (the mean over the seeds whose gain is positive); open markers
    where some seed's gain is unreliable (below ``MIN_RELIABLE_GAIN``); a line is missing where no
    seed has a gain."""
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for i, ((recipe, k), group) in enumerate(curve[curve["layer"].isna()].groupby(["recipe", "diversity"])):
        by_rank = group.groupby("rank")
        mean, unreliable = by_rank["value"].mean(), by_rank["unreliable"].agg(_any_unreliable)
        ax.plot(mean.index, mean.values, "-", color=f"C{i}", label=f"{recipe.upper()} k = {k}")
        for flag, face in ((False, f"C{i}"), (True, "white")):
            ax.plot(
                mean.index[unreliable == flag],
                mean.values[unreliable == flag],
                "o",
                color=f"C{i}",
                markerfacecolor=face,
            )
    ax.axhline(50, color="0.5", ls=":", lw=1)
    _finish(
        fig,
        ax,
        path,
        "rank r of the ablated orthogonal subspace V",
        "% of OOD in-context gain removed,\nmean over blocks (open: gain unreliable)",
        "How many directions the OOD mode needs",
    )


DISSOCIATION = (
    ("gain_removed_ablate_S", "ablate task subspace S"),
    ("gain_removed_ablate_V", "ablate orthogonal V"),
    ("gain_removed_random", "random control (75th percentile of 5 draws)"),
)


def plot_dissociation(rows: pd.DataFrame, path: Path, title: str) -> None:
    """Share of in-context gain removed by each ablation (one panel each) at every block and as the
    mean over blocks (the control: the largest; what the claims read; the last group, outlined), one bar per sequence set
    (the mean over the seeds in ``rows``, one model's diversity); each set labelled with its gain;
    hatched where the gain is unreliable (below ``MIN_RELIABLE_GAIN``), marked "gain ≤ 0" where
    there is no gain to remove."""
    rows = rows[rows["step"].isna()] if "step" in rows else rows
    sets = [
        s for s in ("major", "minor", "ood") if ((rows["set"] == s) & (rows["metric"] == "gain_removed_ablate_S")).any()
    ]
    blocks = sorted(
        int(layer) for layer in rows.loc[rows["metric"] == "gain_removed_ablate_S", "layer"].dropna().unique()
    )
    groups = [*blocks, None]  # None: the summary over blocks (the mean; the control's largest)
    labels = [f"block {b}" for b in blocks]
    gain = {
        s: rows[(rows["metric"] == "loss_first") & (rows["set"] == s)]["value"].mean()
        - rows[(rows["metric"] == "loss") & (rows["set"] == s)]["value"].mean()
        for s in sets
    }
    fig, axes = plt.subplots(
        1, len(DISSOCIATION), figsize=(3.2 * len(DISSOCIATION) + 0.4 * len(groups), 3.6), sharey=True
    )
    width = 0.8 / max(len(sets), 1)
    for ax, (metric, label) in zip(axes, DISSOCIATION):
        for j, s in enumerate(sets):
            picked = [
                rows[
                    (rows["metric"] == metric)
                    & (rows["set"] == s)
                    & (rows["layer"].isna() if g is None else rows["layer"] == g)
                ]
                for g in groups
            ]
            values = np.array([pick["value"].astype(float).mean() for pick in picked])
            shaky = [_any_unreliable(pick["unreliable"]) if "unreliable" in pick else False for pick in picked]
            x = np.arange(len(groups)) + (j - (len(sets) - 1) / 2) * width
            bars = ax.bar(x, np.clip(values, -20, 150), width, color=f"C{j}")
            for bar, unreliable, group in zip(bars, shaky, groups):
                bar.set_hatch("//" if unreliable else "")
                if group is None:
                    bar.set_edgecolor("k")
            for xi, value in zip(x, values):
                if np.isnan(value):
                    ax.text(xi, 0, "gain ≤ 0", rotation=90, ha="center", va="bottom", fontsize=7)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(
            np.arange(len(groups)), [*labels, "max" if metric == "gain_removed_random" else "mean"], fontsize=8
        )
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("in-context gain removed (%)\n(clipped to [-20, 150])")
    handles = [Patch(color=f"C{j}", label=f"{s} sequences (gain {gain[s]:.3g})") for j, s in enumerate(sets)]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="//", label="gain unreliable"))
    fig.legend(handles=handles, frameon=False, fontsize=8, loc="lower center", ncol=len(handles))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save(fig, path)


def plot_transition(transition: pd.DataFrame, path: Path) -> None:
    """Heat map of log(KL_to_memorising / KL_to_generalising) over (k, training step), per recipe."""
    transition = transition[transition["log_ratio"].notna()] if "log_ratio" in transition else transition.iloc[0:0]
    recipes = sorted(transition["recipe"].unique())
    if not recipes:
        return
    fig, axes = plt.subplots(1, len(recipes), figsize=(4.8 * len(recipes), 3.6), squeeze=False)
    for ax, recipe in zip(axes[0], recipes):
        grid = transition[transition["recipe"] == recipe].pivot_table(
            index="diversity", columns="step", values="log_ratio"
        )
        limit = max(1e-3, float(np.nanmax(np.abs(grid.values))))
        image = ax.imshow(grid.values, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, origin="lower")
        ax.set_xticks(range(len(grid.columns)), [str(int(s)) for s in grid.columns], rotation=45, fontsize=7)
        ax.set_yticks(range(len(grid.index)), [str(int(k)) for k in grid.index])
        ax.set_xlabel("training step")
        ax.set_ylabel("diversity k")
        ax.set_title(f"{recipe.upper()}: red = closer to generalising")
        fig.colorbar(image, ax=ax, label="log(KL mem / KL gen)")
    fig.tight_layout()
    save(fig, path)


def plot_projection_r2_steps(rows: pd.DataFrame, path: Path) -> None:
    """The study's Fig. 4: projection R^2 against training step (log scale), one panel per recipe,
    one line per diversity k (the mean over seeds) with its interquartile band over OOD tasks
    (averaged over seeds), and the linear-code reference of each k as a dashed line; from the
    sweep's rows (``projection_r2`` with a ``step``, ``projection_r2_reference``)."""
    steps = rows[(rows["metric"] == "projection_r2") & rows["step"].notna()]
    recipes = sorted(steps["recipe"].unique())
    if not recipes:
        return
    fig, axes = plt.subplots(1, len(recipes), figsize=(4.6 * len(recipes), 3.4), squeeze=False, sharey=True)
    for ax, recipe in zip(axes[0], recipes):
        mine = rows[rows["recipe"] == recipe]
        for i, (k, group) in enumerate(steps[steps["recipe"] == recipe].groupby("diversity")):
            band = group["band"].map(lambda b: b if isinstance(b, (list, tuple)) else [np.nan, np.nan])
            by_step = (
                group.assign(low=band.map(lambda b: b[0]), high=band.map(lambda b: b[1]))
                .groupby("step")[["value", "low", "high"]]
                .mean()
            )
            ax.fill_between(by_step.index, by_step["low"], by_step["high"], color=f"C{i}", alpha=0.2, linewidth=0)
            ax.plot(by_step.index, by_step["value"], "o-", ms=3, color=f"C{i}", label=f"k = {k}")
            reference = _per_k(mine[mine["diversity"] == k], "projection_r2_reference")["value"]
            if len(reference) and np.isfinite(reference.iloc[0]):
                ax.axhline(reference.iloc[0], color=f"C{i}", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("training step")
        ax.set_title(f"{recipe.upper()} (dashed: linear-code reference)")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    axes[0, 0].set_ylabel("projection R$^2$ of OOD task means")
    axes[0, 0].set_ylim(0, 1)
    fig.tight_layout()
    save(fig, path)


def plot_theorem2(rows: pd.DataFrame, path: Path) -> None:
    """Distance of OOD states from mu_t + S beside the Lipschitz bound (c - delta) / L, against k."""
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for i, (recipe, group) in enumerate(rows.groupby("recipe")):
        for metric, style, label in (
            ("theorem2_distance", "o-", "distance from S"),
            ("theorem2_bound", "s--", "(c - delta) / L"),
        ):
            table = _per_k(group, metric)
            ax.plot(table["diversity"], table["value"], style, color=f"C{i}", label=f"{recipe.upper()}: {label}")
            ax.fill_between(table["diversity"], table["low"], table["high"], color=f"C{i}", alpha=0.15)
    _finish(
        fig,
        ax,
        path,
        "task diversity k",
        "last-layer distance (median, IQR)",
        "Theorem 2: measured distance and its lower bound",
        legend_size=7,
    )

"""Figures of the M1 geometry (matplotlib, Agg): beta against alpha in the simplex, P0-P2 per
layer, and steering's simplex heat map. Each function saves one PNG."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from taskgeom.analysis.reading.steering import KINDS, Steering  # noqa: E402
from taskgeom.report.figures import save  # noqa: E402

_CORNERS = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, math.sqrt(3) / 2]])  # the 2-simplex drawn flat


def plot_simplex_trajectories(
    alpha: torch.Tensor,
    beta: torch.Tensor,
    task: torch.Tensor,
    table: pd.DataFrame,
    path: Path,
    title: str = "",
    per_task: int = 2,
) -> None:
    """Left (K = 3 only): alpha_t (dashed) and beta_t (solid) over t for the ``per_task`` sequences of
    each task whose posterior is least certain (mean entropy over the first quarter), drawn in the
    2-simplex. Right: what P3 reads, the TV between the per-task mean beta_t and mean alpha_t
    (mean over the tasks), beside the per-position median per-state TV and KL(alpha || beta) with
    interquartile bands. alpha, beta: [N, T, K]; task: [N]; table: rows of ``analysis.stored.m1.analyze``
    at P3's place."""
    K = alpha.shape[-1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    ax = axes[0]
    if K == 3:
        ax.fill(*_CORNERS.T, color="0.95", edgecolor="0.4")
        for k in range(K):
            ax.annotate(
                f"task {k}",
                _CORNERS[k],
                textcoords="offset points",
                xytext=(0, -12 if k < 2 else 5),
                ha="center",
                fontsize=9,
            )
            for n in _most_uncertain(alpha, task == k, per_task):
                a, b = alpha[n].double().numpy() @ _CORNERS, beta[n].double().numpy() @ _CORNERS
                ax.plot(*a.T, "--", color=f"C{k}", lw=1, alpha=0.8)
                ax.plot(*b.T, "-", color=f"C{k}", lw=1.2, marker=".", ms=3)
                ax.plot(*b[0], "o", color=f"C{k}", mfc="white", ms=5)
        ax.plot([], [], "k--", lw=1, label="posterior alpha_t")
        ax.plot([], [], "k-", marker=".", label="fitted beta_t (open dot: t = 0)")
        ax.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2)
        ax.set_aspect("equal")
        ax.set_title("beta_t against alpha_t in the simplex")
    else:
        ax.text(0.5, 0.5, f"simplex drawing needs K = 3 (K = {K})", ha="center", va="center", transform=ax.transAxes)
    ax.axis("off")

    ax = axes[1]
    floor = 1e-4
    for metric, color, label in (("p3.tv", "C0", "total variation"), ("p3.kl", "C3", "KL(alpha || beta)")):
        rows = table[(table["metric"] == metric) & table["position"].notna() & table["task"].isna()].sort_values(
            "position"
        )
        low, high = (np.maximum(np.array(b), floor) for b in zip(*rows["band"]))
        ax.plot(rows["position"], np.maximum(rows["value"], floor), color=color, label=f"{label} (median)")
        ax.fill_between(rows["position"], low, high, color=color, alpha=0.2, lw=0)
    mean = table[(table["metric"] == "p3.tv_mean_beta") & table["position"].notna() & table["task"].isna()].sort_values(
        "position"
    )
    ax.plot(
        mean["position"],
        np.maximum(mean["value"], floor),
        color="0.4",
        lw=1.2,
        label="TV of the task-mean curves (p3-late-window)",
    )
    trajectory = table[(table["metric"] == "p3.tv_trajectory") & table["position"].notna()].sort_values("position")
    if len(trajectory):
        ax.plot(
            trajectory["position"],
            np.maximum(trajectory["value"], floor),
            color="k",
            lw=1.8,
            label="TV of task 0's mean curve, the study's trajectory (P3)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("context position t")
    ax.set_ylabel(f"distance between beta_t and alpha_t (floor {floor:g})")
    ax.set_title("P3: alignment with the posterior (interquartile band)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)


def _most_uncertain(alpha: torch.Tensor, chosen: torch.Tensor, count: int) -> list[int]:
    """The positions (in 0..N-1) of the ``count`` chosen sequences (chosen: [N] bool) of highest
    mean posterior entropy over the first quarter of positions; alpha: [N, T, K]."""
    early = alpha[:, : max(1, alpha.shape[1] // 4)].double()
    entropy = -torch.special.xlogy(early, early).sum(-1).mean(-1)
    entropy = entropy.masked_fill(~chosen, -1.0)
    _, order = entropy.topk(min(count, int(chosen.sum())))
    return order.tolist()


_LAYER_METRICS = (
    ("p0.cell_r2", "P0 cell-means R^2", "C0"),
    ("p1.additive_share", "P1 additive share", "C1"),
    ("p2.r2_additive", "P2 r2_additive", "C2"),
    ("p2.r2_additive_random", "P2 r2_additive, random subspace", "0.5"),
)
_FORCED = {
    "p0.cell_r2": "p0.cell_r2_forced",
    "p1.additive_share": "p1.additive_share_forced",
    "p2.r2_additive": "p2.r2_additive_forced",
    "p2.r2_additive_random": "p2.r2_additive_forced_random",
}


def claimed_by_layer(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(the per-place rows of P0-P2 the claims read, named as ``_LAYER_METRICS``, and what they are
    measured on): a token family's forced-token cells (batch ``cells``), else the measurement batch."""
    rows = table[table["position"].isna()]
    forced = rows[(rows["batch"] == "cells") & rows["metric"].isin(_FORCED.values())]
    if len(forced) and (rows["metric"] == "cells.tokens").any():  # E2's last-position rows: read in their form only
        return forced.assign(
            metric=forced["metric"].map({v: k for k, v in _FORCED.items()})
        ), "the study's forced-token cells"
    return rows[(rows["batch"] == "measure") & rows["metric"].isin(_FORCED)], "natural states"


def plot_properties_by_layer(table: pd.DataFrame, path: Path, title: str = "") -> None:
    """P0, P1 and P2 (with the random-subspace control) as the claims read them (``claimed_by_layer``)
    against the layer, one line style per site; left the shares, right the unexplained part 1 - share (log). With rows of several seeds
    (a ``seed`` column), each line is the median over seeds and the band their range; with one,
    the band is the random control's range over draws."""
    rows, measured_on = claimed_by_layer(table)
    several = "seed" in rows and rows["seed"].nunique() > 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s, (site, group) in enumerate(rows.groupby("site", sort=False)):
        style = ("-", "--", ":", "-.")[s % 4]
        for metric, label, color in _LAYER_METRICS:
            part = group[group["metric"] == metric]
            stats = part.groupby("layer")["value"].agg(["median", "min", "max"]).sort_index()
            for ax, values in ((axes[0], stats["median"]), (axes[1], (1 - stats["median"]).clip(lower=1e-8))):
                ax.plot(stats.index, values, style, marker="o", color=color, label=f"{label} ({site})")
            if several:
                axes[0].fill_between(stats.index, stats["min"], stats["max"], color=color, alpha=0.15, lw=0)
            elif part["band"].notna().all():
                part = part.sort_values("layer")
                low, high = (np.array(b) for b in zip(*part["band"]))
                axes[0].fill_between(part["layer"], low, high, color=color, alpha=0.15, lw=0)
    layers = sorted(rows["layer"].unique().astype(int))
    for ax in axes:
        ax.set_xticks(layers)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of variance explained")
    axes[0].set_ylim(min(-0.05, float(rows["value"].min()) - 0.05), 1.05)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("unexplained: 1 - share (floor 1e-8)")
    axes[1].legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"{title or 'P0-P2 per layer'} (on {measured_on})")
    fig.tight_layout()
    save(fig, path)


def plot_steering(steering: Steering, path: Path, title: str = "") -> None:
    """The study's simplex heat map (K = 3): each target point a placed in the triangle of the
    major tasks, hexagons coloured by the mean readout of the points inside (``steering.label``),
    unsteered (left) and steered (right) on one colour scale; the means of the four readouts
    (unsteered, steered, mode task, random direction: ``Steering.mean``, what the claim reads)
    written below. For K != 3, bars of the four means."""
    means = {kind: steering.mean(kind) for kind in KINDS}
    written = (
        f"mean {steering.label} over {steering.n_points} target points, positions {steering.positions[0]}-{steering.positions[-1]}: "
        + ", ".join(
            f"{kind} {value:.3g}"
            for kind, value in zip(("unsteered", "steered", "mode task", "random direction"), means.values())
        )
    )
    K = steering.a.shape[1]
    if K == 3:
        xy = steering.a.double().numpy() @ _CORNERS
        panels = (("unsteered", steering.unsteered), ("steered", steering.steered))
        top = float(np.quantile(np.concatenate([v.double().numpy() for _, v in panels]), 0.95)) or 1.0
        fig, axes = plt.subplots(1, 2, figsize=(10, 5.2))
        for ax, (name, values) in zip(axes, panels):
            cells = ax.hexbin(
                xy[:, 0],
                xy[:, 1],
                C=values.double().numpy(),
                reduce_C_function=np.mean,
                gridsize=14,
                extent=(0, 1, 0, math.sqrt(3) / 2),
                cmap="magma_r",
                vmin=0,
                vmax=top,
                linewidths=0.2,
            )
            triangle = plt.Polygon(_CORNERS, closed=True, fill=False, edgecolor="k", lw=1)
            ax.add_patch(triangle)
            cells.set_clip_path(triangle)  # hexagons at the edges cut to the simplex
            for k in range(K):
                ax.annotate(
                    f"task {k}",
                    _CORNERS[k],
                    textcoords="offset points",
                    xytext=(0, -12 if k < 2 else 5),
                    ha="center",
                    fontsize=9,
                )
            ax.set_title(f"{name}: mean {means[name]:.3g}")
            ax.set_aspect("equal")
            ax.axis("off")
        fig.subplots_adjust(bottom=0.26, top=0.86)
        bar = fig.add_axes((0.3, 0.14, 0.4, 0.03))
        fig.colorbar(
            cells,
            cax=bar,
            orientation="horizontal",
            label=f"{steering.label} at the target point (clipped at the 95th percentile)",
        )
        fig.text(0.5, 0.02, written, ha="center", fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(range(len(means)), list(means.values()), color=["C0", "C2", "C1", "0.5"])
        ax.set_xticks(range(len(means)), ["unsteered", "steered", "mode task", "random"])
        ax.set_ylabel(f"mean {steering.label}")
        ax.set_title(f"no simplex drawing for K = {K}: the means", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
    fig.suptitle(title or "Causal steering toward a Dirichlet(1) point of the simplex")
    save(fig, path)


def plot_r2_by_position(
    table: pd.DataFrame, place: tuple[int, str], window: slice, path: Path, title: str = ""
) -> None:
    """P2's r2_additive of the states at each position, one line per site and layer (the claims'
    place bold); the shaded span is the positions the claim averages (``window``)."""
    rows = table[(table["metric"] == "p2.r2_additive") & table["position"].notna() & (table["batch"] == "measure")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for (layer, site), group in rows.groupby(["layer", "site"], sort=True):
        group = group.sort_values("position")
        chosen = (int(layer), site) == tuple(place)
        ax.plot(
            group["position"],
            group["value"],
            "-" if site == "resid_mid" else "--",
            lw=2.2 if chosen else 1,
            alpha=1 if chosen else 0.6,
            label=f"layer {int(layer)} {site}{' (the claims)' if chosen else ''}",
        )
    if len(rows):
        ax.axvspan(window.start - 0.5, window.stop - 0.5, color="0.9", zorder=0, label="the claim's positions")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("analysed position (E2: example index, read where y_i is predicted)")
    ax.set_ylabel("r2_additive at that position")
    ax.set_title(title or "P2 per position")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    save(fig, path)


FIGURES = ("simplex", "layers", "positions", "steering")


def plot_retrieval(result, paths: dict[str, Path], seeds: pd.DataFrame | None = None) -> None:
    """The M1 figures of a ``analysis.stored.m1.Result``; paths: {name in FIGURES: PNG path}. ``seeds``: the
    rows of every seed's result (with a ``seed`` column), for the per-layer figure's median and band."""
    table = pd.DataFrame(result.rows)
    layer, site = result.place
    p3_layer, p3_site = result.p3_place
    name = result.experiment.upper()
    plot_simplex_trajectories(
        result.alpha,
        result.beta,
        result.task,
        table[(table["layer"] == p3_layer) & (table["site"] == p3_site)],
        paths["simplex"],
        f"{name}: fitted task coefficients vs the exact posterior (layer {p3_layer}, {p3_site})",
    )
    several = seeds is not None and seeds["seed"].nunique() > 1
    plot_properties_by_layer(
        seeds if several else table,
        paths["layers"],
        f"{name}: P0-P2 per layer"
        + (f" (median and range over seeds {', '.join(map(str, sorted(seeds['seed'].unique())))})" if several else ""),
    )
    plot_r2_by_position(
        table, result.place, result.p2_window, paths["positions"], f"{name}: P2 r2_additive per position"
    )
    place = result.steering.place
    plot_steering(result.steering, paths["steering"], f"{name}: steering at layer {place.layer}, {place.site}")

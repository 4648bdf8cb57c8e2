"""E4 figures: P0 as the study measures it (per bracket index) and the earlier within-cell shares per layer
across families, the study's prefix probe and the earlier linear bracket-prefix probes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from taskgeom.report.figures import save  # noqa: E402


def plot_p0_comparison(series: dict[str, list[float]], path: Path, title: str = "", site: str = "resid_mid") -> None:
    """One line per (family, grouping): the within-cell share of variance at each layer's ``site``.

    series: {label: [share at layer 0, layer 1, ...]}; a label containing "E4" is drawn dashed.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, shares in series.items():
        ax.plot(range(len(shares)), shares, "--o" if "E4" in label else "-o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel(f"layer ({site})")
    ax.set_ylabel("within-cell share SS_within / SS_total")
    ax.set_xticks(range(max(len(s) for s in series.values())))
    ax.grid(alpha=0.3, which="both")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title or "P0: share of state variance left within cells, per layer")
    fig.tight_layout()
    save(fig, path)


def plot_p0_positions(
    ratios: dict[int, list[float]], references: dict[str, float], path: Path, site: str = "resid_mid"
) -> None:
    """The study's E4 panel: the residual variance ratio against the bracket index j, one line per
    layer; each reference's 1 - P0 a dotted horizontal line.

    ratios: {layer: [ratio at j = 0, 1, ...]}; references: {label: 1 - P0}.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for layer, values in sorted(ratios.items()):
        ax.plot(range(len(values)), values, "-o", markersize=3, label=f"layer {layer}")
    for label, share in references.items():
        ax.axhline(share, linestyle=":", color="grey")
        ax.annotate(
            f"{label}: 1 - P0 = {share:.3g}",
            (0, share),
            textcoords="offset points",
            xytext=(2, 3),
            fontsize=7,
            color="grey",
        )
    _finish_unit_panel(
        fig,
        ax,
        path,
        "bracket index j (the state at bracket j's own position)",
        f"residual variance ratio 1 - R^2 ({site})",
        "E4: P0 as the study's variance.py measures it (cells: last three planted brackets)",
    )


def _by_back(rows: list[dict]) -> tuple[list[int], list[dict]]:
    """The ``back_j`` rows of one probe table and site, ordered by j."""
    pairs = sorted((int(r["target"].split("_")[1]), r) for r in rows if r["target"].startswith("back_"))
    return [j for j, _ in pairs], [r for _, r in pairs]


def _sites(rows: list[dict], site: str) -> list[tuple[int, str]]:
    """(layer, site name) of the embedding (layer 0's resid_pre) and of ``site`` at each layer, in order."""
    found = {(r["layer"], r["site"]) for r in rows if r["site"] in ("resid_pre", site)}
    return sorted(found, key=lambda s: (s[1] != "resid_pre", s[0]))


def _label(layer: int, name: str) -> str:
    return "embedding" if name == "resid_pre" else f"layer {layer}"


SET_NAMES = {"pool": "in-distribution (pool) sequences", "ood": "OOD sequences"}
SET_STYLES = {"pool": "-", "ood": "--"}


def plot_prefix_probes(
    rows: list[dict], baseline: list[dict], path: Path, title: str = "", site: str = "resid_mid"
) -> None:
    """Held-out linear probes for the bracket prefix. One accuracy panel per probe set (pool
    sequences solid, OOD dashed): the bracket j back against j, one line per layer's ``site`` and
    the embedding, its shuffled-label control dotted. Last panel: the depth probe's R^2 per layer,
    each set in its line style, controls dotted.

    rows: tidy rows {set, site, layer, target, score, control}, target ``back_j`` or ``depth``;
    baseline: rows of one site of a reference network (the untrained one), drawn grey.
    """
    sets = [s for s in SET_NAMES if any(r["set"] == s for r in rows)]
    sites = _sites(rows, site)
    colours = {key: plt.cm.viridis(0.85 * i / max(1, len(sites) - 1)) for i, key in enumerate(sites)}
    fig, axes = plt.subplots(
        1, len(sets) + 1, figsize=(5 * len(sets) + 4, 4.2), gridspec_kw={"width_ratios": [5] * len(sets) + [4]}
    )
    depth_ax = axes[-1]
    for ax, which in zip(axes, sets):
        style = SET_STYLES[which]
        for key in sites:
            back, chosen = _by_back([r for r in rows if r["set"] == which and (r["layer"], r["site"]) == key])
            ax.plot(back, [r["score"] for r in chosen], style, marker="o", ms=3, color=colours[key], label=_label(*key))
            ax.plot(back, [r["control"] for r in chosen], ":", color=colours[key], alpha=0.7)
        back, chosen = _by_back([r for r in baseline if r["set"] == which])
        if chosen:
            ax.plot(
                back,
                [r["score"] for r in chosen],
                style,
                marker="x",
                color="grey",
                label=f"untrained, {_label(chosen[0]['layer'], chosen[0]['site'])}",
            )
        ax.set_title(f"bracket j back, {SET_NAMES[which]}; dotted: shuffled labels", fontsize=9)
        ax.set_xlabel("j: the planted bracket j back (1 = the latest)")
        ax.set_ylabel(f"held-out accuracy at {site}")
        ax.set_ylim(min(0.4, *(r["score"] - 0.02 for r in rows if r["target"] != "depth")), 1.02)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7)
    positions = range(len(sites))
    for which in sets:
        depth = {(r["layer"], r["site"]): r for r in rows if r["set"] == which and r["target"] == "depth"}
        depth_ax.plot(
            positions,
            [depth[key]["score"] for key in sites],
            SET_STYLES[which],
            marker="o",
            color="C0" if which == "pool" else "C1",
            label=SET_NAMES[which],
        )
        depth_ax.plot(
            positions, [depth[key]["control"] for key in sites], ":", color="C0" if which == "pool" else "C1", alpha=0.7
        )
        base = next((r for r in baseline if r["set"] == which and r["target"] == "depth"), None)
        if base is not None:
            depth_ax.plot(
                [len(sites) - 1],
                [base["score"]],
                "x",
                color="grey",
                label="untrained network" if which == sets[0] else None,
            )
    depth_ax.set_xticks(list(positions), [_label(*key) for key in sites], rotation=30, ha="right", fontsize=8)
    depth_ax.set_ylabel(f"held-out R^2 of the depth at {site}")
    depth_ax.set_title("depth (opens minus closes); dotted: shuffled labels", fontsize=9)
    depth_ax.grid(alpha=0.3)
    depth_ax.legend(frameon=False, fontsize=7)
    fig.suptitle(title or f"E4: linear probes for the bracket prefix at {site}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    save(fig, path)


def plot_study_probe(
    accuracy: dict[int, float], control: dict[int, float], reached: int, path: Path, site: str = "resid_mid"
) -> None:
    """The study's prefix probe: validation accuracy against the prefix length l, and the same probe's
    on shuffled labels (dotted); the lengths past ``reached``, which its curriculum never trained,
    shaded. accuracy, control: {l: accuracy}."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    lengths = sorted(accuracy)
    ax.plot(lengths, [accuracy[length] for length in lengths], "-o", label="prefix probe (2-D projection + MLP)")
    ax.plot(lengths, [control[length] for length in lengths], ":o", color="grey", label="the same on shuffled labels")
    if reached < lengths[-1]:
        ax.axvspan(
            reached + 0.5, lengths[-1] + 0.5, color="grey", alpha=0.12, label="heads the curriculum never trained"
        )
    ax.set_xticks(lengths)
    _finish_unit_panel(
        fig,
        ax,
        path,
        "prefix length l (brackets placed)",
        f"validation accuracy ({site})",
        "E4: the study's prefix probe, the first l brackets of the task's string",
    )


def _finish_unit_panel(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label a panel whose values lie in [0, 1], add its legend and grid, and save it to path."""
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save(fig, path)

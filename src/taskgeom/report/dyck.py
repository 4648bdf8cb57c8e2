"""E4 figures: P0 (within-cell share per layer) across families, and the bracket-prefix probes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_p0_comparison(series: dict[str, list[float]], path: Path, title: str = "") -> None:
    """One line per (family, grouping): the within-cell share of variance at each layer.

    series: {label: [share at layer 0, layer 1, ...]}; a label containing "E4" is drawn dashed.
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, shares in series.items():
        ax.plot(range(len(shares)), shares, "--o" if "E4" in label else "-o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer (resid_post)")
    ax.set_ylabel("within-cell share SS_within / SS_total")
    ax.set_xticks(range(max(len(s) for s in series.values())))
    ax.grid(alpha=0.3, which="both")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title or "P0: share of state variance left within cells, per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _by_back(rows: list[dict], site: str) -> tuple[list[int], list[dict]]:
    pairs = sorted((int(r["target"].split("_")[1]), r) for r in rows if r["site"] == site and r["target"].startswith("back_"))
    return [j for j, _ in pairs], [r for _, r in pairs]


def plot_prefix_probes(rows: list[dict], baseline: list[dict], path: Path, title: str = "") -> None:
    """Left: accuracy of probes for the bracket j back, per site, against the shuffled control;
    right: R^2 of the depth probe per site. rows: {target, site, score, control} with target
    ``back_j`` or ``depth``; baseline: the same rows for one site of a reference network (grey)."""
    sites = list(dict.fromkeys(r["site"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for i, site in enumerate(sites):
        back, chosen = _by_back(rows, site)
        left.plot(back, [r["score"] for r in chosen], "-o", color=f"C{i}", label=site)
        left.plot(back, [r["control"] for r in chosen], ":", color=f"C{i}", alpha=0.7)
        depth = next(r for r in rows if r["site"] == site and r["target"] == "depth")
        right.bar(i - 0.2, depth["score"], 0.4, color=f"C{i}")
        right.bar(i + 0.2, depth["control"], 0.4, color=f"C{i}", alpha=0.35)
    if baseline:
        back, chosen = _by_back(baseline, baseline[0]["site"])
        left.plot(back, [r["score"] for r in chosen], "-.", color="grey", label=f"untrained, {baseline[0]['site']}")
        depth = next(r for r in baseline if r["target"] == "depth")
        right.bar(len(sites), depth["score"], 0.4, color="grey")
        sites = [*sites, "untrained"]
    left.set_xlabel("j: the planted bracket j back (1 = the latest)")
    left.set_ylabel("held-out accuracy (dotted: shuffled labels)")
    left.grid(alpha=0.3)
    left.legend(frameon=False, fontsize=8)
    right.set_xticks(range(len(sites)), sites, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("held-out R^2 of depth (pale: shuffled)")
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title or "E4: linear probes for the bracket prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

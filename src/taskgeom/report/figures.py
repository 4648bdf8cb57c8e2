"""Figures (matplotlib, Agg backend); each is saved as a PNG (for the page) and a PDF beside it (for papers)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def save(fig: plt.Figure, path: Path) -> None:
    """Save ``fig`` to ``path`` (PNG, 120 dpi) and to the same name with ``.pdf``, then close it."""
    fig.savefig(path, dpi=120)
    fig.savefig(Path(path).with_suffix(".pdf"))
    plt.close(fig)


def plot_loss_by_position(
    table: pd.DataFrame, path: Path, labels: tuple[str, str, str, str], title: str = "", log_scale: bool = False
) -> None:
    """One panel per evaluation set: per-position loss of the model and the two Bayes predictors.

    table: tidy rows {set, position, metric, value} from ``evaluate_run``; labels: the family's
    ``plot_labels`` (ID-Bayes name, OOD-optimal name, loss unit, position axis).
    """
    id_name, ood_name, unit, axis = labels
    lines = {
        "loss": ("model", "C0", "-"),
        "bayes_id_loss": (id_name, "C1", "--"),
        "bayes_ood_loss": (ood_name, "C2", ":"),
    }
    sets = list(dict.fromkeys(table["set"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.4), sharey=not log_scale, squeeze=False)
    for ax, name in zip(axes[0], sets):
        for metric, (label, color, style) in lines.items():
            rows = table[(table["set"] == name) & (table["metric"] == metric)]
            ax.plot(rows["position"], rows["value"], style, color=color, label=label)
        ax.set_title(f"{name} sequences")
        ax.set_xlabel(axis)
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(unit)
    axes[0, -1].legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)

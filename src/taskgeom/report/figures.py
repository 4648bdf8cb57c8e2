"""Figures (matplotlib, Agg backend); each function saves one PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

_LINES = {"loss": ("model", "C0", "-"), "bayes_id_loss": ("ID-Bayes (pool posterior)", "C1", "--"), "bayes_ood_loss": ("OOD-optimal (continuous prior)", "C2", ":")}


def plot_loss_by_position(table: pd.DataFrame, path: Path, title: str = "") -> None:
    """One panel per evaluation set: per-position loss of the model and the two predictors.

    table: tidy rows {set, position, metric, value} from ``evaluate_run``.
    """
    sets = list(dict.fromkeys(table["set"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], sets):
        for metric, (label, color, style) in _LINES.items():
            rows = table[(table["set"] == name) & (table["metric"] == metric)]
            ax.plot(rows["position"], rows["value"], style, color=color, label=label)
        ax.set_title(f"{name} sequences")
        ax.set_xlabel("context position t")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("loss (nats/token; squared error for E2)")
    axes[0, -1].legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

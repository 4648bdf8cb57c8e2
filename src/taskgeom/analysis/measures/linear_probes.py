"""Linear probes from states to labels, scored on held-out samples against a shuffled-label control.

A probe is ridge regression on standardised features (closed form). Regression targets are scored by
held-out R^2; class labels by held-out accuracy of the least-squares classifier (ridge on one-hot
targets, arg-max). The control fits the same probe after shuffling the labels across samples, so
it measures what the probe finds in structure-free labels. Samples sharing a ``group`` (e.g. the
positions of one sequence) fall on the same side of the train/test split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from taskgeom.rng import generator

Kind = Literal["regression", "classification"]


@dataclass(frozen=True)
class ProbeResult:
    """score: held-out R^2 or accuracy; control: the same on shuffled labels; metric: r2 | accuracy."""

    score: float
    control: float
    metric: str


def ridge(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [D, M] and bias [M] minimising ||y - x W - b||^2 / N + l2 ||W||^2; x: [N, D], y: [N, M]."""
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc = x - x_mean
    gram = xc.T @ xc / x.shape[0] + l2 * torch.eye(x.shape[1], dtype=x.dtype)
    weights = torch.linalg.solve(gram, xc.T @ (y - y_mean) / x.shape[0])
    return weights, y_mean - x_mean @ weights


def _split(groups: torch.Tensor, test_frac: float, gen: torch.Generator) -> torch.Tensor:
    """[N] bool, true for test samples: a random ``test_frac`` of the distinct groups."""
    names, index = torch.unique(groups, return_inverse=True)
    n_test = max(1, round(test_frac * len(names)))
    if n_test >= len(names):
        raise ValueError(f"a probe needs at least 2 groups to hold some out, got {len(names)}")
    test_groups = torch.zeros(len(names), dtype=torch.bool)
    test_groups[torch.randperm(len(names), generator=gen)[:n_test]] = True
    return test_groups[index]


def _score(x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, kind: Kind, n_classes: int, l2: float) -> float:
    train = ~test
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-8)
    x = (x - mean) / std
    target = (
        torch.nn.functional.one_hot(y, n_classes).double()
        if kind == "classification"
        else y.double().reshape(len(y), -1)
    )
    weights, bias = ridge(x[train], target[train], l2)
    pred = x[test] @ weights + bias
    if kind == "classification":
        return float((pred.argmax(-1) == y[test]).double().mean())
    truth = target[test]
    total = ((truth - truth.mean(0)) ** 2).sum()
    return float(1 - ((truth - pred) ** 2).sum() / total) if total > 0 else float("nan")


def linear_probe(
    x: torch.Tensor,
    y: torch.Tensor,
    kind: Kind,
    groups: torch.Tensor | None = None,
    test_frac: float = 0.25,
    l2: float = 1e-3,
    seed: int = 0,
) -> ProbeResult:
    """Probe x: [N, D] for y: [N] (or [N, M] for regression; long class indices for
    classification); groups: [N] (each sample its own group by default)."""
    if kind not in ("regression", "classification"):
        raise ValueError(f"kind must be 'regression' or 'classification', got {kind!r}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
    x = x.double()
    groups = torch.arange(x.shape[0]) if groups is None else groups
    gen = generator(seed, 0, "probe")
    test = _split(groups, test_frac, gen)
    n_classes = int(y.max()) + 1 if kind == "classification" else 0
    shuffled = y[torch.randperm(len(y), generator=gen)]
    metric = "accuracy" if kind == "classification" else "r2"
    return ProbeResult(_score(x, y, test, kind, n_classes, l2), _score(x, shuffled, test, kind, n_classes, l2), metric)

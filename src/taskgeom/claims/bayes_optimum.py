"""The foundation's acceptance claim: the k = -1 runs of the recipes that declare ``bayes_optimum``
(E1, E3) reach the ID-Bayes optimum on held-out major-task sequences."""

from __future__ import annotations

from taskgeom.claims.rules import Claim, Spec

SPECS: tuple[Spec, ...] = (
    Spec(
        "bayes_optimal",
        "bayes_optimum",
        "E1, E3 (k = -1)",
        "excess loss over the ID-Bayes predictor on held-out major-task sequences (nats/token, mean over "
        "positions), k = -1",
        "<=",
        0.02,
        ("loss_by_position",),
    ),
)


def bayes_optimal(recipe: str, excess: float) -> Claim:
    """The claim of one k = -1 run of ``recipe`` from its mean ``excess`` loss over the ID-Bayes predictor."""
    return SPECS[0].judge(recipe, excess)

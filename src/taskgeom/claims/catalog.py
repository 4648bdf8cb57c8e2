"""Every claim of the study in one table, gathered from the registered experiments
(``claims.registry``), each of which owns its claims' specs, reading and judgement.
A claim's id is its recipe's name, a dot, then its name (``e1.P0``). The thresholds are ours,
fixed before measuring and the same for every family; docs/protocol.md#thresholds is generated
from this table (``thresholds_table``) and a test holds the page to it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from taskgeom.claims import m1
from taskgeom.claims.registry import experiments
from taskgeom.claims.rules import Claim, Spec

# The claims of the M1 geometry (per recipe), read on the k = -1 run whose ``bayes_optimal`` is their precondition
M1_CLAIMS: tuple[str, ...] = tuple(claim.name for claim in m1.SPECS)


def specs() -> tuple[Spec, ...]:
    """Every claim of the registered experiments, in their order."""
    return tuple(spec for experiment in experiments().values() for spec in experiment.claims)


def spec(experiment: str, name: str) -> Spec:
    """The claim ``name`` that ``experiment`` measures (``spec("m1", "P0")``)."""
    for claim in specs():
        if (claim.experiment, claim.name) == (experiment, name):
            return claim
    raise KeyError(f"no claim {name!r} of experiment {experiment!r} in the catalog")


def evidence(claims: tuple[Spec, ...]) -> dict[str, tuple[str, ...]]:
    """{figure kind: the names of the claims it shows} for ``claims`` (an experiment's), in their order."""
    shown: dict[str, tuple[str, ...]] = {}
    for claim in claims:
        for figure in claim.figures:
            shown[figure] = (*shown.get(figure, ()), claim.name)
    return shown


def with_preconditions(measured: Iterable[tuple[int, Claim]]) -> list[tuple[int, Claim]]:
    """The per-seed claims ``(seed, claim)`` with each M1 claim (``M1_CLAIMS`` of a recipe) given its
    precondition: the same recipe's ``bayes_optimal`` claim at that seed (its k = -1 run, the run the
    M1 geometry is measured on), where one was measured. The verdict rule does not read it."""
    measured = list(measured)
    optimal = {
        (seed, claim.id.removesuffix(".bayes_optimal")): claim
        for seed, claim in measured
        if claim.id.endswith(".bayes_optimal")
    }
    annotated = []
    for seed, claim in measured:
        recipe, _, name = claim.id.partition(".")
        pre = optimal.get((seed, recipe)) if name in M1_CLAIMS else None
        if pre is not None:
            claim = replace(claim, precondition={"claim": pre.id, "value": pre.value, "status": pre.status})
        annotated.append((seed, claim))
    return annotated


def thresholds_table() -> str:
    """The Markdown table of docs/protocol.md#thresholds: one row per claim of the catalog."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| claim | experiment | measured on | quantity | passes when | figures |", "|---|---|---|---|---|---|"]
    lines += [
        f"| `{c.name}` | {c.experiment} | {c.recipes} | {cell(c.description)} | {c.comparison} {c.threshold:g} | {', '.join(c.figures)} |"
        for c in specs()
    ]
    return "\n".join(lines)

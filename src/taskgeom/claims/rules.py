"""Claims of the study as named checks: a measured value against a documented threshold.

Each claim has a status: ``pass``, ``fail``, or ``n/a`` when the claim does not apply to what was
measured (docs/protocol.md: P3 shrinks needs at least 5 uncertain positions). An n/a claim is
counted neither as passed nor as failed. A ratio or share is written beside its ``parts``, the
numbers it is made of, so that a reader can judge it (a share of a tiny gain says little).

A claim is measured once per training seed and judged over them (``over_seeds``), by a rule fixed
before measuring: ``pass`` when every seed that applies passes, ``fail`` when every one fails,
``unstable`` when they disagree, ``n/a`` when no seed applies. Its ``value`` is then the median
over the seeds that apply, beside their minimum, maximum and each seed's own value, status and parts.

A ``Spec`` is one claim of the catalog (its name, its one description, threshold and comparison); the
module of the experiment that measures it (``claims.m1``, ``claims.dual_modes``, ...) reads its value
and parts and judges it with ``Spec.judge``. A claim carries no profile until the experiment that returns it stamps one.
"""

from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Optional, Union

from taskgeom.analysis.measures.shares import MIN_RELIABLE_GAIN, unreliable_gain
from taskgeom.runs.storage import standard_json

Comparison = Literal["<=", ">=", "<", ">"]
Status = Literal["pass", "fail", "unstable", "n/a"]
STATUSES: tuple[str, ...] = ("pass", "fail", "unstable", "n/a")
Part = Union[float, int, bool, str]

NOT_BAYES_OPTIMAL = "on a model that is not Bayes-optimal"
NO_OOD_MODE = "on a model without an OOD mode"
# The preconditions a seed's claim may carry, by name: the caveat of a verdict resting on a seed that
# fails it, the mark a table prints for that caveat, and what failing it means (the footnote)
CAVEATS: dict[str, tuple[str, str, str]] = {
    "bayes_optimal": (NOT_BAYES_OPTIMAL, "\u2020", "its k = -1 run fails bayes_optimal"),
    "ood_mode": (NO_OOD_MODE, "\u2021", "the run's OOD in-context gain is under half the Bayes OOD predictor's"),
}
_OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


@dataclass(frozen=True)
class Claim:
    """One row of claims.json: ``id`` is ``<recipe>.<name>``, ``experiment`` the experiment that measured it
    (``m1``, ``dual_modes``, ...) and ``recipe`` the recipe it was measured on (from the id when not given).
    ``passed`` is true only for status ``pass``; ``parts`` are the numbers
    a ratio or share is made of (or None); ``reason`` says why an ``n/a`` claim does not apply.
    ``profile``: the profile measured, which the experiment stamps on the claims it returns (None
    until then). A claim judged over seeds (``over_seeds``) has ``seeds``, one row per seed ({seed, value, status,
    parts, reason, precondition}), and the ``median``, ``min`` and ``max`` of their values (``value`` is the median).
    ``precondition``: on a seed's claim of the M1 geometry, its model's ``bayes_optimal`` claim at that
    seed ({claim, value, status}); on an OOD-share or projection claim, its run's OOD mode ({claim:
    "<recipe>.ood_mode", value: the OOD gain over the Bayes OOD predictor's, status, ...};
    ``claims.dual_modes.ood_mode``); ``caveat``: on a judged claim, why a reader should read its
    verdict with care (``CAVEATS``: ``NOT_BAYES_OPTIMAL``, ``NO_OOD_MODE``, when a seed it rests on
    fails its precondition)."""

    id: str
    experiment: str
    description: str
    value: float
    threshold: float
    passed: bool
    profile: Optional[str]
    comparison: str
    status: Status
    parts: Optional[dict[str, Part]] = None
    reason: Optional[str] = None
    seeds: Optional[tuple[dict, ...]] = None
    median: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    precondition: Optional[dict[str, Part]] = None
    caveat: Optional[str] = None
    recipe: Optional[str] = None

    def __post_init__(self) -> None:
        if self.recipe is None:  # a claim's id is "<recipe>.<name>"
            object.__setattr__(self, "recipe", self.id.partition(".")[0])
        if self.status not in STATUSES:
            raise ValueError(f"claim {self.id}: status must be one of {list(STATUSES)}, not {self.status!r}")
        if self.passed != (self.status == "pass"):
            raise ValueError(f"claim {self.id}: passed={self.passed} contradicts status {self.status!r}")
        if self.status == "n/a" and not self.reason:
            raise ValueError(f"claim {self.id}: an n/a claim needs a reason")
        if self.status == "unstable" and not self.seeds:
            raise ValueError(f"claim {self.id}: an unstable claim needs its seeds")
        if self.parts is not None:
            object.__setattr__(self, "parts", _clean_parts(self.id, self.parts))

    def as_dict(self) -> dict:
        """The claims.json row: strict JSON (a NaN or infinite number is written as null)."""
        return standard_json(asdict(self))


@dataclass(frozen=True)
class Spec:
    """One claim: ``name`` (its id after the recipe), the ``experiment`` that measures it, the
    ``recipes`` it is measured for (in words), its one ``description`` (the quantity compared, in
    words: what the thresholds table prints and every claim judged by it carries; the diversity,
    place and sizes a seed read are in its parts), ``comparison`` and ``threshold``, and the kinds of
    figure that show it (``figures``: an M1 or dual-mode figure kind, else a figure's file stem)."""

    name: str
    experiment: str
    recipes: str
    description: str
    comparison: Comparison
    threshold: float
    figures: tuple[str, ...] = ()

    def judge(
        self,
        recipe: str,
        value: float,
        parts: Optional[dict[str, Part]] = None,
        reason: Optional[str] = None,
    ) -> Claim:
        """The claim ``{recipe}.{name}`` of one seed: checked against the threshold, or ``n/a`` with ``reason``."""
        claim_id = f"{recipe}.{self.name}"
        if reason is not None:
            return not_applicable(
                claim_id, self.experiment, self.description, self.comparison, self.threshold, reason, parts
            )
        return check(claim_id, self.experiment, self.description, value, self.comparison, self.threshold, parts)


def check(
    claim_id: str,
    experiment: str,
    description: str,
    value: float,
    comparison: Comparison,
    threshold: float,
    parts: Optional[dict[str, Part]] = None,
) -> Claim:
    """A Claim with status ``pass`` when ``value <comparison> threshold``, else ``fail`` (NaN never
    passes). ``parts``: the numbers the value is made of, written beside it."""
    value = float(value)
    passed = not math.isnan(value) and bool(_OPS[comparison](value, threshold))
    return Claim(
        claim_id,
        experiment,
        description,
        value,
        float(threshold),
        passed,
        None,
        comparison,
        "pass" if passed else "fail",
        parts,
    )


def not_applicable(
    claim_id: str,
    experiment: str,
    description: str,
    comparison: Comparison,
    threshold: float,
    reason: str,
    parts: Optional[dict[str, Part]] = None,
) -> Claim:
    """A Claim with status ``n/a`` (value NaN, not passed, not failed) and why it does not apply."""
    if comparison not in _OPS:
        raise ValueError(f"claim {claim_id}: comparison must be one of {list(_OPS)}, not {comparison!r}")
    return Claim(
        claim_id, experiment, description, math.nan, float(threshold), False, None, comparison, "n/a", parts, reason
    )


def gain_parts(clean: float, ablated: float, first: float, min_gain: float = MIN_RELIABLE_GAIN) -> dict[str, Part]:
    """The parts of a share of in-context gain: the clean and ablated losses, the loss at the first
    position ``first`` (L_0) and the gain ``L_0 - clean`` in nats. ``unreliable`` is true when the gain
    is below ``min_gain`` (or is NaN). The share itself is computed by the experiment."""
    clean, ablated, first = float(clean), float(ablated), float(first)
    gain = first - clean
    return {
        "clean_loss": clean,
        "ablated_loss": ablated,
        "loss_first": first,
        "gain": gain,
        "unreliable": unreliable_gain(gain, min_gain),
    }


def verdict(statuses: Iterable[str]) -> Status:
    """The rule that judges a claim over seeds: ``n/a`` seeds count neither way; of the others,
    ``pass`` when all pass, ``fail`` when all fail, ``unstable`` when they disagree; ``n/a`` when no
    seed applies."""
    judged = {status for status in statuses if status != "n/a"}
    if not judged:
        return "n/a"
    if not judged <= {"pass", "fail"}:
        raise ValueError(f"per-seed statuses must be pass, fail or n/a, not {sorted(judged - {'pass', 'fail'})}")
    return judged.pop() if len(judged) == 1 else "unstable"


def over_seeds(measured: Iterable[tuple[int, Claim]]) -> list[Claim]:
    """One claim per id (in order of first appearance) judged over its per-seed claims ``(seed,
    claim)`` by ``verdict``: value, median, min and max over the seeds that apply (NaN values left
    out of the statistics, never passing); each seed's value, status, parts and reason in ``seeds``."""
    by_id: dict[str, list[tuple[int, Claim]]] = {}
    for seed, claim in measured:
        by_id.setdefault(claim.id, []).append((int(seed), claim))
    judged = []
    for claim_id, rows in by_id.items():
        first = rows[0][1]
        seeds = [seed for seed, _ in rows]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"claim {claim_id}: measured twice on one seed ({sorted(seeds)})")
        for _, claim in rows:
            if (claim.threshold, claim.comparison, claim.experiment) != (
                first.threshold,
                first.comparison,
                first.experiment,
            ):
                raise ValueError(f"claim {claim_id}: its threshold, comparison or experiment differs between seeds")
        status = verdict(claim.status for _, claim in rows)
        values = [claim.value for _, claim in rows if claim.status != "n/a" and not math.isnan(claim.value)]
        median, low, high = (float(statistics.median(values)), min(values), max(values)) if values else (math.nan,) * 3
        reason = None
        if status == "n/a":
            reason = "; ".join(dict.fromkeys(claim.reason for _, claim in rows if claim.reason))
        elif status == "unstable":
            by_status = {s: [seed for seed, c in rows if c.status == s] for s in ("pass", "fail")}
            reason = "seeds disagree: " + "; ".join(
                f"{s} on seed {', '.join(map(str, by_status[s]))}" for s in by_status
            )
        per_seed = tuple(
            {
                "seed": seed,
                "value": claim.value,
                "status": claim.status,
                "parts": claim.parts,
                "reason": claim.reason,
                "precondition": claim.precondition,
            }
            for seed, claim in rows
        )
        unmet: dict[str, list[int]] = {}
        for seed, claim in rows:
            if claim.status != "n/a" and claim.precondition and claim.precondition["status"] != "pass":
                unmet.setdefault(CAVEATS[precondition_name(claim.precondition)][0], []).append(seed)
        caveat = "; ".join(f"{text} (seed {', '.join(map(str, seeds))})" for text, seeds in unmet.items()) or None
        judged.append(
            Claim(
                claim_id,
                first.experiment,
                first.description,
                median,
                first.threshold,
                status == "pass",
                first.profile,
                first.comparison,
                status,
                None,
                reason,
                per_seed,
                median,
                low,
                high,
                caveat=caveat,
                recipe=first.recipe,
            )
        )
    return judged


def precondition_name(precondition: dict) -> str:
    """The name of a seed's precondition in ``CAVEATS`` ({"claim": "e1.bayes_optimal", ...} ->
    "bayes_optimal")."""
    return str(precondition["claim"]).rpartition(".")[2]


def caveat_marks(caveat: str | None) -> str:
    """The marks of the caveats a verdict's ``caveat`` text holds ('\u2020', '\u2021', both, or '')."""
    return "".join(mark for text, mark, _ in CAVEATS.values() if caveat and text in caveat)


def counts(claims: Iterable[Claim]) -> dict[str, int]:
    """How many claims have each status: {"pass": ., "fail": ., "unstable": ., "n/a": .}."""
    tally = dict.fromkeys(STATUSES, 0)
    for claim in claims:
        tally[claim.status] += 1
    return tally


def summary(claims: Iterable[Claim]) -> str:
    """'X pass, Y fail, U unstable, Z n/a of N claims'."""
    tally = counts(claims)
    return (
        f"{tally['pass']} pass, {tally['fail']} fail, {tally['unstable']} unstable, {tally['n/a']} n/a "
        f"of {sum(tally.values())} claims"
    )


def exit_code(claims: Iterable[Claim]) -> int:
    """1 when some claim failed (on every seed), else 0 (unstable and n/a claims fail nothing)."""
    return 1 if any(claim.status == "fail" for claim in claims) else 0


def _clean_parts(claim_id: str, parts: dict) -> dict[str, Part]:
    """Parts as plain JSON-able Python values (numpy and torch scalars converted); anything else refused."""
    clean: dict[str, Part] = {}
    for name, value in parts.items():
        if not isinstance(name, str):
            raise TypeError(f"claim {claim_id}: part names must be strings, not {name!r}")
        if hasattr(value, "item") and tuple(getattr(value, "shape", (0,))) == ():  # a numpy or torch scalar
            value = value.item()
        if isinstance(value, (bool, str)):
            clean[name] = value
        elif isinstance(value, numbers.Integral):
            clean[name] = int(value)
        elif isinstance(value, numbers.Real):
            clean[name] = float(value)
        else:
            raise TypeError(
                f"claim {claim_id}: part {name!r} must be a float, int, bool or str, not {type(value).__name__}"
            )
    return clean

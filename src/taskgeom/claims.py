"""Claims of PAPER.md as named checks: a measured value against a documented threshold."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

Comparison = Literal["<=", ">=", "<", ">"]
_OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


@dataclass(frozen=True)
class Claim:
    """One row of claims.json."""

    id: str
    experiment: str
    description: str
    value: float
    threshold: float
    passed: bool
    profile: str
    comparison: str

    def as_dict(self) -> dict:
        return asdict(self)


def check(claim_id: str, experiment: str, description: str, value: float, comparison: Comparison, threshold: float, profile: str) -> Claim:
    """A Claim that passes when ``value <comparison> threshold`` (NaN never passes)."""
    value = float(value)
    passed = not math.isnan(value) and bool(_OPS[comparison](value, threshold))
    return Claim(claim_id, experiment, description, value, float(threshold), passed, profile, comparison)

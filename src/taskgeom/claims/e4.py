"""E4's own claims, planted Dyck (docs/concepts.md#e4-where-the-geometry-ends): P0 fails where E1 and
E3 satisfy it (``P0_failure``), and linear probes recover the earlier bracket prefix from the
hidden states (``prefix_probe``). Both read ``CLAIM_SITE`` of each model's M1 block, one place,
never the minimum over blocks (docs/protocol.md, "E4"); ``extras.dyck`` measures the shares and
the probes' rows they read."""

from __future__ import annotations

import math
from collections.abc import Sequence

from taskgeom.claims.rules import Claim, Spec

SPECS: tuple[Spec, ...] = (
    Spec("P0_failure", "e4", "E4 (k = -1)", "E4's within-cell share at its M1 block divided by the larger of E1's and E3's", ">=", 3.0,
         ("p0_across_families",)),
    Spec("prefix_probe", "e4", "E4 (the highest k of the grid)", "smallest over targets of a prefix probe's score minus its shuffled-label control", ">=",
         0.10, ("prefix_probes",)),
)
CLAIM_SITE = "resid_post"  # the site of the M1 block the claims and the figures read


def p0_failure(recipe: str, shares: dict[str, list[float]], layer: int, references: dict[str, int]) -> Claim:
    """E4's P0 failure on one seed: ``shares`` {series: within-cell share per layer} at ``CLAIM_SITE``
    (E4's two groupings ``e4_token_due`` and ``e4_last3_due``, and each reference recipe's), read
    at E4's M1 block ``layer`` and each reference's own M1 block (``references`` {recipe: layer})."""
    e4_share = min(shares["e4_token_due"][layer], shares["e4_last3_due"][layer])
    reference_share = max(shares[ref][at] for ref, at in references.items())
    of_references = " and ".join(f"{ref.upper()}'s" for ref in references)  # E1's and E3's
    return SPECS[0].judge(
        recipe,
        f"E4's within-cell share at its M1 block ({CLAIM_SITE}; per late position, median; the smaller of its two groupings, "
        f"bracket phase) divided by the larger of {of_references} (task, token) share at their M1 block; k = -1",
        e4_share / reference_share,
        {"e4_share": e4_share, "reference_share": reference_share, "layer": layer, "site": CLAIM_SITE,
         **{f"{ref}_share": shares[ref][at] for ref, at in references.items()}})


def prefix_probe(recipe: str, pool: Sequence[dict], untrained: Sequence[dict], layer: int, max_back: int, diversity: int) -> Claim:
    """The prefix probes' claim on one seed from the probe rows on in-distribution (``pool``)
    sequences of the trained and the ``untrained`` network: the weakest target at the M1 block
    ``layer`` (``weakest_probe``); ``max_back`` and ``diversity`` name what was probed."""
    weakest = weakest_probe(pool, layer)
    return SPECS[1].judge(
        recipe,
        f"smallest over targets (bracket j back, j = 1..{max_back}, and depth) of the probe score at the M1 block ({CLAIM_SITE}) "
        f"minus its shuffled-label control, in-distribution (pool) sequences, k = {diversity}",
        weakest["gain"],
        {"score": weakest["score"], "control": weakest["control"], "target": weakest["target"], "layer": layer,
         "site": CLAIM_SITE, "untrained_gain": weakest_probe(untrained, layer)["gain"]})


def _gain(row: dict) -> float:
    value = row["score"] - row["control"]
    return -math.inf if math.isnan(value) else value


def weakest_probe(rows: Sequence[dict], layer: int, site: str = CLAIM_SITE) -> dict:
    """The target whose probe at (``layer``, ``site``) beats its shuffled-label control by the least:
    {target, layer, score, control, gain} (gain = score - control). A NaN gain counts as the
    smallest, so that it reaches the claim (which NaN never passes)."""
    read = [r for r in rows if r["site"] == site and r["layer"] == layer]
    if not read:
        raise ValueError(f"no probe rows at layer {layer}, site {site!r}")
    row = min(read, key=_gain)
    return {"target": row["target"], "layer": row["layer"], "score": row["score"], "control": row["control"], "gain": row["score"] - row["control"]}

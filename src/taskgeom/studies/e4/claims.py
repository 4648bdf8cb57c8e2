"""E4's own claims, planted Dyck (docs/concepts.md#e4-where-the-geometry-ends): P0 fails where E1 and
E3 satisfy it (``P0_failure``), and a probe recovers the earlier bracket prefix from the hidden
states (``prefix_probe``). Both read the study's measurements (docs/protocol.md, "E4"): P0 at
the protocol's ``dyck_p0_site`` of each model's M1 block, where the study's variance.py reads it; the prefix probe as its
``run_prefix_probe`` (block 5 of 6, ``resid_mid``); ``studies.e4.experiment``, ``studies.e4.variance`` and
``studies.e4.prefix`` measure what they read."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from taskgeom.analysis.protocol import active
from taskgeom.claims.rules import Claim, Spec

SPECS: tuple[Spec, ...] = (
    Spec(
        "P0_failure",
        "e4",
        "E4 (k = -1)",
        "E4's residual variance ratio (1 - R^2 of cells of the tasks sharing the last three planted brackets, at "
        "bracket j's own position, the study's variance.py) at its M1 block (the protocol's dyck_p0_site), median "
        "over the brackets, divided by the larger of the reference recipes' (E1's and E3's) 1 - P0 (the study's "
        "forced-token cells); k = -1",
        ">=",
        3.0,
        ("p0_bracket_positions", "p0_across_families"),
    ),
    Spec(
        "prefix_probe",
        "e4",
        "E4 (the highest k of the grid)",
        "smallest over the prefix lengths whose head the study's prefix probe had trained at its kept snapshot (in "
        "the parts; a length above 0.9 chance not read) of its validation accuracy (2-D projection + MLP, the first l "
        "brackets of the task's string) minus the same probe's on shuffled labels where that probe's kept snapshot "
        "trained the length, else the chance level (the largest class share), at the study's block at the same "
        "relative depth (5 of 6), resid_mid (layer and site in the parts), in-distribution sequences, at the highest "
        "k of the grid",
        ">=",
        0.10,
        ("prefix_probe_accuracy", "prefix_probes"),
    ),
)
ALL_LENGTHS = replace(  # prefix_probe in the form published before the rule's (docs/protocol.md, "Claim forms")
    SPECS[1],
    description="smallest over the prefix lengths l (those with two classes, 2..7 at the study's sizes; in the parts) "
    "of the study's prefix probe's validation accuracy (2-D projection + MLP, the first l brackets of the task's "
    "string) minus the same probe's on shuffled labels, at the study's block at the same relative depth (5 of 6), "
    "resid_mid (layer and site in the parts), in-distribution sequences, at the highest k of the grid",
)
CLAIM_SITE = "resid_post"  # the site of the M1 block the earlier linear probes and their figures read


def p0_failure(
    recipe: str, residual: Sequence[float], layer: int, references: dict[str, float], natural_cells: float
) -> Claim:
    """E4's P0 failure on one seed: ``residual`` E4's residual variance ratio per bracket index at
    the protocol's ``dyck_p0_site`` of its M1 block ``layer`` (``studies.e4.variance``), its median over the brackets
    [ours] divided by the largest of ``references`` {recipe: 1 - P0 as its M1 claim reads it};
    ``natural_cells``, the earlier construction's ratio (``natural_cells_ratio``), written beside."""
    e4_share = statistics.median(residual)
    reference_share = max(references.values())
    return SPECS[0].judge(
        recipe,
        e4_share / reference_share,
        {
            "e4_share": e4_share,
            "reference_share": reference_share,
            "layer": layer,
            "site": active().dyck_p0_site,
            "brackets": len(residual),
            **{f"{ref}_share": share for ref, share in references.items()},
            "natural_cells_ratio": natural_cells,
        },
    )


def natural_cells_ratio(shares: dict[str, list[float]], layer: int, references: dict[str, int]) -> float:
    """The earlier construction of E4's P0 failure: from ``shares`` {series: within-cell share per
    layer} at ``CLAIM_SITE`` on natural states per late position, E4's smaller grouping in its
    bracket phase at ``layer`` over the larger (task, token) share of ``references`` {recipe: its M1
    block}."""
    e4_share = min(shares["e4_token_due"][layer], shares["e4_last3_due"][layer])
    return e4_share / max(shares[ref][at] for ref, at in references.items())


def prefix_probe(
    recipe: str,
    accuracy: dict[int, float],
    control: dict[int, float],
    reached: int,
    layer: int,
    site: str,
    diversity: int,
    linear_gain: float,
    lengths: dict[str, dict[int, tuple[bool, float]]],
) -> Claim:
    """The prefix probe's claim on one seed: the smallest over prefix lengths l of the study's probe's
    validation ``accuracy`` {l: accuracy} minus ``control``'s (the same probe on shuffled labels
    [ours]), at (``layer``, ``site``); ``reached``, the longest length its curriculum trained, and
    ``linear_gain``, the earlier construction's value (the weakest linear probe's score minus its
    control, ``weakest_probe``), written beside. Under the protocol's ``prefix_probe_form``
    "trained-lengths" only the lengths whose head the kept probe had trained are read (``lengths``
    {probe or control: {l: (trained at the kept snapshot, chance level)}}), each against the control's
    accuracy where its kept snapshot trained l, else the chance level; a length whose chance level
    exceeds 0.9 is not read (its gap cannot reach 0.1)."""
    beside = {"curriculum_reached": reached, "layer": layer, "site": site, "linear_probe_gain": linear_gain}
    if active().prefix_probe_form == "all-lengths":
        gains = {length: accuracy[length] - control[length] for length in accuracy}
        weakest = min(gains, key=lambda length: _nan_smallest(gains[length]))
        return ALL_LENGTHS.judge(
            recipe,
            gains[weakest],
            {
                "lengths": f"{min(gains)}..{max(gains)}",
                "diversity": diversity,
                "length": weakest,
                "accuracy": accuracy[weakest],
                "control": control[weakest],
                **beside,
            },
        )
    read, baseline, skipped = trained_lengths(control, lengths)
    parts = {"diversity": diversity, "finished": reached == max(accuracy), **skipped, **beside}
    if not read:
        return SPECS[1].judge(recipe, math.nan, parts, "the kept probe trained no length whose gap can reach 0.1")
    gains = {length: accuracy[length] - baseline[length] for length in read}
    weakest = min(gains, key=lambda length: _nan_smallest(gains[length]))
    return SPECS[1].judge(
        recipe,
        gains[weakest],
        {
            "lengths": ",".join(map(str, read)),
            "length": weakest,
            "accuracy": accuracy[weakest],
            "control": baseline[weakest],
            **parts,
        },
    )


def trained_lengths(
    control: dict[int, float], lengths: dict[str, dict[int, tuple[bool, float]]]
) -> tuple[list[int], dict[int, float], dict[str, str]]:
    """(the lengths read, {length: its baseline}, the parts saying what was left out) of the prefix probe
    in the rule's form: the lengths whose head the kept probe had trained (``lengths["probe"]``: {l:
    (trained at the kept snapshot, chance level)}), but those whose chance level exceeds 0.9 (their gap
    cannot reach 0.1); each against the control's accuracy where the control's kept snapshot trained it,
    else the chance level."""
    trained = [length for length, (yes, _) in sorted(lengths["probe"].items()) if yes]
    crowded = [length for length in trained if lengths["probe"][length][1] > 1 - SPECS[1].threshold]
    read = [length for length in trained if length not in crowded]
    baseline = {n: control[n] if lengths["control"][n][0] else lengths["probe"][n][1] for n in read}
    return (
        read,
        baseline,
        {
            "lengths_trained": ",".join(map(str, trained)),
            "lengths_not_read_chance_above_0.9": ",".join(map(str, crowded)),
            "controls_at_chance": ",".join(str(n) for n in read if not lengths["control"][n][0]),
        },
    )


def _nan_smallest(value: float) -> float:
    """value, or -inf for NaN: the ordering that makes a NaN the smallest, so that it reaches the claim."""
    return -math.inf if math.isnan(value) else value


def _gain(row: dict) -> float:
    return _nan_smallest(row["score"] - row["control"])


def weakest_probe(rows: Sequence[dict], layer: int, site: str = CLAIM_SITE) -> dict:
    """The target whose probe at (``layer``, ``site``) beats its shuffled-label control by the least:
    {target, layer, score, control, gain} (gain = score - control). A NaN gain counts as the
    smallest, so that it reaches the claim (which NaN never passes)."""
    read = [r for r in rows if r["site"] == site and r["layer"] == layer]
    if not read:
        raise ValueError(f"no probe rows at layer {layer}, site {site!r}")
    row = min(read, key=_gain)
    return {
        "target": row["target"],
        "layer": row["layer"],
        "score": row["score"],
        "control": row["control"],
        "gain": row["score"] - row["control"],
    }

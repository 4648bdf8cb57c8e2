"""The earlier conventions of this project, kept computable by name (docs/protocol.md#variants).

The claims are measured one way, the study's (docs/protocol.md); each ``Variant`` here names one earlier
choice that the API (``variant="..."``) and ``taskgeom sensitivity`` can measure instead, on the
same runs, so a reader sees how a verdict depends on it. No variant ever decides a claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from taskgeom.errors import AnalysisError


@dataclass(frozen=True)
class Variant:
    """One earlier convention: its ``name``, the ``claims`` (id prefixes) it can move, what it
    ``changes`` from the protocol and ``why`` it existed. A variant of the data has ``overrides``: the
    ``--set`` values that train its runs from the recipe (the same in every profile); one of the
    measurement has none."""

    name: str
    claims: tuple[str, ...]
    changes: str
    why: str
    overrides: tuple[str, ...] = ()


VARIANTS = (
    Variant(
        "selected-place",
        ("P0", "P1", "P2", "P3", "steering", "projection_r2"),
        "the place (layer, site) of best R^2_task on a selection batch, both sites, instead of the fixed block at resid_post",
        "chose the layer by the data when the study's block did not exist at quick sizes",
    ),
    Variant(
        "site-mid",
        ("P0", "P1", "P2", "P3", "steering", "projection_r2"),
        "every readout at resid_mid (after attention) instead of resid_post",
        "the specification once named both sites as candidates",
    ),
    Variant(
        "natural-cells",
        ("P0", "P1", "P2"),
        "P0-P2 of a token family on natural states: P0/P1 grouped by the token that occurred, the median over the late window of "
        "the layout at each position, and P2's r2_additive on the measurement batch, instead of the study's forced-token cells "
        "(P0/P1 at the last position it reads)",
        "our reading before the study's compute_hiddens_token_conditioned_coin was read",
    ),
    Variant(
        "p3-late-window",
        ("P3",),
        "P3 on the two-way layout's task vectors over the task-vector window (the token effect removed), the mean over every major "
        "task and the last quarter of the context, instead of the study's trajectory figure (task 0, vectors averaged over "
        "positions 40-59, the last quarter of its plotted positions 0-59)",
        "our reading before the study's traj_averaging_projection_plot was read",
    ),
    Variant(
        "pooled-anova",
        ("P0", "P1"),
        "P0/P1 pooled over the late window with no position term (the drift of mu_t counted as within-cell variance)",
        "our first reading of the two-way layout",
    ),
    Variant(
        "per-sequence-r2",
        ("projection_r2",),
        "projection R^2 of each sequence's own state over the late window, centred by mu_t + nu(x_t), "
        "regressed on the span of theta_(k, x_t)",
        "scored single states, as a probe would read them",
    ),
    Variant(
        "centred-S",
        ("ablate_S",),
        "S ablation h - P_S (h - mu_t) on the rank K-1 span of the task vectors, at the selected place",
        "the task subspace of the M1 geometry rather than a probe's row space",
    ),
    Variant(
        "s-with-mean",
        ("ablate_S", "ablate_V", "random_control"),
        "S of rank K from the minimum-norm probe with every posterior column beside the token one-hot and an intercept, "
        "over the late window: the task contrasts and about the mean state; V and the random controls avoid it",
        "the protocol before 2026-12-02, a misreading of the study's probe, which drops the redundant column of each one-hot group",
    ),
    Variant(
        "probe-exact",
        ("ablate_S", "ablate_V", "random_control"),
        "the S probe by an exact double-precision least-squares fit (the minimum-norm solution) instead of the study's "
        "_fit_ols, a single-precision pseudo-inverse at torch's default cut-off; V and the random controls avoid it",
        "our fit before the study's _fit_ols was read: the exact solution of the same regression",
    ),
    Variant(
        "v-avoids-tokens",
        ("ablate_V", "random_control"),
        "E1 and E2's V also kept out of the token subspace",
        "kept V from removing what the current token carries",
    ),
    Variant(
        "v-searched-on-ood",
        ("ablate_V",),
        "V searched on OOD sequences instead of minor (pool) sequences",
        "searched where the claim is read",
    ),
    Variant(
        "v-best-block",
        ("ablate_V", "random_control"),
        "V read at the block where it removes the most OOD gain on a separate batch, not the mean over blocks",
        "one place per claim, as for M1",
    ),
    Variant(
        "p2-task-only",
        ("P2",),
        "P2 as R^2_task, the token effect removed from the total (and P2.vs_random as R^2_task minus a random subspace's), "
        "instead of the study's r2_additive, where the token effect counts as explained",
        "our reading of P2 before the study's figure code was read (its plots='additive')",
    ),
    Variant(
        "steer-at-read-site",
        ("steering",),
        "steering's vectors from the measurement batch's two-way layout (E1: its per-position task means; E2, E3: the late "
        "window's task effects), the edit written at resid_post, where they are read, on the measurement batch",
        "the specification once wrote the edit where the vectors are read; the study hooks the attention sub-block (resid_mid)",
    ),
    Variant(
        "e1-v6",
        ("e1",),
        "E1 at V = 6 faces with near-disjoint majors (the earlier default recipe)",
        "a smaller vocabulary trained faster at quick sizes",
        ("task.vocab_size=6", "task.majors=disjoint"),
    ),
    Variant(
        "separator",
        ("e2",),
        "E2's x, separator, y layout, the prediction of y read at the separator",
        "the separator layout of the study's code, our earlier default",
        ("task.layout=separator",),
    ),
)

BY_NAME = {v.name: v for v in VARIANTS}
DATA_VARIANTS = tuple(
    v.name for v in VARIANTS if v.overrides
)  # train runs of their own: `taskgeom reproduce --variant`


def variant(name: str | None) -> Variant | None:
    """The variant called ``name`` (None: the study's protocol); an unknown name is an error that lists them."""
    if name is None or name == "protocol":
        return None
    if name not in BY_NAME:
        raise AnalysisError(f"unknown variant {name!r}: choose 'protocol' or one of {', '.join(BY_NAME)}")
    return BY_NAME[name]

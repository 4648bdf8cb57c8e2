"""The earlier conventions of this project kept computable by name (docs/protocol.md#variants).

The claims are measured one way, the study's (``analysis.protocol.STUDY``, or the active protocol
with a profile's sample sizes); each ``Variant`` here is a named copy of that protocol with the fields it changes (``Variant.protocol``) and the reason it
existed, so the API (``protocol=tg.protocol("...")``) and ``taskgeom sensitivity`` can measure it on
the same runs and a reader sees how a verdict depends on it. A variant of the data changes no field:
it trains other runs (``overrides``); a judged variant (``Variant.judged``) changes only the claims'
forms (``protocol.JUDGED``) and judges the stored analyses again (``taskgeom rejudge``). No variant
ever decides a claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from taskgeom.analysis.protocol import EARLIER, JUDGED, Protocol, active
from taskgeom.errors import AnalysisError


@dataclass(frozen=True)
class Variant:
    """One earlier convention: its ``name``, the ``claims`` it can move (``moves``), the protocol's
    ``fields`` it changes, what that means in words (``changes``) and ``why`` it existed. A variant of
    the data has ``overrides``: the ``--set`` values that train its runs from the recipe (the same in
    every profile); one of the measurement has ``fields``, and ``again`` when ``taskgeom sensitivity``
    measures it again on each run (its searches and ablations are not stored) rather than reading
    the stored analyses."""

    name: str
    claims: tuple[str, ...]
    changes: str
    why: str
    overrides: tuple[str, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict)
    again: bool = False

    def moves(self, claim: str) -> bool:
        """Whether it can move the claim named ``claim`` (its id after the recipe: ``P2.vs_random``,
        ``ablate_S_ood``): one of ``claims``, or ``claims`` names its family with a final ``_*``
        (``ablate_S_*`` for ``ablate_S_major`` and ``ablate_S_ood``; ``P0`` is P0 alone, not E4's
        ``P0_failure``)."""
        return any(claim == name or name.endswith("_*") and claim.startswith(name[:-1]) for name in self.claims)

    @property
    def judged(self) -> bool:
        """Whether it changes only how claims are judged from stored rows (``protocol.JUDGED``): the same
        stored analyses, judged again (``taskgeom rejudge``)."""
        return bool(self.fields) and set(self.fields) <= set(JUDGED)

    @property
    def protocol(self) -> Protocol:
        """The active protocol (the study's, or a profile's sample sizes) with this variant's ``fields``."""
        return replace(active(), **self.fields)


def _earlier(*names: str) -> dict[str, Any]:
    """{field: its value before 2026-12-08} (``protocol.EARLIER``) for the fields ``names``: the
    fields of a variant that puts back an earlier claim form or V search."""
    return {name: EARLIER[name] for name in names}


VARIANTS = (
    Variant(
        "selected-place",
        ("P0", "P1", "P2", "P2.vs_random", "P3", "P3.shrinks", "steering", "projection_r2_*"),
        "the place (layer, site) of best R^2_task on a selection batch, both sites, instead of the fixed block at resid_post",
        "chose the layer by the data when the study's block did not exist at quick sizes",
        fields={"place": "selected"},
    ),
    Variant(
        "site-mid",
        ("P0", "P1", "P2", "P2.vs_random", "P3", "P3.shrinks", "steering", "projection_r2_*"),
        "every readout at resid_mid (after attention) instead of resid_post",
        "the specification once named both sites as candidates",
        fields={"read_site": "resid_mid"},
    ),
    Variant(
        "natural-cells",
        ("P0", "P1", "P2", "P2.vs_random"),
        "P0-P2 of a token family on natural states: P0/P1 grouped by the token that occurred, the median over the late window of "
        "the layout at each position, and P2's r2_additive on the measurement batch, instead of the study's forced-token cells "
        "(P0/P1 at the last position it reads)",
        "our reading before the study's compute_hiddens_token_conditioned_coin was read",
        fields={"cells": "natural"},
    ),
    Variant(
        "p3-late-window",
        ("P3",),
        "P3 on the two-way layout's task vectors over the task-vector window (the token effect removed), the mean over every major "
        "task and the last quarter of the context, instead of the study's trajectory figure (task 0, vectors averaged over "
        "positions 40-59, the last quarter of its plotted positions 0-59)",
        "our reading before the study's traj_averaging_projection_plot was read",
        fields={"p3": "late-window"},
    ),
    Variant(
        "pooled-anova",
        ("P0", "P1"),
        "P0/P1 pooled over the late window with no position term (the drift of mu_t counted as within-cell variance)",
        "our first reading of the two-way layout",
        fields={"anova": "pooled"},
    ),
    Variant(
        "per-sequence-r2",
        ("projection_r2_*",),
        "projection R^2 of each sequence's own state over the late window, centred by mu_t + nu(x_t), "
        "regressed on the span of theta_(k, x_t)",
        "scored single states, as a probe would read them",
        fields={"projection": "per-sequence"},
    ),
    Variant(
        "centred-S",
        ("ablate_S_*",),
        "S ablation h - P_S (h - mu_t) on the rank K-1 span of the task vectors, at the selected place",
        "the task subspace of the M1 geometry rather than a probe's row space",
        fields={"s_probe": "centred"},
        again=True,
    ),
    Variant(
        "s-with-mean",
        ("ablate_S_*",),
        "S of rank K from the minimum-norm probe with every posterior column beside the token one-hot and an intercept, "
        "over the late window: the task contrasts and about the mean state",
        "the protocol before 2026-12-02, a misreading of the study's probe, which drops the redundant column of each one-hot group",
        fields={"s_probe": "with-mean"},
        again=True,
    ),
    Variant(
        "probe-exact",
        ("ablate_S_*",),
        "the S probe by an exact double-precision least-squares fit (the minimum-norm solution) instead of the study's "
        "_fit_ols, a single-precision pseudo-inverse at torch's default cut-off",
        "our fit before the study's _fit_ols was read: the exact solution of the same regression",
        fields={"s_probe": "exact"},
        again=True,
    ),
    Variant(
        "v-avoids-tokens",
        ("ablate_V_*", "random_control"),
        "E1 and E2's V also kept out of the token subspace",
        "kept V from removing what the current token carries",
        fields={"v_always_avoids_tokens": True},
        again=True,
    ),
    Variant(
        "v-searched-on-minors",
        ("ablate_V_*",),
        "V searched on fresh minor (pool) sequences, OOD ones at k = -1, instead of the evaluation set's 30 OOD tasks",
        "our search before the study's default target (optimal_orth.py's opt_target='ood') was read; the study's "
        "opt_target='minor' branch, the authors' phrase 'optimised to disrupt minor-task prediction'",
        fields=_earlier("v_search_set"),
        again=True,
    ),
    Variant(
        "v-searched-on-ood",
        ("ablate_V_*",),
        "V searched on OOD sequences of fresh tasks (a new task per sequence) instead of the evaluation set's 30 OOD tasks",
        "searched where the claim is read, before the study's evaluation sampler was read",
        fields={"v_search_set": "ood"},
        again=True,
    ),
    Variant(
        "v-avoids-major-span",
        ("ablate_V_*", "random_control"),
        "V (and the random controls) kept out of the ablations' probe's span (S: E1's posterior cut to the majors, rank "
        "K - 1; E3's probe to the end of the sequence with its W_tok span) instead of the study's own search probe's",
        "our span before the study's optimal_orth.py was read, which builds U_orth from a probe of its own",
        fields=_earlier("v_span"),
        again=True,
    ),
    Variant(
        "v-earlier-search",
        ("ablate_V_*", "random_control"),
        "V searched as this project searched before the study's default was published: on minor sequences, kept out of the "
        "ablations' probe's span (v-searched-on-minors and v-avoids-major-span together)",
        "the V search of every publication before the study's default search (docs/protocol.md, the V search)",
        fields=_earlier("v_search_set", "v_span"),
        again=True,
    ),
    Variant(
        "v-best-block",
        ("ablate_V_*", "random_control"),
        "V read at the block where it removes the most OOD gain on a separate batch, not the mean over blocks",
        "one place per claim, as for M1",
        fields={"v_block": "best"},
        again=True,
    ),
    Variant(
        "p2-task-only",
        ("P2", "P2.vs_random"),
        "P2 as R^2_task, the token effect removed from the total (and P2.vs_random as R^2_task minus a random subspace's), "
        "instead of the study's r2_additive, where the token effect counts as explained",
        "our reading of P2 before the study's figure code was read (its plots='additive')",
        fields={"p2": "task-only"},
    ),
    Variant(
        "steer-at-read-site",
        ("steering",),
        "steering's vectors from the measurement batch's two-way layout (E1: its per-position task means; E2, E3: the late "
        "window's task effects), the edit written at resid_post, where they are read, on the measurement batch",
        "the specification once wrote the edit where the vectors are read; the study hooks the attention sub-block (resid_mid)",
        fields={"steering_vectors": "read-place"},
    ),
    Variant(
        "absolute-drop",
        ("projection_r2_drop",),
        "projection_r2_drop as the absolute drop r2(k=-1) - r2(k_top) >= 0.4 instead of the share of its start lost "
        "(the absolute drop cannot exceed its start, so a start below 0.4 fails whatever happens)",
        "the form published before the rule (docs/protocol.md, claim forms)",
        fields=_earlier("drop_form"),
    ),
    Variant(
        "p2-vs-random-difference",
        ("P2.vs_random",),
        "P2.vs_random as the difference r2 - r2_random (whose ceiling is 1 - r2_random) instead of the partial R^2 "
        "beyond the random subspace",
        "the form published before the rule",
        fields=_earlier("p2_random_form"),
    ),
    Variant(
        "ood-between-g-interval",
        ("ood_between",),
        "e2.ood_between as |g - 1/2| <= 1/2 (which puts the ideal, dMMSE, on its boundary) instead of between ridge and "
        "dMMSE with bayes_optimal's tolerance at each end",
        "the form published before the rule",
        fields=_earlier("ood_between_form"),
    ),
    Variant(
        "p3-shrinks-on-mean-curves",
        ("P3.shrinks",),
        "P3.shrinks on P3's per-task mean curves of the earlier construction (late TV over early TV, unfloored) instead "
        "of on the trajectory P3 reads",
        "the form published before the rule",
        fields=_earlier("p3_shrinks_form"),
    ),
    Variant(
        "e2-p0-late-median",
        ("P0", "P1"),
        "E2's P0 and P1 as the median over the late window of the measurement batch instead of the ANCOVA at the last "
        "analysed position on cell_sequences paired sequences a major task",
        "the form published before the audit read the study's table",
        fields=_earlier("e2_p0_form"),
    ),
    Variant(
        "prefix-all-lengths",
        ("prefix_probe",),
        "e4.prefix_probe as the smallest gap over every length 1-7 against the control, trained or not, instead of the "
        "lengths whose head the kept probe had trained",
        "the form published before the rule",
        fields=_earlier("prefix_probe_form"),
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
DATA_VARIANTS = tuple(v.name for v in VARIANTS if v.overrides)  # runs of their own: `taskgeom reproduce --variant`
STORED_VARIANTS = tuple(
    v.name for v in VARIANTS if v.fields and not v.again and not v.judged
)  # read from the stored analyses
JUDGED_VARIANTS = tuple(
    v.name for v in VARIANTS if v.judged
)  # a reproduction's claims judged again: `taskgeom rejudge`
MEASURED_AGAIN = tuple(v.name for v in VARIANTS if v.again)  # measured again on each run by `taskgeom sensitivity`


def protocol(name: str | None = None) -> Protocol:
    """The protocol of variant ``name`` (None or "protocol": the active one, ``STUDY`` unless a profile
    set its sample sizes); an unknown name, or a variant of the data (other runs, the same protocol), is
    an error that lists the variants of the measurement."""
    if name is None or name == "protocol":
        return active()
    if name not in BY_NAME or BY_NAME[name].overrides:
        measured = ", ".join(v.name for v in VARIANTS if not v.overrides)
        raise AnalysisError(f"no variant of the measurement {name!r}: choose 'protocol' or one of {measured}")
    return BY_NAME[name].protocol

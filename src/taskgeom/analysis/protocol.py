"""The measurement protocol as one frozen value: every choice the stored analyses make (sites,
blocks, windows, cell design, sample sizes, cut-offs, factors), with the study's settings as the
defaults (docs/protocol.md says where each comes from).

``STUDY`` is the study's protocol. The analyses run under the ``active()`` one: ``STUDY`` unless a
reproduction measures under a profile's (its ``measure: {protocol: {...}}`` section: the smoke
profile's small samples, ``Protocol.changed``) inside ``measured_under``. The modules that measure
read their choices from it when they measure, never at import, and every stored analysis is keyed by
its ``digest()`` (``analysis.stored.keys``), so a changed choice is measured again by construction; the
claims' forms (``JUDGED``) are read only when a claim is judged and stay out of the digest. A
variant (``analysis.measures.variants``) is a named copy of the active protocol with the fields it
changes; the functions that can measure one take a ``protocol``. Memory-only sizes (chunks of a
forward pass) are not choices and stay where they are used.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator


@dataclass(frozen=True)
class PrefixProbeSettings:
    """The arguments ``fig_dyck_combined.py`` passes to ``run_prefix_probe`` (and ``train_prefix_probe``'s
    defaults it keeps): E4's prefix probe."""

    epochs: int = 2000
    lr: float = 3e-3
    proj_lr_scale: float = 0.1
    proj_dim: int = 2
    mlp_hidden: int = 64
    mini_batch: int = 512
    samples_per_class: int = 512
    refresh_every: int = 2
    curriculum_threshold: float = 0.1
    loss_threshold: float = 6e-3
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    eval_every: int = 10


@dataclass(frozen=True)
class Protocol:
    """Every measurement choice of the stored analyses (module docstring); the defaults are the study's."""

    # where M1 looks and its selection batch
    sites: tuple[str, ...] = ("resid_mid", "resid_post")
    selection_sequences: int = 512
    # P0-P2 on the forced-token cells: the study's batch_size for P0/P1 (fig_task_vector_r2_combined.py)
    # and for P2 (fig_averaging_r2_combined.py)
    cell_sequences: int = 1024
    p2_cell_sequences: int = 256
    # P3 as the trajectory figure: its B, _ESTIM_POSITIONS, _PLOT_POSITIONS, _TASK_IDS
    trajectory_per_task: int = 1024
    trajectory_estimation: range = range(40, 60)
    trajectory_plotted: range = range(60)
    trajectory_tasks: tuple[int, ...] = (0,)
    # P3.shrinks and the KL of P3: uncertain positions, and the uniform law mixed into beta [ours]
    uncertain_below: float = 0.99
    min_uncertain_positions: int = 5
    kl_floor: float = 1e-3
    # steering as the study's injection: where it writes, what it edits, on how many sequences
    steering_write_site: str = "resid_mid"
    steering_sequences: int = 10_000
    steering_estimation_per_task: int = 1024
    steering_estimation: range = range(25, 40)
    steering_span: int = 40
    steering_task_positions: range = range(25, 40)
    steering_subspace_positions: range = range(0, 40)
    # the one rank cut-off: singular values below this fraction of the largest are cut (the task vectors'
    # span and its check, steering's span, the probe's S, the spans V avoids)
    rank_cut: float = 1e-6
    # the study's probe (S): its fit split and sample
    probe_sequences: int = 5056
    probe_fit_share: float = 0.8
    probe_sums_to_one: float = 1e-4
    # the dual analysis: evaluation sets, the OOD prior, the transition, Fig. 4's own draw
    eval_sequences: int = 512
    geometry_sequences: int = 256  # the dual analysis' geometry batch (major and OOD) [ours]
    search_steps: int = 200  # the orthogonal search's steps (the study's n_steps)
    loss_ood_tasks: int = 30
    prior_tasks: int = 2048
    transition_sequences: int = 1024
    transition_eps: float = 1e-12
    projection_study_sizes: tuple[int, int] = (128, 128)
    # the ablations and the orthogonal search
    ablation_site: str = "resid_mid"
    random_controls: int = 5
    control_quantile: float = 0.75
    search_batch: int = 32
    token_share: float = 0.9
    min_reliable_gain: float = 0.05
    # E4: P0 as the study's variance.py, its prefix probe, the planted-bracket probes
    dyck_p0_masks: int = 30
    dyck_p0_per_mask: int = 2048
    dyck_p0_prefix_k: int = 3
    dyck_p0_site: str = "resid_mid"
    dyck_probe_masks: int = 10
    dyck_probe_per_mask: int = 32
    dyck_probe_max_prefix: int = 7
    dyck_probe_block: tuple[int, int] = (5, 6)
    dyck_probe_site: str = "resid_mid"
    dyck_prefix_probe: PrefixProbeSettings = field(default_factory=PrefixProbeSettings)
    dyck_max_back: int = 7
    dyck_probe_sequences: int = 256
    dyck_natural_p0_sequences: int = 1024  # [ours] the earlier P0 layouts (E4's bracket phase keeps a fraction)
    # the choices the variants change (analysis.measures.variants); the study's here
    place: str = "fixed"  # "fixed": the study's block; "selected": best R^2_task on the selection batch
    read_site: str | None = None  # None: each readout at its own site (the study's); a site: every readout there
    cells: str = "forced"  # P0-P2 on the study's forced-token cells, or "natural" states grouped by their token
    anova: str = "per-position"  # the two-way layout at each position, or "pooled" over the late window
    p2: str = "additive"  # the study's r2_additive, or "task-only" (R^2_task, the token effect removed)
    p3: str = "trajectory"  # the study's trajectory figure, or "late-window" (every task, the last quarter)
    projection: str = "task-means"  # Fig. 4's task means, or "per-sequence" (each late OOD state)
    s_probe: str = "study"  # the study's _fit_ols probe, or "exact", "with-mean", "centred" (docs/protocol.md#variants)
    v_always_avoids_tokens: bool = False  # V kept out of the token subspace for every family, not only E3
    v_search_set: str = "eval-ood"  # V ascended on the eval set's OOD tasks, "minor" sequences, "ood" (fresh tasks)
    v_span: str = "search-probe"  # V avoids the study's own search probe's span, or "ablation-probe" (the S probe's)
    v_block: str = "mean"  # V's share the mean over blocks, or "best" (one block, chosen on a separate batch)
    steering_vectors: str = "estimated"  # the study's injection, or "read-place" (the measured layout, written there)
    # the claims' forms: how five claims are judged from what is stored (``JUDGED``: read when a claim is
    # judged, never when measuring, so kept out of the digest); docs/protocol.md, "Claim forms"
    drop_form: str = "share"  # projection_r2_drop: the share of r2(k=-1) lost, or "absolute", r2(k=-1) - r2(k_top)
    p2_random_form: str = "partial"  # P2.vs_random: the partial R^2 beyond the random subspace, or "difference"
    ood_between_form: str = "segment"  # e2.ood_between: ridge..dMMSE with a 10% tolerance each end, or "g-interval"
    p3_shrinks_form: str = "trajectory"  # P3.shrinks: on the trajectory P3 reads, or "mean-curves" (per-task means)
    prefix_probe_form: str = "trained-lengths"  # e4.prefix_probe: the kept probe's trained lengths, or "all-lengths"
    e2_p0_form: str = "last-position"  # E2's P0, P1: the study's last position, or "late-median" (the late window)

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"protocol field {name}={getattr(self, name)!r}: choose one of {list(allowed)}")

    def digest(self) -> str:
        """12 hex digits of the sha256 of every field but the claims' forms (``JUDGED``; ranges as
        [start, stop, step]): what a stored result measured under this protocol is keyed by."""
        measured = {name: value for name, value in asdict(self).items() if name not in JUDGED}
        text = json.dumps(measured, sort_keys=True, default=lambda r: [r.start, r.stop, r.step])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def changed(self, changes: dict[str, Any]) -> "Protocol":
        """A copy with ``changes`` {field: value} of its sample sizes (``SAMPLE_SIZES``), as a profile's
        ``measure: {protocol: {...}}`` writes them (a mapping for the prefix probe's settings, a list
        for a pair); ValueError naming a field that is no sample size or a value of the wrong kind."""
        values = {}
        for name, value in changes.items():
            if name not in SAMPLE_SIZES:
                raise ValueError(
                    f"protocol field {name!r} is no sample size a profile may set; those are: {', '.join(SAMPLE_SIZES)}"
                )
            current = getattr(self, name)
            if isinstance(current, PrefixProbeSettings) and isinstance(value, dict):
                try:
                    value = replace(current, **value)
                except TypeError as err:
                    raise ValueError(f"protocol field {name}: {err}") from None
            elif isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)
            if type(value) is not type(current) or isinstance(value, tuple) and len(value) != len(current):
                raise ValueError(f"protocol field {name}: {value!r} is not like {current!r}")
            if any(size < 1 for size in (value if isinstance(value, tuple) else (value,)) if isinstance(size, int)):
                raise ValueError(f"protocol field {name}: a sample size is at least 1, got {value!r}")
            values[name] = value
        return replace(self, **values)


# The fields that are sample sizes (sequences, tasks, steps), read when the analyses measure: what a
# profile may set (``Protocol.changed``), to measure the study's functions on fewer draws
SAMPLE_SIZES = (
    "cell_sequences",
    "p2_cell_sequences",
    "trajectory_per_task",
    "steering_sequences",
    "steering_estimation_per_task",
    "probe_sequences",
    "eval_sequences",
    "geometry_sequences",
    "search_steps",
    "search_batch",
    "loss_ood_tasks",
    "prior_tasks",
    "transition_sequences",
    "projection_study_sizes",
    "selection_sequences",
    "dyck_p0_masks",
    "dyck_p0_per_mask",
    "dyck_probe_masks",
    "dyck_probe_per_mask",
    "dyck_probe_sequences",
    "dyck_natural_p0_sequences",
    "dyck_prefix_probe",
)
CHOICES: dict[str, tuple] = {  # the fields that name a construction, and the ones each may name
    "place": ("fixed", "selected"),
    "read_site": (None, "resid_mid", "resid_post"),
    "cells": ("forced", "natural"),
    "anova": ("per-position", "pooled"),
    "p2": ("additive", "task-only"),
    "p3": ("trajectory", "late-window"),
    "projection": ("task-means", "per-sequence"),
    "s_probe": ("study", "exact", "with-mean", "centred"),
    "v_search_set": ("minor", "ood", "eval-ood"),
    "v_span": ("ablation-probe", "search-probe"),
    "v_block": ("mean", "best"),
    "steering_vectors": ("estimated", "read-place"),
    "drop_form": ("absolute", "share"),
    "p2_random_form": ("difference", "partial"),
    "ood_between_form": ("g-interval", "segment"),
    "p3_shrinks_form": ("mean-curves", "trajectory"),
    "prefix_probe_form": ("all-lengths", "trained-lengths"),
    "e2_p0_form": ("late-median", "last-position"),
}
# The fields read only where a claim is judged from stored rows: a stored result does not depend on them
JUDGED = ("drop_form", "p2_random_form", "ood_between_form", "p3_shrinks_form", "prefix_probe_form", "e2_p0_form")
STUDY = Protocol()
# The fields whose default changed on 2026-12-08 (the claim forms of the rule and the study's V search,
# docs/protocol.md), at the values every reproduction before then measured and judged under: what a
# manifest of format 6 or earlier (``report.manifest``) was measured and judged under
EARLIER = {
    "v_search_set": "minor",
    "v_span": "ablation-probe",
    "drop_form": "absolute",
    "p2_random_form": "difference",
    "ood_between_form": "g-interval",
    "p3_shrinks_form": "mean-curves",
    "prefix_probe_form": "all-lengths",
    "e2_p0_form": "late-median",
}
_ACTIVE: ContextVar[Protocol] = ContextVar("protocol", default=STUDY)


def active() -> Protocol:
    """The protocol the analyses measure under now: ``STUDY`` outside ``measured_under``."""
    return _ACTIVE.get()


@contextmanager
def measured_under(protocol: Protocol) -> Iterator[Protocol]:
    """Run the block's analyses under ``protocol`` (``active()`` returns it there)."""
    token = _ACTIVE.set(protocol)
    try:
        yield protocol
    finally:
        _ACTIVE.reset(token)

"""The measurement protocol as one frozen value: every choice the stored analyses make (sites,
blocks, windows, cell design, sample sizes, cut-offs, factors), with the study's settings as the
defaults (docs/protocol.md says where each comes from).

``STUDY`` is the protocol the analyses run under; the modules that measure read their choices from
it, and every stored analysis is keyed by ``STUDY.digest()`` (``analysis.stored.keys``), so a changed
choice is measured again by construction. Memory-only sizes (chunks of a forward pass) are not
choices and stay where they are used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


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
    cell_sequences: int = 1024
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
    steering_rank_cut: float = 1e-6
    # task vectors and the study's probe (S): rank cut-offs, its fit split and sample
    task_rank_tolerance: float = 1e-6
    probe_sequences: int = 5056
    probe_fit_share: float = 0.8
    probe_rank_tolerance: float = 1e-6
    probe_sums_to_one: float = 1e-4
    # the dual analysis: evaluation sets, the OOD prior, the transition, Fig. 4's own draw
    eval_sequences: int = 512
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
    span_rank_rtol: float = 1e-6
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

    def digest(self) -> str:
        """12 hex digits of the sha256 of every field (ranges as [start, stop, step]): what a stored
        result measured under this protocol is keyed by."""
        text = json.dumps(asdict(self), sort_keys=True, default=lambda r: [r.start, r.stop, r.step])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


STUDY = Protocol()

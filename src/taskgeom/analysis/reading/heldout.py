"""Held-out sequences by name: a fixed set of splits (``Split``), each a stream of the run's seed
that no training batch uses, and how a family's sequences enter the analysis (``family_inputs``).

A split names what its sequences are for, so an analysis and a researcher who ask for the same
split get the same sequences, and a typo is an error naming the allowed splits:

========================  ======================  =================================================
split                     sets (stream)            used for
========================  ======================  =================================================
``select``                major (m1-select)        choosing the place (highest R^2_task of P2)
``measure``               major (m1-measure)       P0-P3 and steering at that place (m1.json)
``geometry``              major (dual-geometry),   the task subspace of dual.json and its projection
                          ood (dual-geometry-ood)  R^2, V's probes
``loss``                  major, minor (dual),     losses and ablations of dual.json (the OOD
                          ood (dual-ood)           sequences from ``loss_ood_tasks`` tasks)
``search-select``         ood (dual-ood-search-    choosing the layer of V
                          select)
``prior``                 ood (dual-prior)         the OOD prediction map that d0 is estimated from
``projection``            major, ood (dual-        projection R^2 as the study's Fig. 4 measures it:
                          projection, -ood)        whole tasks, ``per_task`` sequences each
                                                   (``sample_tasks``)
``steering``              major (m1-steering)      the steering vectors and the steered sequences
``probe``                 major (probe)            the ablations' task probe S
                                                   (``analysis.measures.task_probe``)
``trajectory``            major (m1-trajectory)    P3 as the study's trajectory figure computes it:
                                                   whole tasks (``analysis.reading.trajectory``)
``transition``            mixture (dual-           the predictor transition: the training mixture
                          transition)              (tasks drawn by the pool's prior, minors too)
``cells``                 major (m1-cells)         E2's P0 and P1 at the last position, as the study's
                                                   table reads them: whole tasks, paired
========================  ======================  =================================================

E2's major sequences of ``select``, ``measure``, ``geometry`` and ``probe`` are paired: all K tasks share the
same x sequences (docs/protocol.md), so the x effects cancel when task means are subtracted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Literal, get_args

import torch

from taskgeom.analysis.measures.properties import Fit, stability, stability_linear
from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading.steering import PredictionReadout, Readout, TokenReadout
from taskgeom.errors import AnalysisError
from taskgeom.rng import generator
from taskgeom.tasks import FAMILIES, Batch, TaskFamily, TaskPool, TokenFamily

Kind = Literal["major", "minor", "ood", "mixture"]  # mixture: the pool's training mixture
KINDS: tuple[str, ...] = get_args(Kind)


class Split(str, Enum):
    """The held-out splits (module docstring)."""

    SELECT = "select"
    MEASURE = "measure"
    GEOMETRY = "geometry"
    LOSS = "loss"
    SEARCH_SELECT = "search-select"
    PRIOR = "prior"
    PROJECTION = "projection"
    STEERING = "steering"
    PROBE = "probe"
    TRAJECTORY = "trajectory"
    TRANSITION = "transition"
    CELLS = "cells"

    @classmethod
    def of(cls, split: "Split | str") -> "Split":
        """``split`` as a Split; AnalysisError naming the allowed ones for anything else."""
        try:
            return cls(split)
        except ValueError:
            raise AnalysisError(f"unknown split {split!r}; choose one of {[s.value for s in cls]}") from None


STREAMS: dict[tuple[Split, str], str] = {
    (Split.SELECT, "major"): "m1-select",
    (Split.MEASURE, "major"): "m1-measure",
    (Split.GEOMETRY, "major"): "dual-geometry",
    (Split.GEOMETRY, "ood"): "dual-geometry-ood",
    (Split.LOSS, "major"): "dual",
    (Split.LOSS, "minor"): "dual",
    (Split.LOSS, "ood"): "dual-ood",
    (Split.SEARCH_SELECT, "ood"): "dual-ood-search-select",
    (Split.PRIOR, "ood"): "dual-prior",
    (Split.PROJECTION, "major"): "dual-projection",
    (Split.PROJECTION, "ood"): "dual-projection-ood",
    (Split.STEERING, "major"): "m1-steering",
    (Split.PROBE, "major"): "probe",
    (Split.TRAJECTORY, "major"): "m1-trajectory",
    (Split.TRANSITION, "mixture"): "dual-transition",
    (Split.CELLS, "major"): "m1-cells",
}
PAIRED = (
    Split.SELECT,
    Split.MEASURE,
    Split.GEOMETRY,
    Split.PROBE,
)  # E2's major sequences of these are paired over tasks
# The protocol's ``loss_ood_tasks`` (``active()``), the study's n_ood: the OOD sequences of the ``loss``
# split come from 30 OOD tasks drawn once


def stream(split: "Split | str", kind: str) -> str:
    """The random stream of ``kind`` sequences of ``split``; AnalysisError for a combination that
    does not exist."""
    split = Split.of(split)
    if kind not in KINDS:
        raise AnalysisError(f"unknown set {kind!r}; choose one of {list(KINDS)}")
    if (split, kind) not in STREAMS:
        kinds = [k for s, k in STREAMS if s is split]
        raise AnalysisError(f"split {split.value!r} has no {kind} sequences; it has {kinds}")
    return STREAMS[(split, kind)]


def sample(
    family: TaskFamily, pool: TaskPool, kind: str, n: int, split: "Split | str", seq_len: int, seed: int
) -> Batch:
    """``n`` held-out ``kind`` sequences of ``split`` (module docstring)."""
    name, split = stream(split, kind), Split.of(split)
    if n < 1:
        raise AnalysisError(f"the number of sequences must be at least 1, got {n}")
    if kind == "ood":
        return family.sample_ood(n, seq_len, seed, 0, name, active().loss_ood_tasks if split is Split.LOSS else None)
    if kind == "minor" and not pool.n_minor:
        raise AnalysisError("this run's pool has no minor tasks (task.diversity = -1)")
    if kind == "major" and split in PAIRED:
        majors = pool.subset("major")
        batch = (
            family.sample_paired(majors, n, seq_len, seed, 0, name)
            if family.paired_batches
            else family.sample(pool, n, seq_len, seed, 0, name, "major")
        )
        if len(torch.unique(batch.task)) < majors.size:
            raise AnalysisError(f"{n} sequences do not cover all {majors.size} major tasks; ask for more")
        return batch
    return family.sample(pool, n, seq_len, seed, 0, name, "all" if kind == "mixture" else kind)


def sample_tasks(
    family: TaskFamily,
    pool: TaskPool,
    kind: str,
    per_task: int,
    split: "Split | str",
    seq_len: int,
    seed: int,
    n_tasks: int | None = None,
) -> Batch:
    """Whole tasks of ``split``, ``per_task`` held-out sequences each, rows ``j * per_task .. (j + 1)
    * per_task - 1`` of task j: ``n_tasks`` fresh OOD tasks, or every major task (``n_tasks`` None or
    K; E2's paired: the K tasks share their x sequences). A pure function of the arguments."""
    name = stream(split, kind)
    if per_task < 1:
        raise AnalysisError(f"the number of sequences per task must be at least 1, got {per_task}")
    if kind == "ood":
        if n_tasks is None or n_tasks < 1:
            raise AnalysisError(f"OOD tasks need a count n_tasks of at least 1, got {n_tasks}")
        return family.sample_ood_tasks(n_tasks, per_task, seq_len, seed, 0, name)
    if kind != "major":
        raise AnalysisError(f"whole tasks are drawn for the major or ood sets, not {kind}")
    majors = pool.subset("major")
    if n_tasks not in (None, majors.size):
        raise AnalysisError(f"the major set has {majors.size} tasks, not {n_tasks}")
    if family.paired_batches:
        return family.sample_paired(majors, majors.size * per_task, seq_len, seed, 0, name)
    task = torch.arange(majors.size).repeat_interleave(per_task)
    return family.make_batch(majors.params[task], task, seq_len, generator(seed, 0, f"{name}/tasks"))


def _supported(family: type[TaskFamily]) -> bool:
    """Whether the geometry analysis reads the family: a token family, or one whose model reads
    vectors (``reads_tokens`` False, with E2's interface: ``prediction_positions``, paired batches)."""
    return issubclass(family, TokenFamily) or not family.reads_tokens


def unsupported(family: TaskFamily) -> str | None:
    """Why the geometry analysis cannot read ``family`` (None when it can)."""
    if _supported(type(family)):
        return None
    names = sorted(name for name, cls in FAMILIES.items() if _supported(cls))
    return f"the geometry analysis supports the families {names}; {family.name!r} is not supported yet"


@dataclass(frozen=True)
class Inputs:
    """How a family's sequences enter the analysis. batch: the sequences; positions: [P] the model
    positions analysed (None: all); current: [N, P] tokens or [N, P, d] x_t there; fit: (h, task,
    current, K, window) -> Fit (P0/P1 and the task subspace); vocab: the token count (None for
    continuous x_t); alpha: [N, P, K] exact posterior over the majors; readout: what steering
    compares; effect: the token-effect model in words."""

    batch: Batch
    positions: torch.Tensor | None
    current: torch.Tensor
    fit: Callable[..., Fit]
    vocab: int | None
    alpha: torch.Tensor
    readout: Readout
    effect: str

    def select(self, h: torch.Tensor) -> torch.Tensor:
        """[N, P, D] the analysed positions of model states h: [N, T, D]."""
        return h if self.positions is None else h[:, self.positions]

    def model_positions(self, analysed: slice) -> slice | torch.Tensor:
        """The model positions of a slice of the analysed positions (what hooks edit)."""
        return analysed if self.positions is None else self.positions[analysed]


def family_inputs(family: TaskFamily, batch: Batch, majors: TaskPool) -> Inputs:
    """The one place the analysis depends on the family: the token-effect model and its
    companions (the token families read the current token; E2 its separators' x)."""
    if isinstance(family, TokenFamily):
        V = family.vocab_size

        def fit(h, task, current, K, window):
            return stability(h, task, current, K, V, window)

        return Inputs(
            batch,
            None,
            batch.tokens,
            fit,
            V,
            family.log_posterior(batch.tokens, majors).exp(),
            TokenReadout(family, batch.tokens, majors.params),
            "current token",
        )
    if not family.reads_tokens:
        separators = family.prediction_positions(batch.x.shape[1])
        return Inputs(
            batch,
            separators,
            batch.x,
            stability_linear,
            None,
            family.log_posterior(batch, majors).exp(),
            PredictionReadout(family, batch, majors.params),
            "linear map of x_t",
        )
    raise AnalysisError(unsupported(family))

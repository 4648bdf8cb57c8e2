"""The task subspace S of the ablations (docs/protocol.md, "S ablation"): the row space of
``W_task`` of the study's own probe, fitted as its code fits it. An ordinary least-squares fit with
an intercept of the states over the fit window,

    h ~ pi W_task + onehot(x_t) W_tok [+ logits_t W_logit] [+ onehot(t) W_pos] + b
                     (E2: x_t W_x in place of the one-hot term)

with ``pi`` the pool's exact posterior restricted to the K major tasks, on the protocol's ``probe_sequences``
major sequences (the study's ``sample_mode="major"``, ``n_minor=-1``: no minor or anchoring
sequences). Every group of regressors that sums to one drops its last column (the dummy-variable
trap): the token and position one-hots always, ``pi`` when it sums to one on the fitted states
(within the protocol's ``probe_sums_to_one``), and its row of ``W_task`` is then zero. The fit uses the first
``probe_fit_share`` (the study's validation_split 0.2) of a seeded permutation of the sequences and is the study's ``_fit_ols``: the
single-precision pseudo-inverse of the design with the intercept as its last column, at torch's
default cut-off (singular values below ``eps * max(rows, columns)`` of the largest are dropped;
the exact double-precision fit is the variant ``probe-exact``), on one thread: in single precision
the thread count moves W_task by about 1e-4 relative, and a stored number must not depend on it. S is the span of the rows of
``W_task`` (centred over the tasks when the family's ``TaskProbe.centred`` says so) at singular
values above the protocol's ``rank_cut`` of the largest. So the mean state lies in the intercept, never in
S, and S has rank K - 1 where ``pi`` sums to one.

What varies by family is declared by the family (``TaskProbe``, its ``task_probe``).

The earlier construction is the variant ``s-with-mean`` (``probe_basis_with_mean``): every
posterior column beside the token one-hot and an intercept, over the late window, the
minimum-norm solution, which spreads the mean state over the K rows.

Shapes: ``N`` sequences, ``P`` positions fitted, ``D`` width, ``K`` major tasks, ``V`` tokens
(E2: ``d`` coordinates of x_t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from taskgeom.analysis.protocol import active
from taskgeom.errors import AnalysisError
from taskgeom.settings.devices import torch_threads
from taskgeom.tasks.base import TaskProbe

PROBE_CHUNK = 250  # sequences a pass while collecting them (the pool posterior of 1,000 tasks is large)
GRAM_CHUNK = 128  # sequences a design chunk of the "gram" solver (E1's search probe: 1,070 columns at k = 10)


@dataclass(frozen=True)
class ProbeData:
    """What the probe regresses, over its fit positions: states [N, P, D], pi [N, P, K] (or [N, 1, K]:
    the same at every position), current
    [N, P] tokens (``vocab`` of them) or [N, P, d] x_t (``vocab`` None), logits [N, P, V] or None."""

    states: torch.Tensor
    pi: torch.Tensor
    current: torch.Tensor
    logits: torch.Tensor | None
    vocab: int | None


@dataclass(frozen=True)
class ProbeFit:
    """A fitted probe: ``weights`` [K, D] W_task (a zero row where ``pi``'s column was dropped),
    ``basis`` [D, r] orthonormal basis of S (float64), ``dropped``: ``pi`` summed to one and lost its
    last column; ``token_weights`` [V, D] W_tok of the token one-hot (a zero row for the last token,
    whose column is dropped; None where the probe reads x_t itself, E2)."""

    weights: torch.Tensor
    basis: torch.Tensor
    dropped: bool
    token_weights: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"ProbeFit(K={self.weights.shape[0]}, D={self.weights.shape[1]}, rank={self.basis.shape[1]}, dropped={self.dropped})"


def one_hot_dropped(index: torch.Tensor, n: int) -> torch.Tensor:
    """[M, n - 1] float64 the one-hot of index: [M] over n values without its last column."""
    return torch.nn.functional.one_hot(index.long(), n)[:, :-1].double()


def sums_to_one(pi: torch.Tensor) -> bool:
    """Whether the posterior pi: [..., K] sums to one on every row (within the protocol's
    ``probe_sums_to_one``), so that its last column is dropped (K > 1)."""
    return pi.shape[-1] > 1 and bool(((pi.double().sum(-1) - 1).abs() < active().probe_sums_to_one).all())


def probe_design(
    pi: torch.Tensor,
    current: torch.Tensor,
    vocab: int | None,
    logits: torch.Tensor | None,
    n_positions: int | None,
    dropped: bool,
) -> torch.Tensor:
    """X [N * P, columns] float64, the study's regressors for pi: [N, P, K] (or [N, 1, K], the same at
    every position), current: [N, P] tokens (``vocab`` of them) or [N, P, d] x_t (``vocab`` None),
    logits: [N, P, V] or None, and the position one-hot over ``n_positions`` (None: none); the
    intercept is the last column. ``pi`` is first, without its last column when ``dropped``."""
    N, P, K = current.shape[0], current.shape[1], pi.shape[-1]
    flat_pi = pi.expand(N, P, K).reshape(-1, K).double()
    parts = [flat_pi[:, :-1] if dropped else flat_pi]
    parts.append(
        one_hot_dropped(current.flatten(), vocab) if vocab is not None else current.reshape(N * P, -1).double()
    )
    if logits is not None:
        parts.append(logits.reshape(N * P, -1).double())
    if n_positions is not None and n_positions > 1:
        parts.append(one_hot_dropped(torch.arange(P).repeat(N), n_positions))
    parts.append(torch.ones(N * P, 1, dtype=torch.float64))
    return torch.cat(parts, 1)


def fit_rows(n_sequences: int, gen: torch.Generator) -> torch.Tensor:
    """[M] the sequences the probe is fitted on: the first ``probe_fit_share`` of a permutation drawn from ``gen``."""
    return torch.randperm(n_sequences, generator=gen)[: int(n_sequences * active().probe_fit_share)]


def gram_solution(gram: torch.Tensor, cross: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[columns, D] pinv(X) H from gram = X^T X: [columns, columns] and cross = X^T H: [columns, D]
    (float64) of a design X with ``n_rows`` rows, cut where ``torch.linalg.pinv`` cuts a single-precision
    X (the study's ``_fit_ols``): singular values of X below eps32 * max(rows, columns) of the largest
    are dropped. Exact arithmetic gives the pseudo-inverse's solution; this is it in double precision."""
    eigenvalues, vectors = torch.linalg.eigh(gram)
    sigma = eigenvalues.clamp_min(0).sqrt()
    keep = sigma > torch.finfo(torch.float32).eps * max(n_rows, gram.shape[0]) * sigma.max()
    kept = vectors[:, keep]
    return kept @ ((kept.T @ cross) / eigenvalues[keep, None])


def _solve(x_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, rows: torch.Tensor, solver: str):
    """[columns, D] float64 the least-squares solution for the states h: [N, P, D] of the sequences
    ``rows`` on their design ``x_of(rows)`` (``fit_probe``'s ``solver``)."""
    if solver == "gram":  # the design a chunk of sequences at a time: it is never held whole
        gram = cross = 0
        for chunk in rows.split(GRAM_CHUNK):
            x = x_of(chunk)
            gram, cross = gram + x.T @ x, cross + x.T @ h[chunk].reshape(-1, h.shape[-1]).double()
        return gram_solution(gram, cross, len(rows) * h.shape[1])
    x, target = x_of(rows), h[rows].reshape(-1, h.shape[-1])
    if solver == "exact":
        return torch.linalg.lstsq(x.cpu(), target.double().cpu(), driver="gelsd").solution
    if solver != "study":
        raise ValueError(f"unknown probe solver {solver!r}; choose study, exact or gram")
    with torch_threads(1):  # single precision reduces in another order on more threads: 1e-4 apart, so one thread
        return (torch.linalg.pinv(x.float().cpu()) @ target.float().cpu()).double()


def fit_probe(data: ProbeData, spec: TaskProbe, gen: torch.Generator, solver: str = "study") -> ProbeFit:
    """The probe (module docstring) on ``data``, fitted on the sequences ``fit_rows`` draws from
    ``gen``: ``solver`` "study", the study's single-precision pseudo-inverse; "exact", the
    double-precision minimum-norm least-squares solution; "gram", the pseudo-inverse's solution from the
    design's Gram matrix in double precision (``gram_solution``), built a chunk of sequences at a time
    (a design too large to hold, E1's search probe over every pool task) [ours]. AnalysisError when
    W_task is zero."""
    states, pi = data.states, data.pi
    K, D = pi.shape[-1], states.shape[-1]
    if spec.logits and data.logits is None:
        raise AnalysisError("this family's probe regresses on the model's logits; none were given")
    rows = fit_rows(len(states), gen)
    dropped = sums_to_one(pi[rows])
    pick = lambda x, at: None if x is None else x[at]
    design = lambda at: probe_design(
        pi[at],
        data.current[at],
        data.vocab,
        pick(data.logits, at) if spec.logits else None,
        states.shape[1] if spec.positions else None,
        dropped,
    )
    solution = _solve(design, states, rows, solver)
    n_pi = K - 1 if dropped else K
    weights = torch.zeros(K, D, dtype=torch.float64)
    weights[:n_pi] = solution[:n_pi]
    token_weights = None
    if data.vocab is not None:  # the one-hot's columns follow pi's, the last token's dropped
        token_weights = torch.zeros(data.vocab, D, dtype=torch.float64)
        token_weights[: data.vocab - 1] = solution[n_pi : n_pi + data.vocab - 1]
    w = weights - weights.mean(0) if spec.centred else weights
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    if not s[0] > 0:
        raise AnalysisError("the probe's task weights are zero: no task subspace")
    rank = int((s > active().rank_cut * s[0]).sum())  # S keeps the directions above the protocol's cut
    return ProbeFit(
        weights.to(states.device),
        vh[:rank].T.to(states.device),
        dropped,
        None if token_weights is None else token_weights.to(states.device),
    )


def probe_basis_with_mean(
    states: torch.Tensor, alpha: torch.Tensor, current: torch.Tensor, vocab: int | None, window: slice
) -> torch.Tensor:
    """[D, K] the variant ``s-with-mean``: the row space of W_task of the minimum-norm fit of
    ``h ~ alpha W_task + onehot(x_t) W_tok + b`` (every column kept) on states: [N, P, D] over the
    positions ``window`` (alpha: [N, P, K] the posterior over the majors; current: [N, P] tokens or
    [N, P, d] x_t); AnalysisError when its rows span fewer than K directions."""
    K, D = alpha.shape[-1], states.shape[-1]
    tokens = current[:, window].flatten(0, 1)
    tokens = torch.nn.functional.one_hot(tokens.long(), vocab) if vocab is not None else tokens
    x = torch.cat(
        [alpha[:, window].reshape(-1, K).double(), tokens.double(), torch.ones(len(tokens), 1, dtype=torch.float64)], 1
    )
    h = states[:, window].reshape(-1, D).double()
    w = torch.linalg.lstsq(x.cpu(), h.cpu(), driver="gelsd").solution[:K]
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    if s.numel() < K or s[-1] <= s[0] * 1e-10:
        raise AnalysisError(f"the probe's task weights span fewer than {K} directions: no rank-{K} task subspace")
    return vh[:K].T.to(states.device)

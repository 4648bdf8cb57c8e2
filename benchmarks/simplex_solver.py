"""Benchmark: the batched simplex least-squares solver against a per-state SciPy loop.

Baseline: for each state, ``scipy.optimize.nnls`` with the sum-to-one constraint folded in as a
weighted row (the usual way to solve this with SciPy). Checks accuracy on 1,000 problems against
that reference polished to the exact equality-constrained solution on NNLS's support, then times
both at 100,000 states (K = 3 vertices, width 128) and prints the speed-up.

    PYTHONPATH=src python benchmarks/simplex_solver.py [--states 100000] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.optimize import nnls

from taskgeom.analysis.measures.simplex import simplex_lstsq

PENALTY = 1e4


def scipy_loop(vertices: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[N, K] by one NNLS call per state."""
    A = np.vstack([vertices.T, PENALTY * np.ones((1, vertices.shape[0]))])
    b = np.concatenate([y, np.full((len(y), 1), PENALTY)], axis=1)
    return np.stack([nnls(A, row)[0] for row in b])


def polish(vertices: np.ndarray, y: np.ndarray, rough: np.ndarray) -> np.ndarray:
    """The exact equality-constrained least squares on each row's support in ``rough``."""
    out = np.zeros_like(rough)
    for i, (row, beta) in enumerate(zip(y, rough)):
        support = beta > 0
        Vs, k = vertices[support], int(support.sum())
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k], kkt[:k, k], kkt[k, :k] = Vs @ Vs.T, 1.0, 1.0
        out[i, support] = np.linalg.solve(kkt, np.concatenate([Vs @ row, [1.0]]))[:k]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    worst = 0.0
    for _ in range(20):  # 20 vertex sets x 50 states = 1,000 problems
        vertices, y = rng.normal(size=(args.k, args.width)), rng.normal(size=(50, args.width))
        ours = simplex_lstsq(torch.from_numpy(y), torch.from_numpy(vertices)).numpy()
        worst = max(worst, float(np.abs(ours - polish(vertices, y, scipy_loop(vertices, y))).max()))
    print(f"accuracy: max |ours - reference| over 1,000 problems = {worst:.2e} (required <= 1e-6)")

    vertices = rng.normal(size=(args.k, args.width))
    y = rng.dirichlet(np.ones(args.k), size=args.states) @ vertices + 0.5 * rng.normal(size=(args.states, args.width))
    wall, cpu = time.perf_counter(), time.process_time()
    reference = scipy_loop(vertices, y)
    t_scipy = (time.perf_counter() - wall, time.process_time() - cpu)
    Y, V = torch.from_numpy(y), torch.from_numpy(vertices)
    simplex_lstsq(Y[:1000], V)  # warm-up
    times = []
    for _ in range(5):  # best of five, as timeit does: the machine may be shared
        wall, cpu = time.perf_counter(), time.process_time()
        ours = simplex_lstsq(Y, V).numpy()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    t_ours = (min(t[0] for t in times), min(t[1] for t in times))
    print(f"{args.states} states, K = {args.k}, width {args.width}, {args.threads} thread(s)")
    for i, clock in enumerate(("wall", "cpu")):
        print(
            f"{clock:>4} time: scipy nnls loop {t_scipy[i]:.3f} s   batched torch {t_ours[i]:.4f} s   "
            f"speed-up {t_scipy[i] / t_ours[i]:.1f}x (required >= 20x)"
        )
    print(
        f"max |ours - scipy nnls (penalty {PENALTY:g})| at {args.states} states: {np.abs(ours - reference).max():.2e}"
    )


if __name__ == "__main__":
    main()

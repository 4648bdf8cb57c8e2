"""What the paper profile's reproduction costs, from measured seconds per training step, against the
quick profile's steps (the baseline) in one process.

For each recipe, a few training steps of its paper-profile run and of its quick-profile run are
timed on ``--device`` (after one warm-up step each; the median of the timed steps), and the run list
of ``taskgeom reproduce --profile paper --plan`` (every run, every seed) is priced at those rates:
its training hours on one device, and on a cluster of ``--workers`` such devices with the runs
packed longest first. Analyses are not priced (on the quick profile they are about a fifth of the
CPU time: README). Reports each recipe's paper / quick step-time ratio.

    python benchmarks/paper_cost.py [--device cpu] [--steps 3] [--threads 2] [--workers 8] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from taskgeom.experiments import Context, planned_runs
from taskgeom.experiments.schedule import plan_table
from taskgeom.runs.folders import Run
from taskgeom.settings.recipes import load_recipe
from taskgeom.training.train import train


def seconds_per_step(recipe: str, profile: str, steps: int, device: str) -> float:
    """Median seconds of ``steps`` training steps of ``recipe`` at ``profile`` (one warm-up step first)."""
    config = load_recipe(
        recipe,
        profile,
        [
            "train.steps=100000",
            "train.eval_every=100000",
            "train.checkpoint_every=100000",
            "train.snapshots=0",
            "train.threads=0",
        ],
    )
    times: list[float] = []
    last = [time.perf_counter()]

    def tick(*_args, **_kwargs) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        if len(times) > steps:
            raise StopIteration

    try:
        train(Run.create(config, tempfile.mkdtemp()), tick, device)
    except StopIteration:
        pass
    return statistics.median(times[1:])


def pack(hours: list[float], workers: int) -> float:
    """Wall hours of ``hours`` on ``workers`` devices, each run given to the least loaded, longest first."""
    loads = [0.0] * workers
    for h in sorted(hours, reverse=True):
        loads[loads.index(min(loads))] += h
    return max(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    table = plan_table(planned_runs(Context(Path(tempfile.mkdtemp()), "paper", seeds)))
    rate = {}
    print(
        f"device {args.device}, {args.threads} torch threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    for recipe in sorted(table["recipe"].unique()):
        paper, quick = (seconds_per_step(recipe, p, args.steps, args.device) for p in ("paper", "quick"))
        rate[recipe] = paper
        print(f"{recipe}: paper {paper:.3f} s/step, quick {quick:.4f} s/step: paper / quick {paper / quick:.1f}x")
    hours = [row.steps * rate[row.recipe] / 3600 for row in table.itertuples()]
    print(
        f"paper run list ({len(table)} runs, seeds {args.seeds}): {sum(hours):.0f} device-hours of training on one device, "
        f"{pack(hours, args.workers):.1f} h on {args.workers} devices (longest first); longest run {max(hours):.1f} h"
    )


if __name__ == "__main__":
    main()

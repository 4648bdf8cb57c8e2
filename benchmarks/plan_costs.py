"""What ``--plan``'s costs (``timing.TRAIN_COST_PER_FLOP_SECOND``, each experiment's ``cost``) are fitted on: for each stage of a reproduction's
``timings.json`` that trains a run, analyses its dual modes or its M1 geometry, its CPU seconds per
second of the run's training FLOPs (6 x parameters x tokens) at this machine's one-thread
matrix-multiply rate (``timing.matmul_rate``, or ``--rate``), per recipe (min-max over its runs);
and E4's measurement of each seed (its stages summed) per second of that seed's E4 k = -1 run's.
The runs' FLOPs come from the reproduction's own plan (profile, seeds and settings of its
``reproduction.json``), so a published folder without its runs serves.

    python benchmarks/plan_costs.py RESULTS [--rate GFLOPS]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from taskgeom.experiments import planned_runs
from taskgeom.experiments.base import Context
from taskgeom.experiments.schedule import plan_table
from taskgeom.training.timing import matmul_rate

KINDS = {("schedule", "train"): "train", ("schedule", "analyse"): "dual", ("m1", "analyse"): "m1"}


def stage_costs(folder: Path, rate: float) -> pd.DataFrame:
    """One row per timed stage of a kind in KINDS: run, recipe, kind, CPU seconds, CPU per FLOP-second."""
    manifest = json.loads((folder / "reproduction.json").read_text())
    timings = json.loads((folder / "timings.json").read_text())
    ctx = Context(folder, manifest["profile"], tuple(manifest["seeds"]), overrides=tuple(manifest["overrides"]))
    plan = plan_table(planned_runs(ctx))
    flops = plan.set_index("run")["flops"]
    e4_runs = plan[(plan["recipe"] == "e4") & (plan["diversity"] == -1)].set_index("seed")["run"]
    rows = []
    for stage in timings["stages"]:
        words = stage["stage"].split()
        kind = KINDS.get((stage["experiment"], words[0]))
        seed = re.search(r"seed (\d+)\)$", stage["stage"])
        if stage["experiment"] == "e4" and seed and int(seed[1]) in e4_runs.index:
            kind, words = "e4", [None, e4_runs[int(seed[1])]]
        if kind is not None and words[1] in flops.index:
            rows.append(
                {
                    "run": words[1],
                    "recipe": words[1].split("-")[0],
                    "kind": kind,
                    "cpu_s": stage["cpu_s"],
                    "per_flop_second": stage["cpu_s"] / (flops[words[1]] / rate),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument(
        "--rate", type=float, help="GFLOP/s a thread of the machine that ran it (default: this machine's probe)"
    )
    args = parser.parse_args()
    rate = args.rate * 1e9 if args.rate else matmul_rate(2.0)
    table = stage_costs(args.results, rate)
    per_unit = table.groupby(["kind", "recipe", "run"], as_index=False)[["cpu_s", "per_flop_second"]].sum()
    summary = per_unit.groupby(["kind", "recipe"])["per_flop_second"].agg(["min", "max", "count"]).round(2)
    print(f"probe {rate / 1e9:.0f} GFLOP/s a thread\n{summary.to_string()}")


if __name__ == "__main__":
    main()

"""How OpenMP's wait policy changes the cost of an analysis at two threads, not its bits: the M1
analysis of one finished run (``benchmarks/same_rows.py measure m1``), in a fresh process with two
torch threads, once as torch's OpenMP waits by default (its threads spin) and once with
``OMP_WAIT_POLICY=PASSIVE`` (they sleep: what the schedule's workers get,
``experiments.executors.WORKER_ENVIRONMENT``), each alone and each beside ``--beside`` one-thread
busy processes (as beside the schedule's trainings); prints wall and CPU seconds, their ratios to
the default, and whether the rows and tensors are equal.

    python benchmarks/wait_policy.py RUN_DIR [--beside 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
BUSY = "import torch; torch.set_num_threads(1); a = torch.randn(512, 512)\nwhile True: a @ a"


def measure(run: Path, work: Path, policy: str | None, beside: int) -> tuple[float, float, Path]:
    """(wall, CPU) seconds of M1 on a copy of ``run`` at two threads under ``policy`` (None: the
    default), with ``beside`` busy one-thread processes running meanwhile; and the rows written."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    name = f"{policy or 'default'}-{beside}"
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(beside)]
    try:
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                str(HERE / "same_rows.py"),
                "measure",
                "m1",
                str(run),
                str(work / name),
                str(work / f"{name}.json"),
                "2",
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), work / f"{name}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--beside", type=int, default=2, help="busy one-thread processes beside (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for beside in sorted({0, args.beside}):
            default = measure(args.run, work, None, beside)
            passive = measure(args.run, work, "PASSIVE", beside)
            same = json.loads(default[2].read_text()) == json.loads(passive[2].read_text())
            tensors = (
                subprocess.run(
                    [
                        sys.executable,
                        str(HERE / "same_rows.py"),
                        "compare",
                        str(default[2]),
                        str(passive[2]),
                        str(default[2].with_suffix("")),
                        str(passive[2].with_suffix("")),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            print(
                f"{beside} busy beside: default {default[0]:.1f} s wall, {default[1]:.1f} CPU-s; "
                f"PASSIVE {passive[0]:.1f} s wall, {passive[1]:.1f} CPU-s "
                f"(wall {passive[0] / default[0]:.2f}x, CPU {passive[1] / default[1]:.2f}x); "
                f"rows {'equal' if same else 'DIFFER'}, {tensors}"
            )


if __name__ == "__main__":
    main()

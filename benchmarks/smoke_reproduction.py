"""The smoke profile's whole reproduction (every experiment, every claim computed, at toy sizes) timed
against its baseline, the target of 3 minutes on 2 cores.

It runs ``taskgeom reproduce --profile smoke`` into a fresh temporary folder (seeds 0, 1: the test
suite's) in a subprocess, and prints the wall and CPU seconds and the ratio of the wall time to the
target (below 1: within it). Run it with nothing else on the machine. (``--plan``'s estimate, fitted
on quick runs, prices toy runs at about nothing: their time is fixed costs, not FLOPs.)

    python benchmarks/smoke_reproduction.py [--seeds 0,1] [--target 180]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time


def reproduce(args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child processes, stdout) of ``taskgeom reproduce ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "taskgeom", "reproduce", *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):  # 1: some claims fail, as they do at toy sizes
        raise SystemExit(f"taskgeom reproduce {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--target", type=float, default=180.0, help="the target wall time in seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        wall, cpu, out = reproduce(["--profile", "smoke", "--seeds", args.seeds, "--out", folder])
    claims = out.strip().splitlines()[-1]
    print(f"smoke reproduction, seeds {args.seeds}: {wall:.0f} s wall, {cpu:.0f} CPU-s; {claims}")
    print(f"wall / target ({args.target:.0f} s): {wall / args.target:.2f}")


if __name__ == "__main__":
    main()

"""What pinning torch's CPU kernel paths does to a run's bits and to its speed, against the
default (torch picks its kernels by CPU), in one invocation on one machine.

Each setting trains the same short quick-profile run (E1 by default, one thread, fixed seed) in a
fresh Python process, since the variables must be set before torch loads: the default; then
``ATEN_CPU_CAPABILITY`` (ATen's vectorised kernels), ``MKL_CBWR`` (MKL's conditional numerical
reproducibility branch) and ``ONEDNN_MAX_CPU_ISA`` pinned to AVX2, one more at a time; then the
generic paths (``default`` / ``COMPATIBLE`` / ``SSE41``). Every setting is trained twice. The
report: for each setting, the sha256 of the final weights of both trainings (equal: the setting is
deterministic here), whether they equal the default's, and the seconds per step of its faster
training relative to the default's faster one (above 1: slower).

Whether a pinned setting gives the same bits on *another* CPU cannot be told from one machine:
run this on two machines and compare the hashes printed for the same setting.

    python benchmarks/kernel_pins.py [--recipe e1] [--steps 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {
    "default": {},
    "aten avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten avx2 + mkl AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
    "aten avx2 + mkl AVX2 + onednn AVX2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "generic (default / COMPATIBLE / SSE41)": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_CBWR": "COMPATIBLE",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}

_CHILD = """
import hashlib, json, sys, tempfile, time
import torch
from taskgeom.settings.recipes import load_recipe
from taskgeom.runs.folders import Run
from taskgeom.training.train import train
recipe, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = load_recipe(recipe, "quick", [f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
                                       "train.snapshots=0", f"train.threads={threads}"])
run = Run.create(config, tempfile.mkdtemp())
start = time.perf_counter()
train(run, device="cpu")
seconds = time.perf_counter() - start
print(json.dumps({"sha256": hashlib.sha256(run.model_path.read_bytes()).hexdigest(), "seconds_per_step": seconds / steps,
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def train_once(recipe: str, steps: int, threads: int, pins: dict[str, str]) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
    } | pins
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, recipe, str(steps), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="e1")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    results = {name: [] for name in SETTINGS}
    for _ in range(2):  # interleaved, so that a slow moment of the machine falls on every setting alike
        for name, pins in SETTINGS.items():
            results[name].append(train_once(args.recipe, args.steps, args.threads, pins))
    base = results["default"]
    base_time = min(r["seconds_per_step"] for r in base)
    print(
        f"{args.recipe} quick, {args.steps} steps, {args.threads} thread(s); torch's own CPU capability: {base[0]['capability']}"
    )
    for name, runs in results.items():
        a, b = (r["sha256"] for r in runs)
        same = "deterministic" if a == b else "NOT deterministic"
        vs = "= default bits" if a == base[0]["sha256"] else "other bits than default"
        ratio = min(r["seconds_per_step"] for r in runs) / base_time
        print(
            f"  {name:<40} capability {runs[0]['capability']:<8} {a[:16]}  {same}, {vs}; time per step {ratio:.2f}x default"
        )


if __name__ == "__main__":
    main()

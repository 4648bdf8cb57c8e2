#!/usr/bin/env bash
# The device check (docs/device-check.md): on a machine with one GPU, run the CUDA tests, train E1 and
# E3 (k = -1, seed 0) at the paper profile's sizes for STEPS steps, analyse both runs, and write the
# machine, the test output, the timings and a manifest to one folder.
#
#   bash benchmarks/device_check.sh [OUT]        # OUT defaults to device-check; it must not hold runs/ yet
#
# Environment (all optional):
#   DEVICE      where to train: cuda (default), cuda:N or cpu
#   STEPS       training steps of each run (default 2000: under 2 minutes a run at 17 steps/s or more,
#               the low end of our estimate for one H100; docs/device-check.md)
#   BUDGET      seconds the whole check may take (default 480); the analyses share what the tests and the
#               training leave, and one that runs out is stopped and recorded as unfinished
#   SEQUENCES   held-out sequences `taskgeom analyze` reads (default 512, its own default)
#   MIN_SECONDS the least an analysis is given however little of BUDGET is left (default 10)
#   EXTRA_SETS  more `--set` overrides for both runs, space-separated (the suite's CPU test shrinks
#               the model with them: "model.n_layers=1 model.d_model=16 ...")
#   PYTHON      the interpreter with taskgeom and pytest installed (default python)
#   COMMIT      the commit to record where the tree has no git (default: git rev-parse HEAD)
set -euo pipefail
export LC_NUMERIC=C  # EPOCHREALTIME and awk with a decimal point

OUT=${1:-device-check}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-2000}
BUDGET=${BUDGET:-480}
SEQUENCES=${SEQUENCES:-512}
EXTRA_SETS=${EXTRA_SETS:-}
PYTHON=${PYTHON:-python}
MIN_SECONDS=${MIN_SECONDS:-10}
RECIPES=(e1 e3)

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repository root: tests/ and git are read from here
if [[ -e "$OUT/runs" ]]; then
  echo "device_check: $OUT already holds runs/ (a run there would resume, not train); choose a new folder" >&2
  exit 2
fi
: > "$OUT/commands.txt"
: > "$OUT/records.tsv"  # recipe, key, value: what timings.json is made from

START=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f\n", b - a }'; }  # seconds since $1
logged() { printf '%q ' "$@" >> "$OUT/commands.txt"; echo >> "$OUT/commands.txt"; "$@"; }  # record the command, then run it
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/records.tsv"; }

# timings.json and manifest.json, rewritten after every stage: a check stopped midway keeps what it measured.
write_json() {
  OUT="$OUT" DEVICE="$DEVICE" ANALYSIS_ON="$ANALYSIS_ON" TOTAL_S=$(since "$START") "$PYTHON" - <<'EOF'
import json, os, subprocess
from pathlib import Path

env, out = os.environ, Path(os.environ["OUT"])
device, stages = env["DEVICE"], {}
for line in (out / "records.tsv").read_text().splitlines():
    name, key, value = line.split("\t")
    stages.setdefault(name, {})[key] = value if key == "run_dir" else json.loads(value)
runs = {}
for recipe, run in stages.items():
    if recipe in ("cuda_tests", "machine"):
        continue
    run |= {"run_dir": os.path.relpath(run["run_dir"], out), "device": device, "analysis_device": env["ANALYSIS_ON"]}
    if "train_s" in run:
        run["steps_per_s"] = round(run["steps"] / run["train_s"], 3)
    if "eval_s" in run:
        run["analysis_s"] = round(run["analyze_s"] + run["eval_s"], 3)
    runs[recipe] = run
tests = stages.get("cuda_tests", {})
(out / "timings.json").write_text(json.dumps({"device": device, "cuda_tests_s": tests.get("seconds"), "total_s": float(env["TOTAL_S"]),
                                               "runs": runs}, indent=1) + "\n")

def git(*args):  # None where there is no git checkout (a copied tree): then set COMMIT
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None

lines = (out / "cuda-tests.txt").read_text().strip().splitlines() if (out / "cuda-tests.txt").exists() else []
status = git("status", "--porcelain")
manifest = {"commit": env.get("COMMIT") or git("rev-parse", "HEAD"), "uncommitted_changes": None if status is None else status != "",
            **stages["machine"], "device": device,
            "analysis_device": env["ANALYSIS_ON"],
            "cuda_tests": {"exit_code": tests.get("exit_code"), "summary": lines[-1] if lines else None},
            "commands": (out / "commands.txt").read_text().splitlines()}
(out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
EOF
}

echo "== machine -> $OUT/machine.txt"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  uname -a
  if command -v nvidia-smi > /dev/null; then nvidia-smi || true; else echo "nvidia-smi: not found"; fi
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda available", torch.cuda.is_available())'
  echo "cpus $(nproc)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# torch, CUDA and the device's name, for the manifest
"$PYTHON" - "$DEVICE" >> "$OUT/records.tsv" <<'EOF'
import json, platform, sys
from pathlib import Path

import torch

device = sys.argv[1]
if device.startswith("cuda") and torch.cuda.is_available():
    name = torch.cuda.get_device_name(torch.device(device))
else:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    name = next((l.split(":", 1)[1].strip() for l in cpuinfo if l.startswith("model name")), platform.processor() or platform.machine())
for key, value in {"torch": torch.__version__, "cuda": torch.version.cuda, "device_name": name}.items():
    print(f"machine\t{key}\t{json.dumps(value)}")
EOF

# The analyses run where `taskgeom analyze` lets them: on DEVICE once it has a --device option, else on the CPU.
ANALYZE_DEVICE=()
ANALYSIS_ON=cpu
if "$PYTHON" -m taskgeom analyze --help | grep -q -- '--device'; then
  ANALYZE_DEVICE=(--device "$DEVICE")
  ANALYSIS_ON=$DEVICE
fi

echo "== CUDA tests -> $OUT/cuda-tests.txt (they skip without CUDA)"
T=$EPOCHREALTIME
TESTS_RC=0
logged "$PYTHON" -m pytest tests/test_devices.py -q -p no:cacheprovider 2>&1 | tee "$OUT/cuda-tests.txt" || TESTS_RC=$?
record cuda_tests seconds "$(since "$T")"
record cuda_tests exit_code "$TESTS_RC"
write_json

SETS=(--set task.diversity=-1 --set train.seed=0 --set "train.steps=$STEPS")
for s in $EXTRA_SETS; do SETS+=(--set "$s"); done
declare -A RUN
for recipe in "${RECIPES[@]}"; do
  echo "== train $recipe (paper profile, $STEPS steps, on $DEVICE)"
  T=$EPOCHREALTIME
  logged "$PYTHON" -m taskgeom train "$recipe" --profile paper --device "$DEVICE" "${SETS[@]}" --out "$OUT/runs" | tee "$OUT/train-$recipe.txt"
  TRAIN_S=$(since "$T")
  RUN[$recipe]=$(tail -n 1 "$OUT/train-$recipe.txt")
  STEPS_DONE=$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["train"]["steps"])' "${RUN[$recipe]}/config.yaml")
  record "$recipe" run_dir "${RUN[$recipe]}"
  record "$recipe" steps "$STEPS_DONE"
  record "$recipe" train_s "$TRAIN_S"
  "$PYTHON" -c 'import sys; n, s = int(sys.argv[2]), float(sys.argv[3]); print(f"{sys.argv[1]}: {n} steps in {s:.1f} s: {n / s:.2f} steps per second on {sys.argv[4]} (wall: start-up, evaluations and checkpoints included)")' \
    "$recipe" "$STEPS_DONE" "$TRAIN_S" "$DEVICE" | tee -a "$OUT/steps-per-second.txt"
  write_json
done

# What is left of BUDGET, shared by the $1 runs still to analyse, less $2 seconds (at least MIN_SECONDS).
share() { awk -v b="$BUDGET" -v t0="$START" -v t="$EPOCHREALTIME" -v n="$1" -v r="$2" -v m="$MIN_SECONDS" \
  'BEGIN { s = int((b - (t - t0)) / n - r); print (s < m ? m : s) }'; }
# Run a command under a time limit; record its seconds and whether it finished (a stopped one is not a failure of the check).
timed() {
  local recipe=$1 key=$2 limit=$3 rc=0 T=$EPOCHREALTIME seconds
  shift 3
  logged timeout --kill-after=10 "$limit" "$@" > "$OUT/$key-$recipe.txt" 2>&1 || rc=$?
  seconds=$(since "$T")
  record "$recipe" "${key}_s" "$seconds"
  record "$recipe" "${key}_finished" "$([[ $rc == 0 ]] && echo true || echo false)"
  if [[ $rc == 0 ]]; then
    echo "$recipe: $key $seconds s"
  elif [[ $rc == 124 || $rc == 137 ]]; then
    echo "$recipe: $key stopped at its limit of $limit s"
  else
    echo "device_check: $key of $recipe failed (exit $rc):" >&2
    tail -n 20 "$OUT/$key-$recipe.txt" >&2
    exit "$rc"
  fi
}

echo "== the analyses (taskgeom analyze, $SEQUENCES sequences, on $ANALYSIS_ON; taskgeom eval, on the CPU) within BUDGET = $BUDGET s"
LEFT=${#RECIPES[@]}
for recipe in "${RECIPES[@]}"; do
  # each run's share of the time left: its analysis all but 30 s of it, its evaluation the rest
  timed "$recipe" analyze "$(share "$LEFT" 30)" "$PYTHON" -m taskgeom analyze "${RUN[$recipe]}" --sequences "$SEQUENCES" "${ANALYZE_DEVICE[@]}"
  timed "$recipe" eval "$(share "$LEFT" 0)" "$PYTHON" -m taskgeom eval "${RUN[$recipe]}"
  LEFT=$((LEFT - 1))
  write_json
done

cat "$OUT/timings.json"
if [[ $TESTS_RC != 0 ]]; then
  echo "device_check: the CUDA tests failed (exit $TESTS_RC); see $OUT/cuda-tests.txt" >&2
  exit 1
fi
echo "device_check: done in $(since "$START") s; everything is in $OUT"

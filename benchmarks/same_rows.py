"""Bit-for-bit check of a refactor, not a timing: one stored analysis (``dual`` or ``m1``) of a finished
run measured again by the taskgeom this interpreter imports, on a copy of the run (its ``analysis/``
left out), then compared row by row with the rows another version stored (every field but the key:
``version``, ``protocol``), and for M1 every tensor of ``m1.safetensors``.

Run it with each version's interpreter on the same run, at the thread count the reproduction used
(the dual analysis: the run's ``train.threads``, 1 at quick; M1: the reproducing process's, 2 on a
2-core machine), then compare:

    OLD/bin/python benchmarks/same_rows.py measure m1 RUN old-copy old.json 2
    NEW/bin/python benchmarks/same_rows.py measure m1 RUN new-copy new.json 2
    python benchmarks/same_rows.py compare old.json new.json [old-copy new-copy]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def measure(kind: str, source: Path, copy: Path, out: Path, threads: int) -> None:
    """Measure ``kind`` on a copy of the run at ``source`` and write its rows to ``out``."""
    from taskgeom.settings.kernels import use_portable_kernels

    use_portable_kernels()  # as every taskgeom command pins them, before torch computes anything
    import torch

    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run

    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("analysis"))
    torch.set_num_threads(threads)
    run = StudyRun(Run.open(copy))
    if kind == "dual":
        from taskgeom.analysis.stored.dual import analyze_dual

        rows = analyze_dual(run, projection_sizes=(1024, 128))
    else:
        from taskgeom.analysis.stored.m1 import analyze, write

        write(run, analyze(run))
        rows = json.loads((copy / "analysis" / "m1.json").read_text())
    out.write_text(json.dumps(rows))
    print(f"{kind} {source.name}: {len(rows)} rows")


def compare(old: Path, new: Path, copies: list[Path]) -> None:
    """Print how many rows (and M1 tensors, given the two copies) are equal."""
    key = {"version", "protocol"}
    rows = [[{k: v for k, v in r.items() if k not in key} for r in json.loads(p.read_text())] for p in (old, new)]
    same = sum(a == b for a, b in zip(*rows))
    print(f"{old} vs {new}: {len(rows[0])} and {len(rows[1])} rows, {same} equal")
    if copies:
        import torch
        from safetensors.torch import load_file

        a, b = (load_file(c / "analysis" / "m1.safetensors") for c in copies)
        print(f"m1.safetensors: {sum(k in b and torch.equal(a[k], b[k]) for k in a)} of {len(a)} tensors equal")


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        measure(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]))
    elif sys.argv[1:2] == ["compare"]:
        compare(Path(sys.argv[2]), Path(sys.argv[3]), [Path(p) for p in sys.argv[4:6]])
    else:
        raise SystemExit(__doc__)

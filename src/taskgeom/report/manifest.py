"""``reproduction.json``: what a reproduction was (profile, settings, machine) and how its figures
and claims are organised, so that ``taskgeom report`` can rebuild the page from the files alone.

Format: {"format": 7, "taskgeom": version, "commit": the git commit or None, "profile", "seeds": [training seeds], "overrides": [...],
"recipes": [the recipes measured], "sections": {recipe: its report section's title}, "grid",
"device", "executor", "machine": {...}, "experiments": [the registered experiments' names, in order;
the report asks each for its interactive evidence], "runs": [the run directories it used],
"models": {run directory: sha256 of its model.safetensors}, "claims": {id: experiment that checked
it}, "figures": [{"path", "pdf", "caption", "experiment", "claims": [ids]}], "forms": {field: value},
the claims' forms and the V search it was measured and judged under (``protocol.EARLIER``'s fields)}.
Format 6 and earlier wrote "forms" only where ``taskgeom rejudge`` changed one, from the choices
before 2026-12-08 (``recorded_choices``).

The machine is on record because other CPUs train other floats: torch picks its kernels by CPU
(``cpu_capability``), MKL and oneDNN by their own dispatch, and training amplifies the last bits.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from taskgeom.analysis.protocol import EARLIER
from taskgeom.errors import TaskgeomError
from taskgeom.settings import kernels
from taskgeom.version import __version__

MANIFEST = "reproduction.json"
# 2: the run directories used ("runs"); 3: seeds, the machine's kernels and the models' sha256; 4: the recipes' sections;
# 5: claims.json's rows carry their recipe and the experiment that measured them (format 4 wrote the recipe as "experiment")
# 6: no "evidence" (the registered experiments give theirs)
FORMAT = 7  # 7: "forms", every choice of ``protocol.EARLIER`` (6: only the forms rejudge changed, from ``EARLIER``)
READABLE = (4, 5, 6, 7)  # a format-4 folder is read with its claims' rows completed (``read_claims``)
CLAIMS = "claims.json"
DUAL_EXPERIMENT = "dual_modes"
DUAL_SECTION, OTHER_SECTION = "dual", "other"  # the sections beside the recipes'


# Environment variables that pin or steer the CPU kernels a run trains with.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _library_version(pattern: str, text: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


def machine() -> dict:
    """The machine a reproduction ran on: host, OS, CPU model, torch's CPU capability, cores, Python,
    torch, MKL and oneDNN versions, thread counts and the kernel-pinning environment variables set."""
    config = torch.__config__.show()
    return {
        "host": platform.node(),
        "os": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mkl": _library_version(r"Math Kernel Library Version ([^ ]+)", config),
        "onednn": _library_version(r"MKL-DNN v([^ ]+)", config),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "kernel_environment": {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ},
        "kernels": kernels.current()["mode"],
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def source_commit() -> str | None:
    """The git commit taskgeom runs from ('abc1234', '+ changes' when the checkout has uncommitted
    changes), None when it is not installed from a git checkout."""
    where = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"commit {head.stdout.strip()}" + (" + changes" if dirty else "")


def file_sha256(path: Path) -> str | None:
    """The sha256 of a file's bytes (hex), None if it does not exist."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(
    profile: str,
    overrides: tuple[str, ...],
    device: str,
    executor: str,
    experiments: list[str],
    runs: list[str],
    claims: dict[str, str],
    figures: list[dict],
    seeds: tuple[int, ...],
    runs_root: Path,
    sections: dict[str, str],
    forms: dict,
    grid: tuple[int, ...] | None = None,
) -> dict:
    """The manifest of one reproduction (see the module docstring for the fields); ``forms``: the
    choices of ``protocol.EARLIER``'s fields it was measured and judged under."""
    models = {name: file_sha256(Path(runs_root) / name / "model.safetensors") for name in runs}
    return {
        "forms": forms,
        "format": FORMAT,
        "taskgeom": __version__,
        "commit": source_commit(),
        "profile": profile,
        "seeds": list(seeds),
        "overrides": list(overrides),
        "recipes": list(sections),
        "sections": sections,
        "grid": None if grid is None else list(grid),
        "device": device,
        "executor": executor,
        "machine": machine(),
        "experiments": experiments,
        "runs": runs,
        "models": models,
        "claims": claims,
        "figures": figures,
    }


def read_json(path: Path, remedy: str):
    """The JSON value in ``path``; a TaskgeomError naming the file and ``remedy`` if it is missing or unreadable."""
    if not path.is_file():
        raise TaskgeomError(f"{path} not found; {remedy}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TaskgeomError(f"{path} is unreadable ({err}); {remedy}") from None


def read_manifest(out: Path) -> dict:
    """The manifest of results folder ``out``; a TaskgeomError naming the file if it is missing,
    unreadable or of another format."""
    path, again = Path(out) / MANIFEST, f"run `taskgeom reproduce --out {out}` (finished runs and analyses are reused)"
    if not path.is_file():
        raise TaskgeomError(
            f"{path} not found: {out} is not a results folder written by `taskgeom reproduce` "
            f"(taskgeom {__version__} writes {MANIFEST} beside claims.json); {again}"
        )
    data = read_json(path, again)
    if not isinstance(data, dict) or data.get("format") not in READABLE:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TaskgeomError(
            f"{path} has format {found!r}, this taskgeom ({__version__}) reads formats {', '.join(map(str, READABLE))}; "
            f"rerun `taskgeom reproduce --out {out}` (finished runs are reused)"
        )
    return data


def recorded_choices(found: dict) -> dict:
    """{field: value} of the protocol's choices that changed on 2026-12-08 (``protocol.EARLIER``'s
    fields: the claims' forms and the V search) as the manifest ``found`` was measured and judged
    under: its "forms" (format 7), or ``EARLIER`` with the forms ``taskgeom rejudge`` changed (format
    6 and earlier)."""
    if found["format"] >= 7:
        return dict(found["forms"])
    return {**EARLIER, **found.get("forms", {})}


def read_claims(out: Path) -> list[dict]:
    """The rows of results folder ``out``'s claims.json. A row written before the rows carried their
    recipe (manifest format 4, whose rows name the recipe ``experiment``) is completed: its ``recipe``
    from its id, its ``experiment`` from the manifest's {claim: experiment}."""
    out = Path(out)
    rows = read_json(out / CLAIMS, f"rerun `taskgeom reproduce --out {out}`")
    if all("recipe" in row for row in rows):
        return rows
    manifest = out / MANIFEST
    checked_by = read_json(manifest, "").get("claims", {}) if manifest.is_file() else {}
    return [
        row
        if "recipe" in row
        else {**row, "recipe": row["id"].partition(".")[0], "experiment": checked_by.get(row["id"])}
        for row in rows
    ]


def sections(manifest: dict) -> dict[str, str]:
    """{section: title} of a manifest, in the report's order: each recipe's, the dual modes', the rest."""
    dual = [recipe.upper() for recipe, experiment in _claim_recipes(manifest) if experiment == DUAL_EXPERIMENT]
    return {
        **manifest["sections"],
        DUAL_SECTION: f"Dual modes across task diversity ({', '.join(dict.fromkeys(dual))})",
        OTHER_SECTION: "Other claims",
    }


def _claim_recipes(manifest: dict) -> list[tuple[str, str]]:
    """(recipe, experiment) of each claim of a manifest."""
    return [(claim_id.split(".")[0], experiment) for claim_id, experiment in manifest["claims"].items()]


def figure_section(figure: dict, recipes: dict[str, str]) -> str:
    """The report section of a manifest figure: that of the first claim it supports, else of its name."""
    return section(
        figure["claims"][0] if figure["claims"] else Path(figure["path"]).stem, figure["experiment"], recipes
    )


def section(claim_id: str, experiment: str, recipes: dict[str, str]) -> str:
    """The report section of a claim (or figure) checked by ``experiment``: the dual-mode section,
    else the recipe of ``recipes`` its id starts with (``e1.P0`` -> ``e1``), else ``other``."""
    recipe = claim_id.split(".")[0].split("_")[0]
    return DUAL_SECTION if experiment == DUAL_EXPERIMENT else recipe if recipe in recipes else OTHER_SECTION

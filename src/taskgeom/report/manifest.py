"""``reproduction.json``: what a reproduction was (profile, settings, machine) and how its figures
and claims are organised, so that ``taskgeom report`` can rebuild the page from the files alone.

Format: {"format": 2, "taskgeom": version, "profile", "overrides": [...], "device", "executor",
"machine": {...}, "experiments": [names in order], "runs": [the run directories it used],
"claims": {id: experiment that checked it}, "figures": [{"path", "pdf", "caption", "experiment",
"claims": [ids]}]}.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from taskgeom import __version__
from taskgeom.errors import TaskgeomError

MANIFEST = "reproduction.json"
FORMAT = 2  # 2: the run directories used ("runs")
DUAL_EXPERIMENT = "dual_modes"
# The claims each kind of figure (PNG or interactive) is evidence for, as suffixes of their ids
# (``e1.`` + ``P0``): M1's per family, the dual modes' per recipe of the sweep.
M1_EVIDENCE = {"simplex": ("P3", "P3.shrinks"), "layers": ("P0", "P1", "P2", "P2.vs_random"), "positions": ("P2",),
               "steering": ("steering",)}
DUAL_EVIDENCE = {"projection": ("projection_r2_high_diversity", "projection_r2_drop"),
                 "dissociation": ("ablate_S_major", "ablate_S_ood", "ablate_V_ood", "ablate_V_major", "random_control"),
                 "rank": ("ablate_V_ood",), "transition": ("transition_memorising", "transition_generalising")}
SECTIONS = {"e1": "E1: biased dice", "e2": "E2: in-context linear regression", "e3": "E3: mixture of Markov chains",
            "e4": "E4: planted Dyck", "dual": "Dual modes across task diversity (E1, E3)", "other": "Other claims"}


def machine() -> dict:
    """The machine a reproduction ran on: host, OS, CPU, cores, Python and torch versions."""
    return {"host": platform.node(), "os": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def manifest(profile: str, overrides: tuple[str, ...], device: str, executor: str, experiments: list[str], runs: list[str],
             claims: dict[str, str], figures: list[dict]) -> dict:
    """The manifest of one reproduction (see the module docstring for the fields)."""
    return {"format": FORMAT, "taskgeom": __version__, "profile": profile, "overrides": list(overrides), "device": device,
            "executor": executor, "machine": machine(), "experiments": experiments, "runs": runs, "claims": claims, "figures": figures}


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
        raise TaskgeomError(f"{path} not found: {out} is not a results folder written by `taskgeom reproduce` "
                            f"(taskgeom {__version__} writes {MANIFEST} beside claims.json); {again}")
    data = read_json(path, again)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TaskgeomError(f"{path} has format {found!r}, this taskgeom ({__version__}) reads format {FORMAT}; "
                            f"rerun `taskgeom reproduce --out {out}` (finished runs are reused)")
    return data


def figure_section(figure: dict) -> str:
    """The report section of a manifest figure: that of the first claim it supports, else of its name."""
    return section(figure["claims"][0] if figure["claims"] else Path(figure["path"]).stem, figure["experiment"])


def section(claim_id: str, experiment: str) -> str:
    """The report section of a claim (or figure) checked by ``experiment``: the dual-mode section,
    else the family its id starts with (``e1.P0`` -> ``e1``), else ``other``."""
    family = claim_id.split(".")[0].split("_")[0]
    return "dual" if experiment == DUAL_EXPERIMENT else family if family in SECTIONS else "other"

"""The style gate: ruff's lint rules and its formatter (pyproject.toml's [tool.ruff]) hold the tree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "examples", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    assert importlib.util.find_spec("ruff"), "ruff is not installed: pip install -e '.[test]'"
    done = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"ruff {' '.join(command)}: {done.stdout}{done.stderr}\nfix with: ruff format && ruff check --fix"
    )

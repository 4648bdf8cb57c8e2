"""What a newcomer reads first holds: the license in the package's metadata, the citation file,
the changelog the pages link to instead of issue numbers, ``taskgeom --version``, help texts that
read as sentences, and the Practicalities page's times, held to the published manifests."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_mit_in_the_file_and_in_the_installed_metadata():
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n\nCopyright (c) 2026 the taskgeom authors\n")
    metadata = importlib.metadata.metadata("taskgeom")
    assert metadata.get("License-Expression") == "MIT"  # what `pip show taskgeom` prints (pip >= 25.1; older pip prints an empty License:)


def test_version_prints_the_installed_version_and_exits_0():
    from typer.testing import CliRunner

    import taskgeom
    from taskgeom.cli import app

    result = CliRunner().invoke(app, ["--version"])
    number = importlib.metadata.version("taskgeom")
    assert result.exit_code == 0 and result.output == f"taskgeom {number}\n"
    assert number == taskgeom.__version__  # the package's own constant agrees with what pip installed

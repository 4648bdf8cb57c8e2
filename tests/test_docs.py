"""The API reference builds from the docstrings with warnings as errors (``python -W error -m pdoc
--docformat markdown -o DIR taskgeom``, docs/python-api.md), and it documents every public name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import taskgeom as tg

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_reference_builds_without_warnings_and_documents_every_public_name(tmp_path):
    built = subprocess.run([sys.executable, "-W", "error", "-m", "pdoc", "--docformat", "markdown", "-o", str(tmp_path), "taskgeom"],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and not built.stderr.strip(), built.stderr
    page = (tmp_path / "taskgeom.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="([A-Za-z_][\w.]*)"', page))
    public = [name for name in tg.__all__ if name not in ("__version__", "tasks", "results")]
    assert set(public) <= documented, set(public) - documented
    assert 'id="results"' in (tmp_path / "taskgeom" / "results.html").read_text(encoding="utf-8")  # the function, on its module's page
    for name in public:  # each with its own docstring, not only a signature
        obj = getattr(tg, name)
        doc = (obj.__doc__ or "").strip()
        assert isinstance(obj, float) or (doc and not re.fullmatch(rf"{name}\(.*\)", doc, re.S)), name  # not the generated signature
    for verb in ("StudyRun.heldout", "StudyRun.cache", "StudyRun.geometry", "StudyRun.loss", "StudyRun.ablate",
                 "StudyRun.orthogonal_search", "Geometry.steer", "Geometry.ablate", "Geometry.projection_r2", "Geometry.p3"):
        assert verb in documented, verb
    assert (tmp_path / "taskgeom" / "tasks.html").is_file()


def test_the_python_page_is_linked_from_the_readme_and_names_the_build_command():
    page = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    assert "docs/python-api.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python -W error -m pdoc --docformat markdown -o" in page

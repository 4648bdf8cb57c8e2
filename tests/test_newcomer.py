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


# The Citation File Format 1.2.0 (https://github.com/citation-file-format/citation-file-format, schema.json): the keys
# its schema requires and allows at the top level and in a reference, and the types an identifier may have. cffconvert
# --validate is not a dependency; this checks what a CITATION.cff of ours can get wrong.
CFF_REQUIRED = {"cff-version", "message", "title", "authors"}
CFF_KEYS = CFF_REQUIRED | {"abstract", "commit", "contact", "date-released", "doi", "identifiers", "keywords", "license",
                           "license-url", "preferred-citation", "references", "repository", "repository-artifact",
                           "repository-code", "type", "url", "version"}
CFF_REFERENCE_REQUIRED = {"type", "title", "authors"}
CFF_REFERENCE_TYPES = {"article", "book", "conference-paper", "generic", "manual", "report", "software", "thesis", "unpublished"}
CFF_IDENTIFIER_TYPES = {"doi", "url", "swh", "other"}


def cff_author(entry: dict) -> bool:
    """A person (family-names or given-names) or an entity (name), as the schema's definitions allow."""
    return isinstance(entry, dict) and any(isinstance(entry.get(key), str) and entry[key].strip()
                                           for key in ("family-names", "given-names", "name"))


def test_the_citation_file_is_cff_1_2_0_citing_the_software_and_the_study():
    import re

    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert CFF_REQUIRED <= set(cff) <= CFF_KEYS, set(cff) ^ CFF_KEYS
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["title"] == "taskgeom"
    assert isinstance(cff["message"], str) and cff["message"].strip()
    assert cff["authors"] == [{"name": "the taskgeom authors"}] and all(map(cff_author, cff["authors"]))
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is Python >= 3.11)
    assert f'\nversion = "{cff["version"]}"\n' in pyproject and cff["license"] == "MIT" and '\nlicense = "MIT"\n' in pyproject

    (study,) = cff["references"]
    assert CFF_REFERENCE_REQUIRED <= set(study) and study["type"] in CFF_REFERENCE_TYPES
    assert study["type"] == "article"
    assert study["title"] == "Task Vector Geometry Underlies Dual Modes of Task Inference in Transformers"
    assert [a["family-names"] for a in study["authors"]] == ["Yan", "Yang", "Zhong"] and all(map(cff_author, study["authors"]))
    assert study["year"] == 2026 and study["url"] == "https://arxiv.org/abs/2605.03780"
    for identifier in study["identifiers"]:
        assert identifier["type"] in CFF_IDENTIFIER_TYPES and isinstance(identifier["value"], str)
        if identifier["type"] == "url":
            assert re.match(r"^(https|http|ftp|sftp)://.+", identifier["value"])
    assert {"type": "url", "value": "https://arxiv.org/abs/2605.03780"}.items() <= study["identifiers"][0].items()

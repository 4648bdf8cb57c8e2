"""The guard on stored analyses (``analysis.stored.keys``): each analysis's code is held to the
fingerprint committed beside its format number in tests/stored_fingerprints.json, so a change to a
measurement's code cannot leave stored results readable without someone deciding it; the
fingerprint ignores docstrings, comments and layout, and sees a changed constant or statement."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import replace
from pathlib import Path

from taskgeom.analysis import protocol
from taskgeom.analysis.stored import keys
from taskgeom.claims.registry import experiments

experiments()  # every registered experiment imported: the studies' own stored analyses join FORMATS
COMMITTED = Path(__file__).with_name("stored_fingerprints.json")


def current() -> dict[str, dict]:
    return {
        analysis: {"format": keys.FORMATS[analysis], "code": keys.code_fingerprint(analysis)}
        for analysis in keys.FORMATS
    }


def test_each_analysis_code_is_the_one_its_format_number_was_recorded_with():
    now = current()
    if os.environ.get("TASKGEOM_RECORD_FINGERPRINTS") == "1":
        COMMITTED.write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
    recorded = json.loads(COMMITTED.read_text())
    changed = [a for a in now if recorded.get(a) != now[a]]
    assert not changed, (
        f"the code of the stored analyses {changed} changed since their fingerprints were recorded ({recorded} -> {now}). "
        "Either bump its format number (taskgeom.analysis.stored.keys.FORMATS, or its keys.register call; stored results are then measured again; "
        "say why in CHANGELOG.md), or, if no stored number can move, record the new fingerprint: "
        "TASKGEOM_RECORD_FINGERPRINTS=1 python -m pytest tests/test_stored_keys.py (docs: contributing.md#stored-results)"
    )


def _fingerprint_of(source: str) -> str:
    return ast.dump(keys._normalized(ast.parse(source)), annotate_fields=False)


def test_the_fingerprint_ignores_docstrings_comments_and_layout_but_not_code():
    source = 'import os\nfrom a import b, c\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n\nSITE = "resid_mid"\n'
    same = (
        'from a import c\nimport os\nfrom a import b\ndef f(x):\n    """Another doc, reworded."""\n    # a comment\n'
        '    return (x\n            + 1)\n\n\nSITE = "resid_mid"  # where\n'
    )
    assert _fingerprint_of(source) == _fingerprint_of(same)
    assert _fingerprint_of(source) != _fingerprint_of(source.replace("resid_mid", "resid_post"))
    assert _fingerprint_of(source) != _fingerprint_of(source.replace("x + 1", "x + 2"))
    assert _fingerprint_of(source) != _fingerprint_of(source.replace("import b, c", "import b, d"))


def test_each_analysis_fingerprints_the_measuring_code_it_imports():
    for analysis, entry in keys.ENTRY.items():
        modules = keys.code_modules(analysis)
        assert (
            entry in modules and "taskgeom.analysis.protocol" in modules and "taskgeom.analysis.stored.keys" in modules
        )
        assert all(m.startswith(keys.MEASURING) for m in modules)
    assert "taskgeom.analysis.reading.steering" in keys.code_modules("m1")
    assert "taskgeom.studies.e4.prefix" in keys.code_modules("e4")


def test_the_key_holds_the_format_and_the_protocol_digest():
    assert keys.key("dual") == {"version": keys.FORMATS["dual"], "protocol": protocol.STUDY.digest()}
    row = keys.key("dual")
    assert keys.is_current(row, "dual") and keys.is_current({k: str(v) for k, v in row.items()}, "dual", as_text=True)
    for field, value in (
        ("eval_sequences", 256),
        ("steering_write_site", "resid_post"),
        ("trajectory_estimation", range(40, 61)),
    ):
        with protocol.measured_under(replace(protocol.STUDY, **{field: value})):
            assert not keys.is_current(row, "dual"), field
    assert keys.is_current(row, "dual")
    assert not keys.is_current({**row, "version": row["version"] - 1}, "dual")
    assert protocol.Protocol().digest() == protocol.STUDY.digest()  # a pure function of the fields

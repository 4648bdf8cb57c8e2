"""Every time the README and the pages state for a measurement (a wall time, CPU seconds) is a
published reproduction's, as its ``docs/results/<name>/timings.json`` records it: the whole
reproduction's or one experiment's, rendered as the Practicalities page renders it. A measurement
with no published manifest has no time on the pages."""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_newcomer import duration  # tests/ is on sys.path: pytest puts a rootless test file's folder there

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"cli.md", "changelog.md"}  # the generated --help text, and the CHANGELOG.md include (a record of the past)

NUMBER = r"\d[\d,]*(?:\.\d+)?"
# What a page says a measurement took; whitespace between the words may be a line break. A match
# inside an earlier kind's ("51 s wall" in "1 h 5 min 51 s wall") is that one's.
STATEMENTS = {
    "h min s": r"\b\d+\s+h\s+\d+\s+min(?:\s+\d+\s+s)?\b",  # 1 h 5 min 51 s (and 1 h 5 min)
    "min s": r"\b\d+\s+min\s+\d+\s+s\b",  # 49 min 31 s
    "CPU-s": rf"\b{NUMBER}\s+CPU-s\b",  # 5,914.0 CPU-s
    "s wall": rf"\b{NUMBER}\s+s\s+wall\b",  # 3,950.6 s wall
    "took": r"\btook\s+(?:about\s+)?\d+(?:\.\d+)?\s+(?:min(?:utes)?|h(?:ours?)?|s(?:econds)?)\b(?!\s+\d+\s+s\b)",  # took 53 minutes
    "minutes on": r"\b\d+(?:\s+minutes)?\s+on\s+a\s+\d+-core\b",  # 50 minutes on a 2-core ..., 57 on a 2-core ...
}
# The README's and Getting started's set-up line gives the quick reproductions' wall times in whole
# minutes (tests/test_newcomer.py holds which is which); nowhere else is a whole-minute time allowed.
WHOLE_MINUTES_PAGES = {"README.md", "docs/getting-started.md"}
# Estimates, each labelled as one where it stands: not measurements, so not held to a manifest.
ESTIMATES = {
    ("docs/benchmarks.md", "an estimated 130 CPU-s (65 s wall)"),
    ("docs/results.md", "an estimated 9,000 CPU-s"),
}


MANIFEST = r"docs/results/([\w-]+)"  # a published reproduction's folder, as a page names it


def published_timings() -> dict[str, dict]:
    return {
        path.parent.name: json.loads(path.read_text(encoding="utf-8"))
        for path in sorted((ROOT / "docs" / "results").glob("*/timings.json"))
    }


def renderings(timings: dict) -> set[str]:
    """What a page may write for one published reproduction's times: ``duration()`` of its total
    wall time and of each experiment's; the total's and each experiment's wall_s and cpu_s as
    ``timings.json`` has them (``3,950.6``) or rounded (``3,951``)."""
    written = set()
    for times in [timings["total"], *timings["experiments"].values()]:
        written.add(duration(times["wall_s"]))
        for seconds in (times["wall_s"], times["cpu_s"]):
            written |= {f"{seconds:,.1f}", f"{round(seconds):,}"}
    return written


def stated_times(where: str, text: str) -> list[tuple[str, int, str, str, frozenset[str]]]:
    """Every time ``text`` states, as (where, line, the statement as written, its kind, the
    manifest folders its paragraph names), less the labelled estimates of ESTIMATES."""
    taken = [
        (m.start(), m.end())
        for page, phrase in ESTIMATES
        if page == where
        for m in re.finditer(r"\s+".join(map(re.escape, phrase.split())), text)
    ]
    paragraphs = [
        (m.start(), m.end(), frozenset(re.findall(MANIFEST, m.group(0))))
        for m in re.finditer(r"[^\n]+(?:\n[^\n]+)*", text)
    ]
    found = []
    for kind, pattern in STATEMENTS.items():
        for match in re.finditer(pattern, text):
            if any(start < match.end() and match.start() < end for start, end in taken):
                continue
            taken.append(match.span())
            named = next(names for start, end, names in paragraphs if start <= match.start() < end)
            found.append(
                (
                    match.start(),
                    (where, text.count("\n", 0, match.start()) + 1, " ".join(match.group(0).split()), kind, named),
                )
            )
    return [statement for _, statement in sorted(found)]


def unbacked(statements: list[tuple[str, int, str, str, frozenset[str]]]) -> list[tuple[str, int, str]]:
    """The statements whose time is not that of a published manifest their paragraph names (the
    set-up line's whole minutes: of any published reproduction's total, test_newcomer says which)."""
    published = published_timings()
    minutes = {str(round(timings["total"]["wall_s"] / 60)) for timings in published.values()}
    wrong = []
    for where, line, written, kind, named in statements:
        backing = set().union(*(renderings(published[name]) for name in named if name in published))
        if kind in ("h min s", "min s"):
            ok = written in backing
        elif kind in ("CPU-s", "s wall"):
            ok = written.split()[0] in backing
        elif kind == "minutes on":
            ok = where in WHOLE_MINUTES_PAGES and written.split()[0] in minutes
        else:  # "took N minutes": a time in whole units, which no manifest gives
            ok = False
        if not ok:
            wrong.append((where, line, written))
    return wrong


def pages() -> dict[str, str]:
    paths = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in SKIPPED)]
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in paths}


def test_every_time_the_readme_and_the_pages_state_is_a_published_manifests():
    """Each wall time and CPU-s figure on the README and the pages is one a docs/results/<name>/timings.json
    records, and its paragraph names that folder."""
    texts = pages()
    assert "README.md" in texts and "docs/results.md" in texts and "docs/scale-ladder.md" in texts
    statements = [s for where, text in texts.items() for s in stated_times(where, text)]
    assert unbacked(statements) == [], "a time that no manifest its paragraph names records (page, line, text)"
    # the scan finds what it is for: the manifests' times on the pages that quote them
    assert len(statements) >= 10, statements
    assert {"docs/results.md", "docs/scale-ladder.md", "docs/practicalities.md", "README.md"} <= {
        s[0] for s in statements
    }
    assert ("docs/scale-ladder.md", "1 h 5 min 51 s") in {(s[0], s[2]) for s in statements}
    for where, phrase in ESTIMATES:  # each estimate left out is still on its page and says it is one
        assert phrase in " ".join(texts[where].split()) and "estimate" in phrase, (where, phrase)


def test_a_time_no_manifest_records_is_caught():
    """The scan rejects a planted wrong time of each kind, and a right one beside the wrong manifest;
    it passes the manifests' own."""
    wrong = (
        "The wide rung took 1 h 5 min 57 s wall and 5,941 CPU-s; long-e1 25 min\n48 s, 2,930 s wall\n"
        "(docs/results/wide/, docs/results/long-e1/). Quick took 53 minutes. It takes 57 minutes on a 2-core Intel Xeon.\n\n"
        "The deep rung: 24 min 23 s wall, 2,424.9 CPU-s (`docs/results/quick/`).\n\nThe quick one, 56 min 46 s."
    )
    statements = stated_times("docs/planted.md", wrong)
    assert [s[2] for s in unbacked(statements)] == [
        "1 h 5 min 57 s",
        "5,941 CPU-s",
        "25 min 48 s",
        "2,930 s wall",
        "took 53 minutes",
        "57 minutes on a 2-core",
        "24 min 23 s",
        "2,424.9 CPU-s",
        "56 min 46 s",
    ]
    assert [s[1] for s in unbacked(statements)] == [1, 1, 1, 2, 3, 3, 5, 5, 7]
    right = (
        "The wide rung took 1 h 5 min 51 s wall and 5,914.0 CPU-s (3,951 s wall); long-e1 25 min\n39 s, 2,895 CPU-s;"
        " its schedule 25 min 8 s (`docs/results/wide/timings.json`, `docs/results/long-e1/timings.json`)."
    )
    statements = stated_times("docs/planted.md", right)
    assert len(statements) == 6 and unbacked(statements) == []
    # whole minutes only in the set-up line of the README and Getting started
    assert (
        unbacked(stated_times("README.md", "50 minutes on a 2-core AMD EPYC with AVX2, 57 on a 2-core Intel Xeon"))
        == []
    )
    assert len(unbacked(stated_times("docs/results.md", "50 minutes on a 2-core AMD EPYC"))) == 1

"""The claims table of a results folder as Markdown (``taskgeom report RESULTS --markdown``), so
that a README quotes a command's output instead of numbers typed by hand: one row per claim with
its median, range and per-seed values, a line naming the machine, seeds and commit it came from,
each unstable claim's per-seed parts, and the same verdicts condensed to one row per claim and one
column per recipe (the README's table)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from taskgeom.claims.rules import CAVEATS, caveat_marks
from taskgeom.report.manifest import read_claims, read_manifest

STATUS_TEXT = {"pass": "pass", "fail": "**FAIL**", "unstable": "*unstable*", "n/a": "n/a"}


def number(x) -> str:
    """A value as the tables print it (a dash when it is missing)."""
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def seed_values(claim: dict) -> str:
    """'0: 0.95, 1: 0.88 (fail), ...': each seed's value, its status when it is not the claim's."""
    cells = []
    for row in claim.get("seeds") or []:
        value = "n/a" if row["status"] == "n/a" else number(row["value"])
        mark = f" ({row['status']})" if row["status"] not in ("n/a", claim["status"]) else ""
        cells.append(f"{row['seed']}: {value}{mark}")
    return ", ".join(cells)


def verdict_text(claim: dict) -> str:
    """The verdict, with its caveat when it has one ('**FAIL**, on a model that is not Bayes-optimal (seed 0, 1)')."""
    return STATUS_TEXT[claim["status"]] + (f", {claim['caveat']}" if claim.get("caveat") else "")


def parts_text(parts: dict | None) -> str:
    return ", ".join(f"{k} {number(v)}" for k, v in (parts or {}).items())


def machine_line(manifest: dict) -> str:
    m = manifest["machine"]
    pins = ", ".join(f"{k}={v}" for k, v in (m.get("kernel_environment") or {}).items()) or "none"
    return (
        f"{m.get('cpu')}, torch CPU capability {m.get('cpu_capability')}, torch {m.get('torch')} (MKL {m.get('mkl')}, "
        f"oneDNN {m.get('onednn')}), {m.get('cores')} cores, {m.get('torch_threads')} torch threads, kernel pins: {pins}"
    )


def claims_markdown(out: Path) -> str:
    """The Markdown text: a line on where it came from, the counts, the table, the unstable claims' parts."""
    manifest = read_manifest(out)
    claims = read_claims(Path(out))
    tally = Counter(c["status"] for c in claims)
    commit = manifest.get("commit") or "unknown commit"
    lines = [
        f"Profile `{manifest['profile']}`, seeds {', '.join(map(str, manifest['seeds']))}, taskgeom {manifest['taskgeom']} "
        f"({commit}); machine: {machine_line(manifest)}.",
        "",
        f"**{tally['pass']} pass, {tally['fail']} fail, {tally['unstable']} unstable, {tally['n/a']} n/a of {len(claims)} claims**",
        "",
        "| claim | median | min | max | per seed | threshold | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        lines.append(
            f"| `{c['id']}` | {number(c.get('median'))} | {number(c.get('min'))} | {number(c.get('max'))} | {seed_values(c)} | "
            f"{c['comparison']} {number(c['threshold'])} | {verdict_text(c)} |"
        )
    unstable = [c for c in claims if c["status"] == "unstable"]
    if unstable:
        lines += ["", "Unstable claims, each seed's parts:", ""]
        for c in unstable:
            lines.append(
                f"- `{c['id']}`: "
                + "; ".join(
                    f"seed {r['seed']} {r['status']} {number(r['value'])}"
                    f"{' (' + parts_text(r['parts']) + ')' if r['parts'] else ''}"
                    for r in c["seeds"]
                )
            )
    return "\n".join([*lines, "", *by_recipe(claims)]) + "\n"


def by_recipe(claims: list[dict]) -> list[str]:
    """The verdicts and medians as one row per claim name and one column per recipe, each claim's
    threshold (the exceptions named), a caveat's mark on a verdict with one (``CAVEATS``), and the footnotes."""
    recipes = sorted({c["id"].split(".")[0] for c in claims})
    names = list(dict.fromkeys(c["id"].split(".", 1)[1] for c in claims))
    by_id = {c["id"]: c for c in claims}
    lines = [
        "| claim | threshold | " + " | ".join(r.upper() for r in recipes) + " |",
        "|---|---|" + "---|" * len(recipes),
    ]
    for name in names:
        present = {r: by_id[f"{r}.{name}"] for r in recipes if f"{r}.{name}" in by_id}
        thresholds = {r: f"{c['comparison']} {number(c['threshold'])}" for r, c in present.items()}
        common = Counter(thresholds.values()).most_common(1)[0][0]
        exceptions = ", ".join(f"{r.upper()}: {t}" for r, t in thresholds.items() if t != common)
        cells = [_cell(present[r]) if r in present else "-" for r in recipes]
        lines.append(f"| `{name}` | {common}{f' ({exceptions})' if exceptions else ''} | " + " | ".join(cells) + " |")
    if any(_rests_on_fewer_seeds(c) for c in claims):
        lines += [
            "",
            "(n of N seeds): the verdict and median rest on those n seeds; on the others the claim does not apply "
            "(a null or unreliable share of a gain, say: the Results page gives each seed's reason).",
        ]
    for text, mark, meaning in CAVEATS.values():
        if any(text in (c.get("caveat") or "") for c in claims):
            lines += ["", f"{mark} {text} on at least one seed ({_code(meaning)}); the verdict rule does not read it."]
    return lines


def _cell(claim: dict) -> str:
    """'**FAIL** 0.487', '*unstable* 0.0279 †' (a caveat's mark), 'pass 0.199 (2 of 3 seeds)' (the others n/a:
    a null or unreliable share, say), 'n/a'."""
    median = claim.get("median")
    text = STATUS_TEXT[claim["status"]] + ("" if median is None else f" {number(median)}")
    if _rests_on_fewer_seeds(claim):
        seeds = claim["seeds"]
        text += f" ({sum(row['status'] != 'n/a' for row in seeds)} of {len(seeds)} seeds)"
    marks = caveat_marks(claim.get("caveat"))
    return text + (f" {marks}" if marks else "")


def _code(meaning: str) -> str:
    """A footnote's meaning with the claim names it holds as code ('fails `bayes_optimal`')."""
    return meaning.replace("bayes_optimal", "`bayes_optimal`")


def _rests_on_fewer_seeds(claim: dict) -> bool:
    """Whether some, not all, of the claim's seeds are n/a: its verdict rests on the others."""
    statuses = [row["status"] for row in claim.get("seeds") or []]
    return "n/a" in statuses and any(status != "n/a" for status in statuses)

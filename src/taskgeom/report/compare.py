"""Two results folders side by side (``taskgeom compare A B``): which machine each ran on, which
runs they share differ in the bits of their weights, and which claims differ in verdict or in
median by more than their spread over seeds (the larger of the two ranges, max - min)."""

from __future__ import annotations

from pathlib import Path

from taskgeom.report.manifest import read_claims, read_manifest
from taskgeom.report.markdown import number

MACHINE_KEYS = (
    "cpu",
    "cpu_capability",
    "torch",
    "mkl",
    "onednn",
    "cores",
    "torch_threads",
    "kernels",
    "kernel_environment",
)


def _claims(out: Path) -> dict[str, dict]:
    return {c["id"]: c for c in read_claims(Path(out))}


def _spread(claim: dict) -> float:
    low, high = claim.get("min"), claim.get("max")
    return 0.0 if low is None or high is None else high - low


def claim_differences(a: dict[str, dict], b: dict[str, dict]) -> list[dict]:
    """One row per claim of both whose verdict differs, or whose medians differ by more than the
    larger spread: {id, status_a, status_b, median_a, median_b, spread, why}."""
    rows = []
    for claim_id in [i for i in a if i in b]:
        x, y = a[claim_id], b[claim_id]
        ma, mb, spread = x.get("median", x.get("value")), y.get("median", y.get("value")), max(_spread(x), _spread(y))
        if x["status"] != y["status"]:
            why = "verdict"
        elif ma is not None and mb is not None and abs(ma - mb) > spread:
            why = "median beyond the spread"
        elif (ma is None) != (mb is None):
            why = "measured in one only"
        else:
            continue
        rows.append(
            {
                "id": claim_id,
                "status_a": x["status"],
                "status_b": y["status"],
                "median_a": ma,
                "median_b": mb,
                "spread": spread,
                "why": why,
            }
        )
    return rows


def identical_claims(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """The claims of both whose verdict and every seed's value are exactly equal (the same bits)."""

    def values(claim: dict) -> list:
        return [(row.get("seed"), row.get("value")) for row in claim.get("seeds") or []]

    return [i for i in a if i in b and a[i]["status"] == b[i]["status"] and values(a[i]) == values(b[i])]


def model_differences(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """(runs of both whose model.safetensors are bitwise equal, runs of both that differ), by the
    manifests' sha256."""
    ma, mb = a.get("models") or {}, b.get("models") or {}
    shared = [name for name in ma if name in mb]
    return [n for n in shared if ma[n] == mb[n] and ma[n]], [n for n in shared if ma[n] != mb[n] or not ma[n]]


def compare_results(a: Path, b: Path) -> tuple[str, bool]:
    """The comparison as text, and whether some claim's verdict differs."""
    manifest_a, manifest_b = read_manifest(a), read_manifest(b)
    lines = [
        f"A: {a}  (profile {manifest_a['profile']}, seeds {manifest_a['seeds']})",
        f"B: {b}  (profile {manifest_b['profile']}, seeds {manifest_b['seeds']})",
        "",
        "machine:",
    ]
    for key in MACHINE_KEYS:
        va, vb = manifest_a["machine"].get(key), manifest_b["machine"].get(key)
        lines.append(f"  {key:<20} {va!s:<40} {'=' if va == vb else '!='} {vb!s}")
    equal, differ = model_differences(manifest_a, manifest_b)
    only = len(set(manifest_a.get("models") or {}) ^ set(manifest_b.get("models") or {}))
    lines += [
        "",
        f"runs in both: {len(equal) + len(differ)} ({len(equal)} bitwise equal, {len(differ)} differ); in one only: {only}",
    ]
    lines += [f"  differs: {name}" for name in differ]
    claims_a, claims_b = _claims(a), _claims(b)
    rows = claim_differences(claims_a, claims_b)
    shared = len([i for i in claims_a if i in claims_b])
    lines += [
        "",
        f"claims in both: {shared} ({len(identical_claims(claims_a, claims_b))} with the same verdict and every seed's value "
        f"exactly equal)",
        f"claims that differ: {len(rows)}",
    ]
    for r in rows:
        lines.append(
            f"  {r['id']:<34} {r['status_a']:>8} -> {r['status_b']:<8} median {number(r['median_a'])} -> "
            f"{number(r['median_b'])} (spread {number(r['spread'])}; {r['why']})"
        )
    return "\n".join(lines) + "\n", any(r["why"] == "verdict" for r in rows)

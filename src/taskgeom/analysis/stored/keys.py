"""What a stored analysis is keyed by, for every kind of them (M1, dual, E4's per-seed measurement):
its format number and the digest of the protocol it was measured under. A stored result is read
back only under the same key, so a changed choice of the protocol (``analysis.protocol``) is
measured again by construction, with no number to bump.

The code is guarded too: ``code_fingerprint`` digests the source of the modules an analysis runs
(their syntax trees, without docstrings and comments, so a reworded docstring or a reformatting is
no change), and the test suite holds it against the fingerprint committed beside the format number
(tests/stored_fingerprints.json). Changing a measurement's code fails that test until one of two
things is done: bump the analysis's format number (``FORMATS``, or its ``register`` call; its stored results are measured
again), or, when no stored number can move, record the new fingerprint. (The history of the
format numbers is in CHANGELOG.md.)
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path

from taskgeom.analysis.protocol import active

# The generic analyses' format numbers; a study's own stored analysis joins with ``register``
FORMATS = {"m1": 15, "dual": 13}
# the module each analysis starts from; its code is every module of MEASURING it imports, transitively
ENTRY = {"m1": "taskgeom.analysis.stored.m1", "dual": "taskgeom.analysis.stored.dual"}
MEASURING = (
    "taskgeom.analysis",
    "taskgeom.studies",
    "taskgeom.tasks",
    "taskgeom.models",
    "taskgeom.hooks",
    "taskgeom.rng",
)


def register(analysis: str, number: int, entry: str) -> None:
    """A stored analysis of a study's own: its name, format number and the module it starts from
    (called by that module as it is imported); ValueError when the name is taken by another."""
    if analysis in FORMATS and (FORMATS[analysis], ENTRY[analysis]) != (number, entry):
        raise ValueError(f"stored analysis {analysis!r} is registered twice: by {ENTRY[analysis]} and by {entry}")
    FORMATS[analysis], ENTRY[analysis] = number, entry


def key(analysis: str) -> dict[str, int | str]:
    """{"version": the format number, "protocol": the protocol's digest} of ``analysis`` as measured now."""
    return {"version": FORMATS[analysis], "protocol": active().digest()}


def is_current(stored: dict, analysis: str, as_text: bool = False) -> bool:
    """Whether ``stored`` (a row, or a stored file's key fields; ``as_text``: its values as strings, as
    safetensors metadata keeps them) was made under ``key(analysis)``."""
    return all(stored.get(name) == (str(value) if as_text else value) for name, value in key(analysis).items())


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    return Path(spec.origin)


def _normalized(tree: ast.Module) -> ast.Module:
    """``tree`` without docstrings, and with its top-level imports as one sorted set of the names
    they bind (their order and grouping are layout: an import sorter changes nothing)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    bound = sorted(
        {
            (getattr(node, "module", None) or "", getattr(node, "level", 0), alias.name, alias.asname or "")
            for node in imports
            for alias in node.names
        }
    )
    names = ast.Constant(value=repr(bound))
    tree.body = [ast.Expr(value=names)] + [node for node in tree.body if node not in imports]
    return tree


def _imports(tree: ast.AST, module: str) -> set[str]:
    """The taskgeom modules ``tree`` (of ``module``) imports, wherever the import stands."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # ``from package import module``
    return {name for name in found if name.startswith("taskgeom") and _is_module(name)}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name imported from a module, not a module
        return False


def code_modules(analysis: str) -> list[str]:
    """Every module of ``MEASURING`` that ``analysis``'s entry module imports, transitively, sorted."""
    seen, todo = set(), [ENTRY[analysis]]
    while todo:
        module = todo.pop()
        if module in seen or not module.startswith(MEASURING):
            continue
        seen.add(module)
        todo += _imports(ast.parse(_source(module).read_text(encoding="utf-8")), module)
    return sorted(seen)


def code_fingerprint(analysis: str) -> str:
    """12 hex digits of the sha256 of the code of ``code_modules(analysis)`` (module docstring)."""
    digest = hashlib.sha256()
    for module in code_modules(analysis):
        tree = _normalized(ast.parse(_source(module).read_text(encoding="utf-8")))
        digest.update(f"{module}\n{ast.dump(tree, annotate_fields=False)}\n".encode())
    return digest.hexdigest()[:12]

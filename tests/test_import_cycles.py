"""No import cycles among taskgeom's modules (issue 28), read from the source with ``ast``.

Every import statement counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:``. A deferred or type-only import still says that one module knows the other,
so with a cycle a reader cannot tell which is the lower layer. ``from a.b import c`` is an edge to
the module ``a.b.c`` when there is one, else to ``a.b`` (its ``__init__`` for a package); relative
imports are resolved against the importing module's package. The implicit import of a module's
parent packages is not an edge: a package's ``__init__`` sits on top of its own modules (it
re-exports them), and every module runs it first. Imports by a name in a string
(``importlib.import_module``: a recipe's own experiments) are not seen."""

from __future__ import annotations

import ast
import shutil
from collections import deque
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "taskgeom"


def module_names(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package)} for every ``.py`` file under the package folder ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        names[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return names


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: line of its first import}} for the package at ``root``."""
    modules = module_names(root)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Cycles ``[a, b, ..., a]`` that together pass through every module of every group of modules
    importing one another (a strongly connected component of more than one module): in each group,
    in name order, the shortest cycle through each module that no cycle before it passes through."""
    reach = {start: _reachable(graph, start) for start in graph}
    covered: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in reach[start] and start not in covered:
            found.append(_shortest_cycle(graph, start))
            covered |= set(found[-1])
    return found


def _reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """The modules reachable from ``start`` by one import or more."""
    found, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo.extend(graph.get(module, ()))
    return found


def _shortest_cycle(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    """The shortest path of imports from ``start`` back to it (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph.get(module, ())):
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if target not in came_from:
                came_from[target] = module
                queue.append(target)
    raise ValueError(f"{start} is on no cycle")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``a (line 3) -> b (line 40) -> a``: each module with the line of its import of the next."""
    return (
        " -> ".join(f"{module} (line {graph[module][following]})" for module, following in zip(cycle, cycle[1:]))
        + f" -> {cycle[-1]}"
    )


def test_taskgeom_has_no_import_cycles():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "taskgeom.analysis.study" in graph["taskgeom"]  # the whole package was read
    found = [describe(graph, cycle) for cycle in cycles(graph)]
    assert not found, "import cycles among taskgeom's modules:\n" + "\n".join(found)


def test_a_planted_cycle_is_found(tmp_path):
    """A copy of the package with one deferred import added, from ``hooks`` to ``analysis.reading.edits``
    (which imports it), holds that one cycle; a graph by hand, its two cycles."""
    root = tmp_path / "taskgeom"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    hooks = root / "hooks.py"
    hooks.write_text(hooks.read_text() + "\n\ndef planted():\n    from .analysis.reading.edits import Edit\n")
    graph = import_graph(root)
    found = cycles(graph)
    print("\n".join(describe(graph, cycle) for cycle in found))
    assert found == [["taskgeom.analysis.reading.edits", "taskgeom.hooks", "taskgeom.analysis.reading.edits"]]
    assert graph["taskgeom.hooks"]["taskgeom.analysis.reading.edits"] == len(hooks.read_text().splitlines())

    by_hand = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {"e": 5}, "e": {"d": 6}, "f": {"a": 7}}
    assert cycles(by_hand) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert describe(by_hand, ["d", "e", "d"]) == "d (line 5) -> e (line 6) -> d"


# The layering rule (docs/adding-a-family.md, "Where code goes: the layers"), bottom to top, as the data
# flows. The foundation (0.x) knows nothing of the analyses, and reads upwards in its own sub-layers:
# errors, randomness, hooks and progress bars (0); the building blocks of every settings model (fields,
# the run config's and each family's) and the machine (devices, kernels) (0.1); the task families, each
# carrying its settings model (0.2); the run config's schema, whose task section is the union of the
# registered families' settings, and the recipes that make configs (0.3); the models (0.4); run folders
# (0.5); training, and Hugging Face model directories read as runs (models.pretrained) (0.6). The
# analyses read upwards in four rooms: the measures (computations on states: P0-P3 fits, subspaces,
# shares), reading a run (held-out splits, places and edits, states, steering, projection R^2), the
# facade (a run and its geometry), the stored analyses (m1.json, dual.json). Above them the claims
# (their rules and their catalog), then the report and the results facade, the experiments, the
# recipes' own studies (studies/), and on top the command line and the package's facade. A module
# imports only modules of its own layer or below.
LAYERS = {
    "settings": 0.1,
    "tasks": 0.2,
    "settings.config": 0.3,
    "settings.recipes": 0.3,
    "models": 0.4,
    "runs": 0.5,
    "models.pretrained": 0.6,
    "training": 0.6,
    "analysis.measures": 1.0,
    "analysis.reading": 1.1,
    "analysis.geometry": 1.2,
    "analysis.study": 1.2,
    "analysis.stored": 1.3,
    "claims": 2,
    "report": 3,
    "results": 3,
    "experiments": 4,
    "studies": 5,
    "cli": 6,
    "__main__": 6,
}


def layer(module: str) -> float:
    """The layer of a module of taskgeom: that of its longest prefix in LAYERS (0 for the rest of the foundation, 6 for the facade)."""
    parts = module.split(".")[1:]
    if not parts:
        return 6
    for depth in range(len(parts), 0, -1):
        if ".".join(parts[:depth]) in LAYERS:
            return LAYERS[".".join(parts[:depth])]
    return 0


def test_no_module_imports_one_above_it():
    graph = import_graph(PACKAGE)
    upward = [
        f"{module} ({layer(module)}) -> {target} ({layer(target)}), line {line}"
        for module, edges in graph.items()
        for target, line in edges.items()
        if layer(target) > layer(module)
    ]
    assert upward == []
    assert (
        layer("taskgeom.errors") == layer("taskgeom.hooks") == 0 and layer("taskgeom.analysis.measures.shares") == 1.0
    )
    assert (
        layer("taskgeom.settings.fields")
        < layer("taskgeom.tasks.registry")
        < layer("taskgeom.settings.config")
        < layer("taskgeom.models")
    )
    assert (
        layer("taskgeom.models.hf")
        < layer("taskgeom.runs.folders")
        < layer("taskgeom.models.pretrained")
        == layer("taskgeom.training.train")
    )
    assert (
        layer("taskgeom.claims.catalog") == 2
        and layer("taskgeom.experiments.sensitivity") == 4
        and layer("taskgeom") == 6
    )


def test_no_folder_holds_more_than_thirteen_modules():
    """A folder of the package holds about a dozen modules at most (docs/adding-a-family.md, "Where code goes: the layers")."""
    crowded = {
        str(folder.relative_to(PACKAGE)): n
        for folder in [PACKAGE, *PACKAGE.rglob("*/")]
        if folder.name != "__pycache__" and (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 13
    }
    assert crowded == {}

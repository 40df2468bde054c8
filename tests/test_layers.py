"""The import graph of src/wnw_exp, read from the source with `ast` (imports inside functions included): no cycle
between modules or between packages, and every arrow points down the layer order below."""

from __future__ import annotations

import ast
from pathlib import Path

import wnw_exp

ROOT = Path(wnw_exp.__file__).resolve().parent

# Bottom to top; a unit is a top-level module or subpackage of wnw_exp, or the package itself ("wnw_exp", its
# __init__). A unit may import units of its own layer or below, never above. Why this order:
# - paths, vocabulary, shipped_weights: leaves (where the configs and caches are, the shared word list, the
#   fingerprint of the shipped weights); they import nothing of the project.
# - metrics (WER/BLEU, the mismatch statistics) under rundir, whose `aggregate` scores a run's predictions.
# - the package itself registers the config resolvers, one of which hashes the run identity (rundir); head_scores
#   and the runner read its `__version__`, so it sits between them.
# - head_scores (the calibration file format) is read by methods and written by calibration.
# - data (samples) under backbones (a backbone builds its prompt from a sample's audio); kv (the stores) beside
#   them; methods decide on a store; the engine drives backbone, store and method.
# - calibration decodes with the engine; train reuses calibration's attention scores and the engine's decoding.
# - report reads run directories and the method classes' labels (no backbone, no engine); cli on top of all.
LAYERS: list[set[str]] = [
    {"paths", "vocabulary", "shipped_weights"},
    {"metrics"},
    {"rundir"},
    {"wnw_exp"},
    {"head_scores"},
    {"data"},
    {"backbones", "kv"},
    {"methods"},
    {"engine"},
    {"calibration"},
    {"train"},
    {"report"},
    {"cli"},
]
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its source. `from pkg import name` points at the module
    pkg.name when there is one, else at pkg. The implicit import of a module's parent packages (Python runs every
    __init__ above a module first) is not an arrow of the code and is left out."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, up level - 1
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in files else source)
        graph[mod] = {t for t in targets if t in files and t != mod}
    return graph


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_top_level_and_function_level_imports():
    graph = import_graph()
    assert "wnw_exp.methods.base" in graph["wnw_exp.methods"]  # at the top of the file
    assert "wnw_exp.engine.runner" in graph["wnw_exp.cli.run"]  # inside run_main
    assert "wnw_exp.methods.wnw.triage" in graph["wnw_exp.methods.wnw.policy"]  # `from pkg import submodule`
    assert "wnw_exp.data.base" in graph["wnw_exp.data.synthetic"]  # relative
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_unit_has_a_layer():
    units = {unit(m) for m in import_graph()}
    assert units == set(LAYER_OF), f"units without a layer: {sorted(units - set(LAYER_OF))}; " \
                                   f"layers of no unit: {sorted(set(LAYER_OF) - units)}"


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages():
    units: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        units.setdefault(unit(mod), set()).update(unit(t) for t in targets if unit(t) != unit(mod))
    assert cycles(units) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = sorted(f"{mod} -> {t}" for mod, targets in import_graph().items() for t in targets
                    if LAYER_OF[unit(t)] > LAYER_OF[unit(mod)])
    assert upward == []

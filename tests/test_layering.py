"""The package's layers, read from the source with ``ast``: no import circle, and no arrow that runs back up.

planning (numpy only) -> data (torch + Lightning) -> model -> metrics/callbacks; ``lit_seqpack.batch`` is the
contract between data and model, so model/ and metrics/ read batches without importing data/.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from functools import cache
from pathlib import Path

import lit_seqpack

ROOT = Path(lit_seqpack.__file__).parent
PACKAGE = "lit_seqpack"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: ``TYPE_CHECKING`` blocks skipped, function bodies only when asked."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """Every module an import statement loads (``from pkg import sub`` loads ``pkg.sub`` when it is a module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:  # relative import
        anchor = module.split(".")[: len(module.split(".")) - node.level + (module in _packages())]
        base = ".".join([*anchor, base] if base else anchor)
    names = {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in names if name in MODULES} or {base}


@cache
def _packages() -> frozenset[str]:
    return frozenset(name for name, path in MODULES.items() if path.name == "__init__.py")


@cache
def imports_of(module: str, *, module_level: bool) -> frozenset[str]:
    tree = ast.parse(MODULES[module].read_text())
    return frozenset(t for node in _imports(tree, module_level=module_level) for t in _targets(module, node))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _cycles(*, module_level: bool = True) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself), Tarjan's way.

    ``module_level=False`` also follows the imports inside function bodies (a deferred import hides a circle from
    Python, not from a reader).
    """
    graph = {
        name: sorted(t for t in imports_of(name, module_level=module_level) if t in MODULES and t != name)
        for name in MODULES
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for name in graph:
        if name not in index:
            visit(name)
    return found


def _offenders(layer: str, forbidden: tuple[str, ...], *, module_level: bool = False) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module in MODULES
        if _inside(module, layer)
        for target in imports_of(module, module_level=module_level)
        if any(_inside(target, f) for f in forbidden)
    )


def test_the_walk_sees_every_module_and_resolves_submodule_imports():
    assert {"lit_seqpack.batch", "lit_seqpack.data.sources.tokenized", "lit_seqpack.planning.plan"} <= set(MODULES)
    assert "lit_seqpack.data.sources.tokenized" in imports_of("lit_seqpack.data.sources.files", module_level=True)
    assert "lit_seqpack.planning._windows" not in imports_of("lit_seqpack.planning._order", module_level=True)


def test_no_import_circle_in_the_package():
    assert _cycles() == []


def test_no_import_circle_in_the_model_layer_even_through_function_body_imports():
    """hf.py <-> isolation.py (+ _hf_dispatch, _isolation_trace, _leak_message) was one, tied by deferred imports."""
    assert [c for c in _cycles(module_level=False) if any(_inside(m, "lit_seqpack.model") for m in c)] == []


def test_the_cycle_finder_finds_a_circle(monkeypatch):
    """The check above can fail: two modules importing each other form one component."""
    fake = {"lit_seqpack.a": frozenset({"lit_seqpack.b"}), "lit_seqpack.b": frozenset({"lit_seqpack.a"})}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", dict.fromkeys(fake, ROOT))
    monkeypatch.setattr(sys.modules[__name__], "imports_of", lambda name, *, module_level: fake[name], raising=True)
    assert _cycles() == [["lit_seqpack.a", "lit_seqpack.b"]]


def test_planning_imports_neither_torch_nor_lightning_nor_the_layers_below():
    forbidden = ("torch", "lightning", "torchmetrics", "lit_seqpack.data", "lit_seqpack.model", "lit_seqpack.metrics")
    assert _offenders("lit_seqpack.planning", forbidden) == []


def test_metrics_import_nothing_from_the_data_layer():
    assert _offenders("lit_seqpack.metrics", ("lit_seqpack.data", "lit_seqpack.model")) == []


def test_the_batch_contract_imports_no_layer():
    """``batch.py`` is read by data and model alike: it imports nothing from them, not even lazily."""
    forbidden = ("lit_seqpack.data", "lit_seqpack.model", "lit_seqpack.metrics", "lightning")
    assert _offenders("lit_seqpack.batch", forbidden) == []
    assert _offenders("lit_seqpack._checks", ("torch", "lightning", PACKAGE)) == []


def test_the_model_layer_imports_nothing_from_the_data_layer():
    assert _offenders("lit_seqpack.model", ("lit_seqpack.data",)) == []


def test_the_model_layer_reaches_the_data_layer_only_through_the_parallel_layout():
    """What stays of model -> data at this point: the parallel layout only (owned by helper `fields`)."""
    allowed = {"lit_seqpack.data._trainer", "lit_seqpack.data.batching.context_parallel"}
    edges = _offenders("lit_seqpack.model", ("lit_seqpack.data",))
    assert {edge.split(" imports ")[1] for edge in edges} <= allowed


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('lit_seqpack'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_metrics_or_the_contract_loads_no_data_module():
    loaded = _loaded_after("import lit_seqpack.metrics.tracker, lit_seqpack.batch")
    assert "lit_seqpack.metrics.tracker" in loaded
    assert not {m for m in loaded if _inside(m, "lit_seqpack.data")}


def test_importing_the_mixin_loads_no_data_module():
    loaded = _loaded_after("import lit_seqpack.model.mixin")
    assert not {m for m in loaded if _inside(m, "lit_seqpack.data")}


def test_the_pipelines_take_the_settings_and_the_source_never_the_datamodule():
    """Only the DataModule's own module and the entry points import it; sources and batching import no pipeline."""
    below = ("lit_seqpack.data.indexed", "lit_seqpack.data.streaming", "lit_seqpack.data.batching")
    below += ("lit_seqpack.data.sources", "lit_seqpack.data.settings", "lit_seqpack.data._trainer")
    for layer in below:
        assert _offenders(layer, ("lit_seqpack.data.datamodule",)) == [], layer
    for layer in ("lit_seqpack.data.sources", "lit_seqpack.data.batching"):
        assert _offenders(layer, ("lit_seqpack.data.indexed", "lit_seqpack.data.streaming")) == [], layer
    assert _offenders("lit_seqpack.data.indexed", ("lit_seqpack.data.streaming",)) == []
    assert _offenders("lit_seqpack.data.streaming", ("lit_seqpack.data.indexed.pipeline",)) == []


def test_the_data_layer_stays_a_few_rooms_and_a_thin_datamodule():
    """The measures of the data-layer redesign: ~14 entries in data/, a DataModule of ~400 lines and ~27 settings."""
    import inspect

    from lit_seqpack.data.datamodule import SeqPackDataModule

    data = ROOT / "data"
    entries = [p for p in data.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len(entries) <= 14, sorted(p.name for p in entries)
    assert len((data / "datamodule.py").read_text().splitlines()) <= 400
    # 27 + stream_split (how ranks read a stream) + truncation_side (which end overlong="truncate" keeps)
    # + loader_timeout (a stuck loader worker ends the job with an error on every rank)
    # + predict_source (what trainer.predict scores)
    assert len(inspect.signature(SeqPackDataModule).parameters) <= 31


# -- the consolidation by concept (issue 32): few rooms, one face per layer with one list of names ------------------

FACES = sorted(name for name, path in MODULES.items() if path.name == "__init__.py")


def _face_names(face: str) -> list[str]:
    return list(importlib.import_module(face).__all__)


def _importers() -> dict[str, set[str]]:
    """Who imports each module (function-body imports included)."""
    found: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target in imports_of(name, module_level=False):
            if target in found and target != name:
                found[target].add(name)
    return found


def test_the_package_stays_at_most_100_modules():
    assert len(MODULES) <= 100, len(MODULES)


def test_a_private_module_exists_because_several_modules_share_it():
    """A module split off one importer to keep a file short is folded back (at most 3 such exceptions)."""
    alone = sorted(
        name
        for name, users in _importers().items()
        if name.rsplit(".", 1)[-1].startswith("_") and MODULES[name].name != "__init__.py" and len(users) == 1
    )
    assert len(alone) <= 3, alone


def test_each_face_lists_its_names_once_and_resolves_each():
    """One list per face (``__all__`` is the export table's keys), every name importable from it."""
    for face in FACES:
        names = _face_names(face) if hasattr(importlib.import_module(face), "__all__") else []
        assert len(names) == len(set(names)), face
        for name in names:
            assert getattr(importlib.import_module(face), name) is not None, (face, name)
        source = MODULES[face].read_text()
        assert "TYPE_CHECKING" not in source, f"{face} lists its names a second time for type checkers"


def test_the_root_and_the_faces_stay_small():
    """About 40 names at the root (what the quick starts and guides import), at most 70 distinct over all faces."""
    assert len(_face_names("lit_seqpack")) <= 40
    distinct = {n for face in FACES if hasattr(importlib.import_module(face), "__all__") for n in _face_names(face)}
    assert len(distinct) <= 70, len(distinct)

"""``PlanConfig`` has its own module: the old import path still works and the planner has no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lit_seqpack.planning as planning
from lit_seqpack.planning import config, plan

PACKAGE = Path(planning.__file__).parent


def _planning_imports(path: Path) -> set[str]:
    """Every ``lit_seqpack.planning`` module ``path`` imports, wherever the import is (TYPE_CHECKING, functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_seqpack.planning"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if (PACKAGE / f"{n.rsplit('.', 1)[1]}.py").exists()} or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lit_seqpack.planning")}
    return {name for name in found if name != "lit_seqpack.planning"}


def test_planning_has_no_import_circle():
    graph = {
        f"lit_seqpack.planning.{p.stem}": _planning_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"
    }
    assert "lit_seqpack.planning.config" in graph["lit_seqpack.planning._windows"]  # the config, not plan.py
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                pytest.fail(f"import circle: {' -> '.join([*path, module, target])}")
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_plan_config_keeps_its_old_import_path():
    assert plan.PlanConfig is config.PlanConfig is planning.PlanConfig
    assert plan.MODES is config.MODES and plan.MICROBATCH_ORDERS is config.MICROBATCH_ORDERS
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        config.PlanConfig(max_tokens=8, world_size=0)

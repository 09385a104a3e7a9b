"""Planning: which sequences share a microbatch, and which rank trains it at which optimizer step.

Pure Python + numpy (compiled hot loops with numba); never imports torch or Lightning. Names are
re-exported lazily so that importing one piece does not compile or import the others.
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ALGORITHMS": "lit_seqpack.planning.algorithms",
    "DEFAULT_ALGORITHM": "lit_seqpack.planning.algorithms",
    "PACKING_ALGORITHMS": "lit_seqpack.planning.algorithms",
    "PackingAlgorithm": "lit_seqpack.planning.algorithms",
    "Packer": "lit_seqpack.planning.algorithms",
    "get_packer": "lit_seqpack.planning.algorithms",
    "PackingStats": "lit_seqpack.planning.stats",
    "packing_stats": "lit_seqpack.planning.stats",
    "LazyPlan": "lit_seqpack.planning.lazy",
    "Plan": "lit_seqpack.planning.plan",
    "PlanConfig": "lit_seqpack.planning.config",
    "PlanStats": "lit_seqpack.planning.plan",
    "build_plan": "lit_seqpack.planning.plan",
}

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "PACKING_ALGORITHMS",
    "LazyPlan",
    "Packer",
    "PackingAlgorithm",
    "PackingStats",
    "Plan",
    "PlanConfig",
    "PlanStats",
    "build_plan",
    "get_packer",
    "packing_stats",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

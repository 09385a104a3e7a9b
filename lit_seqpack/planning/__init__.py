"""Planning: which sequences share a microbatch, and which rank trains it at which optimizer step.

Pure Python + numpy (compiled hot loops with numba); never imports torch or Lightning. Names are
re-exported lazily so that importing one piece does not compile or import the others.
"""

from __future__ import annotations

from lit_seqpack._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PlanConfig": "lit_seqpack.planning.config",
    "Plan": "lit_seqpack.planning.plan",
    "PlanStats": "lit_seqpack.planning.plan",
    "build_plan": "lit_seqpack.planning.plan",
    "get_packer": "lit_seqpack.planning.algorithms",
    "packing_stats": "lit_seqpack.planning.stats",
    "PACKING_ALGORITHMS": "lit_seqpack.planning.algorithms",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""Deprecated alias of the old path: the label convention moved to :mod:`lit_seqpack.batch`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "IGNORE_INDEX": "lit_seqpack.batch",
    "shift_labels": "lit_seqpack.batch",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())

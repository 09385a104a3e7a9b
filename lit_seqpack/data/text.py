"""Deprecated alias of the old path: the raw-text source moved to :mod:`lit_seqpack.data.sources.text`.

Each name still resolves to the same object, with a ``DeprecationWarning``; this module will be removed.
"""

from __future__ import annotations

from lit_seqpack._lazy import deprecated_exports

_MOVED = {
    "TextDataset": "lit_seqpack.data.sources.text",
    "load_tokenizer": "lit_seqpack.data.sources.text",
}

__all__ = sorted(_MOVED)

__getattr__, __dir__ = deprecated_exports(__name__, _MOVED, globals())

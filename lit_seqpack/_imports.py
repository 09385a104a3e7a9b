"""The one place that declares which optional dependencies are installed.

Each flag is a :class:`~lightning_utilities.core.imports.RequirementCache`: it reads package metadata (and only
falls back to importing the module when the metadata is missing) the first time it is turned into a ``bool``,
never at import time. So importing this module imports neither torch nor any optional package, and touches no
CUDA device. Heavy imports stay inside the functions that need them; this module only answers "is it there?".

Example:
    >>> from lit_seqpack._imports import FLASH_ATTN_AVAILABLE
    >>> isinstance(bool(FLASH_ATTN_AVAILABLE), bool)
    True
"""

from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

__all__ = [
    "FLASH_ATTN_AVAILABLE",
    "FLASH_ATTN_INSTALL_HINT",
    "MATPLOTLIB_AVAILABLE",
    "TRANSFORMERS_AVAILABLE",
]

FLASH_ATTN_AVAILABLE = RequirementCache("flash-attn>=2.6", module="flash_attn")
TRANSFORMERS_AVAILABLE = RequirementCache("transformers>=4.48", module="transformers")
MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib>=3.7", module="matplotlib")

FLASH_ATTN_INSTALL_HINT = (
    "install it with `pip install 'lit-seqpack[flash-attn]'` (or `pip install flash-attn --no-build-isolation`); "
    "flash-attn ships only a source distribution, so it needs a CUDA toolkit to build, and it must be built "
    "against the torch you run (a torch/flash-attn ABI mismatch shows up as an ImportError with an undefined "
    "symbol: reinstall flash-attn after upgrading torch)"
)

"""The one place that declares the optional dependencies: whether each is installed, and how to import it.

Two tools, used at every call site:

- a flag per package (``TRANSFORMERS_AVAILABLE``, ...), a :class:`~lightning_utilities.core.imports.RequirementCache`
  that reads package metadata (and only falls back to importing the module when the metadata is missing) the first
  time it is turned into a ``bool``, never at import time: for "is it there?" (pick a backend, skip a test);
- :func:`require`, called inside the function that needs the package: the module, or an ``ImportError`` that names
  what needed it and the ``pip install`` that fixes it.

So importing this module imports neither torch nor any optional package, and touches no CUDA device.

Example:
    >>> from lit_seqpack._imports import FLASH_ATTN_AVAILABLE
    >>> isinstance(bool(FLASH_ATTN_AVAILABLE), bool)
    True
    >>> require("json", purpose="reading JSON").__name__
    'json'
"""

from __future__ import annotations

import importlib
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

__all__ = [
    "BackendUnavailableError",
    "DATASETS_AVAILABLE",
    "FLASH_ATTN_AVAILABLE",
    "FLASH_ATTN_INSTALL_HINT",
    "LITDATA_AVAILABLE",
    "LITDATA_INSTALL_HINT",
    "MATPLOTLIB_AVAILABLE",
    "PEFT_AVAILABLE",
    "PYARROW_AVAILABLE",
    "TRANSFORMERS_AVAILABLE",
    "require",
]

FLASH_ATTN_AVAILABLE = RequirementCache("flash-attn>=2.6", module="flash_attn")
TRANSFORMERS_AVAILABLE = RequirementCache("transformers>=4.48", module="transformers")
MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib>=3.7", module="matplotlib")
PYARROW_AVAILABLE = RequirementCache("pyarrow>=14", module="pyarrow")
DATASETS_AVAILABLE = RequirementCache("datasets>=2.14", module="datasets")
PEFT_AVAILABLE = RequirementCache("peft>=0.10", module="peft")
LITDATA_AVAILABLE = RequirementCache("litdata>=0.2.76", module="litdata")

FLASH_ATTN_INSTALL_HINT = (
    "install it with `pip install 'lit-seqpack[flash-attn]'` (or `pip install flash-attn --no-build-isolation`); "
    "flash-attn ships only a source distribution, so it needs a CUDA toolkit to build, and it must be built "
    "against the torch you run (a torch/flash-attn ABI mismatch shows up as an ImportError with an undefined "
    "symbol: reinstall flash-attn after upgrading torch)"
)

LITDATA_INSTALL_HINT = (
    "pip install --no-deps 'litdata>=0.2.76' && pip install lightning-utilities filelock boto3 requests urllib3 "
    "tifffile obstore (litdata's own requirements pull torchvision and with it another torch: install it without "
    "them; lit-seqpack[litdata] lists the same packages)"
)

# top-level module -> (extra of lit-seqpack that installs it, its name on PyPI)
_EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "transformers"),
    "peft": ("peft", "peft"),
    "pyarrow": ("parquet", "pyarrow"),
    "datasets": ("datasets", "datasets"),
    "matplotlib": ("plotting", "matplotlib"),
}


def require(module: str, *, purpose: str) -> ModuleType:
    """Import ``module`` (an optional dependency, or one of its submodules) or explain how to install it.

    Args:
        module: the dotted module name, e.g. ``"pyarrow.parquet"``.
        purpose: what needs it, for the message (``"reading Parquet files"``).

    Raises:
        ImportError: the package is missing (or broken); the message names ``purpose`` and the ``pip install``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        extra, pypi = _EXTRAS.get(package, (None, package))
        fix = f"pip install 'lit-seqpack[{extra}]' (or pip install {pypi})" if extra else f"pip install {pypi}"
        raise ImportError(f"{purpose} needs the optional package {package!r} ({err}): {fix}") from err


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend (an attention kernel) cannot run here; the message says why and how to fix it.

    Raised by :func:`~lit_seqpack.model.attention.varlen_attention` and the kernels behind it; declared here, beside
    the availability flags, so every kernel module raises the same class without importing another.
    """

"""PEP 562 module attributes: lazy re-exports of the package ``__init__`` modules, deprecated aliases of old paths."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` that import ``exports[name]`` on first access.

    Args:
        package: the re-exporting package (for the error message).
        exports: public name -> module that defines it.
        namespace: the package's ``globals()``; a resolved name is cached there.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def deprecated_exports(
    module: str, moved: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` of a module whose public names moved elsewhere.

    Each access to a moved name emits one ``DeprecationWarning`` naming the new home, then returns the object
    (the same object, so ``isinstance`` checks and pickles made before the move keep working).

    Args:
        module: the old module (named in the warning).
        moved: public name -> the module that defines it now.
        namespace: the old module's ``globals()``.

    Example:
        >>> import types, warnings
        >>> old = types.ModuleType("old")
        >>> old.__getattr__, _ = deprecated_exports("old", {"sqrt": "math"}, vars(old))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     root = old.sqrt(4.0)
        >>> root, str(caught[0].message)
        (2.0, 'old.sqrt moved to math.sqrt; import it from there (the old path will be removed)')
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {target}.{name}; import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(target), name)

    def __dir__() -> list[str]:  # the moved names stay out: tools that scan dir() (pytest's fixtures) never warn
        return sorted(namespace)

    return __getattr__, __dir__

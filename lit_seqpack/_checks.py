"""Argument checks shared by every layer: ints, bools, choices and round-ups, each with one error wording.

A bad value raises at construction with a message that names the setting and the value, never later in a kernel.
This module imports nothing but the standard library and numpy, so the torch-free planner may use it too.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

import numpy as np

__all__ = ["check_choice", "check_flag", "check_int", "check_optional_int", "is_int", "round_up"]

_Choice = TypeVar("_Choice")


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer, Python's or numpy's, and not a bool.

    Example:
        >>> is_int(3), is_int(np.int32(3)), is_int(True), is_int(3.0)
        (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int if it is an integer (numpy's too, never a bool) within the bounds.

    Args:
        name: the setting, as the user spells it (named in the error).
        value: the value to check.
        minimum: the smallest value allowed (``None``: no lower bound).
        maximum: the largest value allowed (``None``: no upper bound).

    Raises:
        ValueError: ``value`` is not an integer or out of bounds.

    Example:
        >>> check_int("num_workers", np.int64(2), minimum=0)
        2
        >>> check_int("max_tokens", 0, minimum=1)
        Traceback (most recent call last):
            ...
        ValueError: max_tokens must be an int >= 1, got 0
    """
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int{_bounds(minimum, maximum)}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def check_optional_int(name: str, value: object, *, minimum: int | None = None) -> int | None:
    """``None``, or ``value`` checked as by :func:`check_int`; the error says that ``None`` is allowed.

    Example:
        >>> check_optional_int("pad_to_multiple_of", None, minimum=1) is None
        True
        >>> check_optional_int("pad_to_multiple_of", 2.5, minimum=1)
        Traceback (most recent call last):
            ...
        ValueError: pad_to_multiple_of must be an int >= 1 or None, got 2.5
    """
    if value is None:
        return None
    try:
        return check_int(name, value, minimum=minimum)
    except ValueError:
        raise ValueError(f"{name} must be an int{_bounds(minimum, None)} or None, got {value!r}") from None


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a real bool (``"false"``, ``"no"`` and ``1`` are refused, not read as ``True``).

    Raises:
        TypeError: ``value`` is not a bool.

    Example:
        >>> check_flag("shuffle", False)
        False
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool (True or False), got {type(value).__name__}")
    return bool(value)


def check_choice(name: str, value: _Choice, choices: Collection[_Choice]) -> _Choice:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the setting, the value and the choices.

    Example:
        >>> check_choice("mode", "packing", ("packing", "dynamic", "padded"))
        'packing'
        >>> check_choice("mode", "pack", ("packing", "dynamic"))
        Traceback (most recent call last):
            ...
        ValueError: mode='pack' must be one of ('packing', 'dynamic')
    """
    if isinstance(value, bool) or value not in choices:  # True == 1 would match a choice 1
        raise ValueError(f"{name}={value!r} must be one of {tuple(choices)}")
    return value


def round_up(value: int | np.ndarray, multiple: int | None) -> int | np.ndarray:
    """The smallest multiple of ``multiple`` that is ``>= value``, elementwise on arrays (``value`` when None).

    Example:
        >>> round_up(13, 8), round_up(16, 8), round_up(13, None)
        (16, 16, 13)
    """
    return value if multiple is None else -(-value // multiple) * multiple


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    return "" if maximum is None else f" <= {maximum}"

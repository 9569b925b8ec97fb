"""Argument checks shared by the planner modules.

Every check raises with the argument's name, what was expected and what was given, so a
caller several layers up can tell which of its inputs was wrong.
"""

from __future__ import annotations

from typing import Any, Iterable


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``, else raise."""
    # bool is an int subclass; True as a block size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_optional_int(name: str, value: Any, minimum: int = 0) -> int | None:
    """Like :func:`check_int`, but ``None`` passes through."""
    if value is None:
        return None
    return check_int(name, value, minimum)


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ValueError listing them."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value

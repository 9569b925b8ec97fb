"""Argument checks shared by the planner modules.

Every check raises with the argument's name, what was expected and what was given, so a
caller several layers up can tell which of its inputs was wrong.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence


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


def check_number(name: str, value: Any, minimum: float, maximum: float = math.inf) -> float:
    """Return ``value`` as a float if it is a finite int or float (not a bool) in
    [``minimum``, ``maximum``], else raise: NaN or an infinity would poison every sum after it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    expected = f"a finite number >= {minimum:g}" + (f" and <= {maximum:g}" if maximum < math.inf else "")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the floats
        number = math.inf
    if not (math.isfinite(number) and minimum <= number <= maximum):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return number


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ValueError listing them."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_iterable(name: str, value: Any, items: str) -> Iterable:
    """Return ``value`` if it is an iterable other than a string (whose characters would be
    taken for ``items``), else raise TypeError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of {items}, got {type(value).__name__}")
    return value


def check_tokens(name: str, tokens: Any) -> tuple:
    """Return ``tokens`` as a tuple if it is a sequence (not a string) of hashable token ids,
    else raise TypeError naming the first item that is not."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}")
    tokens = tuple(tokens)
    try:
        hash(tokens)  # the cache keys its tree on slices of them
    except TypeError:
        index, item = next((i, t) for i, t in enumerate(tokens) if not _hashable(t))
        raise TypeError(
            f"{name} must hold hashable token ids, got {type(item).__name__} at index {index}"
        ) from None
    return tokens


def check_size(what: str, count: int, limit: int, remedy: str) -> None:
    """Refuse work whose size ``count`` (a bound computed from the arguments, before anything is
    built) passes ``limit``, so that an absurd argument answers at once instead of running out
    of time or memory. ``what`` names what is counted, ``remedy`` which arguments to change."""
    if count > limit:
        raise ValueError(f"{what} would be up to {count}, more than the limit of {limit}: {remedy}")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True

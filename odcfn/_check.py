"""One vocabulary for bad arguments: a wrong *type* is a ``TypeError``, a wrong *value* a
``ValueError``, and the message names the field, what it must be, and what it got.

``bool`` is an ``int`` to Python, so ``True`` would pass as a size of 1: every integer and
number check here refuses it.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

__all__ = ["ArgTypeError", "check_int", "check_number", "is_int", "is_number"]


class ArgTypeError(TypeError, ValueError):
    """An argument of the wrong type. Also a ``ValueError``, so code written when odcfn raised
    ``ValueError`` for every bad argument still catches it."""


def is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _bounds(lo: float | None, hi: float | None, strict_lo: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if strict_lo else '>='} {lo}")
    if hi is not None:
        parts.append(f"<= {hi}")
    return " " + " and ".join(parts) if parts else ""


def check_int(
    v: Any,
    name: str,
    *,
    at_least: int | None = None,
    at_most: int | None = None,
    none_ok: bool = False,
    want: str | None = None,
) -> int | None:
    """``v`` if it is an int (not a bool) in ``[at_least, at_most]`` (or None when allowed).
    ``want``: how the message describes what is allowed (default: from the bounds)."""
    if v is None and none_ok:
        return None
    want = want or f"an int{_bounds(at_least, at_most, False)}{' or None' if none_ok else ''}"
    if not is_int(v):
        raise ArgTypeError(f"{name} must be {want}, got {type(v).__name__} {v!r}")
    if (at_least is not None and v < at_least) or (at_most is not None and v > at_most):
        raise ValueError(f"{name} must be {want}, got {v!r}")
    return int(v)


def check_number(
    v: Any,
    name: str,
    *,
    positive: bool = False,
    at_least: float | None = None,
    finite: bool = True,
    none_ok: bool = False,
    want: str | None = None,
) -> float | None:
    """``v`` as a float if it is a real number (not a bool), finite unless ``finite=False``,
    ``> 0`` when ``positive``, ``>= at_least`` when given (or None when allowed)."""
    if v is None and none_ok:
        return None
    kind = "a finite number" if finite else "a number"
    bounds = _bounds(0 if positive else at_least, None, positive)
    want = want or f"{kind}{bounds}{' or None' if none_ok else ''}"
    if not is_number(v):
        raise ArgTypeError(f"{name} must be {want}, got {type(v).__name__} {v!r}")
    if (finite and not math.isfinite(v)) or math.isnan(v):
        raise ValueError(f"{name} must be {want}, got {v!r}")
    if (positive and not v > 0) or (at_least is not None and not v >= at_least):
        raise ValueError(f"{name} must be {want}, got {v!r}")
    return float(v)

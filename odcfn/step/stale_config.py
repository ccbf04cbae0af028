"""``StepConfig(staleness=...)``: the bound τ on how many versions behind a gather may read.

An int τ >= 0 applies to every unit. A dict maps unit-name patterns (``fnmatch``, like
``odcfn.trainable``'s patterns) to τ: ``{"head": 0, "embed": 0, "*": 1}`` keeps the head and the
embedding synchronous (HAT's hybrid synchronisation) and lets the layers read one version behind.
A unit takes the τ of its exact name if the dict has it, else of the first pattern (in the dict's
order) that matches it, else 0: a unit nobody named stays synchronous, the safe default.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Union

__all__ = ["Staleness", "check_staleness", "max_staleness", "unit_staleness"]

Staleness = Union[int, Mapping[str, int]]


def _check_tau(tau: object, where: str) -> None:
    # bool is an int subclass: True would silently mean τ = 1
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"{where} must be an int >= 0 (0: synchronous), got {tau!r}")


def check_staleness(value: object) -> None:
    """A ``ValueError`` naming ``StepConfig.staleness`` when ``value`` is not an int >= 0 or a
    non-empty dict of str patterns to ints >= 0."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("StepConfig.staleness: an empty dict names no unit (use an int)")
        for pattern, tau in value.items():
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"StepConfig.staleness: pattern {pattern!r} must be a non-empty str")
            _check_tau(tau, f"StepConfig.staleness[{pattern!r}]")
        return
    _check_tau(value, "StepConfig.staleness")


def max_staleness(value: Staleness) -> int:
    """The largest τ any unit may get (0: the synchronous path, unchanged)."""
    return max(value.values()) if isinstance(value, Mapping) else int(value)


def unit_staleness(value: Staleness, units: Sequence[str]) -> dict[str, int]:
    """Each unit's τ. A pattern that matches no unit is a ``ValueError`` (a typo would otherwise
    leave units synchronous without a word)."""
    if not isinstance(value, Mapping):
        return {u: int(value) for u in units}
    for pattern in value:
        if pattern not in units and not fnmatch.filter(units, pattern):
            raise ValueError(
                f"StepConfig.staleness: pattern {pattern!r} matches no unit of the model "
                f"(units: {list(units)})"
            )
    out = {}
    for u in units:
        if u in value:
            out[u] = int(value[u])
            continue
        hit = next((p for p in value if fnmatch.fnmatchcase(u, p)), None)
        out[u] = 0 if hit is None else int(value[hit])
    return out

"""Reductions for ``all_reduce``: min, max and sum of numbers or equal-length lists of numbers.

Every rank reduces the same gathered values in rank order, so the result — float sums
included — is bit-identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

ReduceOp = Literal["min", "max", "sum"]

# sum() starts from 0, so a sum of bools is their count (an int) at any group size.
REDUCE_OPS: dict[str, Callable[[Sequence[Any]], Any]] = {"min": min, "max": max, "sum": sum}

_NUMBER = (int, float, bool)


def _problem(value: Any, length: int | None) -> str | None:
    """Why ``value`` cannot be reduced with the first rank's value (of list length ``length``)."""
    if isinstance(value, list):
        if length is None:
            return "a list, but the first rank gave a number"
        if len(value) != length:
            return f"a list of length {len(value)}, expected {length}"
        for item in value:
            if type(item) not in _NUMBER:
                return f"a list holding {type(item).__name__} (only int, float, bool reduce)"
        return None
    if type(value) not in _NUMBER:
        return f"{type(value).__name__} (only int, float, bool or lists of them reduce)"
    if length is not None:
        return "a number, but the first rank gave a list"
    return None


def check_reducible(values: Sequence[Any]) -> tuple[int, str] | None:
    """The first (index, problem) among ``values`` that keeps them from reducing, or None."""
    length = len(values[0]) if isinstance(values[0], list) else None
    for index, value in enumerate(values):
        problem = _problem(value, length)
        if problem is not None:
            return index, problem
    return None


def reduce_values(values: Sequence[Any], op: str) -> Any:
    """Reduce values that passed ``check_reducible``: scalars, or lists elementwise."""
    fold = REDUCE_OPS[op]
    if isinstance(values[0], list):
        return [fold(column) for column in zip(*values)]
    return fold(values)

"""Reductions over gathered values (pure): what reduces, and why the rest does not."""

from __future__ import annotations

import pytest

from tokenspeed_aio.collective.reduce import check_reducible, reduce_values


@pytest.mark.parametrize(
    ("values", "op", "expected"),
    [
        ([3, 1, 2], "min", 1),
        ([3, 1.5, 2], "max", 3),
        ([0.1, 0.2, 0.3], "sum", 0.1 + 0.2 + 0.3),  # folded in rank order
        ([True, False, True], "sum", 2),  # a count
        ([True], "sum", 1),  # a count at any group size
        ([True, False], "min", False),
        ([[1, 5], [2, 4]], "max", [2, 5]),
        ([[1, 5], [2, 4]], "sum", [3, 9]),
    ],
)
def test_reductions(values, op, expected):
    assert check_reducible(values) is None
    assert reduce_values(values, op) == expected


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ([1, "2"], (1, "str (only int, float, bool or lists of them reduce)")),
        ([[1], [1, 2]], (1, "a list of length 2, expected 1")),
        ([[1], 2], (1, "a number, but the first rank gave a list")),
        ([1, [2]], (1, "a list, but the first rank gave a number")),
        ([[1], [None]], (1, "a list holding NoneType (only int, float, bool reduce)")),
    ],
)
def test_what_does_not_reduce_is_named(values, problem):
    assert check_reducible(values) == problem

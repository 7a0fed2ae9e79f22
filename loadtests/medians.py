"""Benchmarks measured in rounds (``--rounds N``): the rounds' results as one."""

from __future__ import annotations

import statistics
from typing import Any


def median_of(rounds: list[Any]) -> Any:
    """The rounds' results as one: every number the median over the rounds that have it, anything
    else (names, versions) the last round's."""
    last = rounds[-1]
    if isinstance(last, dict):
        return {k: median_of([r[k] for r in rounds if isinstance(r, dict) and k in r]) for k in last}
    if all(isinstance(r, int | float) and not isinstance(r, bool) for r in rounds):
        return statistics.median(rounds)
    return last

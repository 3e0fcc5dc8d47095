"""Checks of a strategy's hyper-parameters, shared by the algorithm modules: each raises
StrategyError naming the strategy, the parameter and what it may be."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from ._types import StrategyError


def check_choice(strategy: str, key: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise StrategyError(f"strategy {strategy!r}: {key} = {value!r}; "
                            f"valid: {', '.join(choices)}")


def check_number(strategy: str, key: str, value, lo: float, hi: float, *,
                 lo_open: bool = False, hi_open: bool = False, why: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise StrategyError(f"strategy {strategy!r}: {key} = {value!r} must be a number in "
                            f"{interval}" + (f" ({why})" if why else ""))

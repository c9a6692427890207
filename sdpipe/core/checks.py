"""The one checker of numbers a user passes: whole numbers and numbers in a range, with one-line errors that
name the field and what is allowed (``"steps: must be an integer >= 1, got 0"``). Pure: standard library only.

``True`` and ``False`` are never numbers here (Python counts them as ints), nor is NaN.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["integer", "is_integer", "is_number", "number"]


def is_integer(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is neither a ``bool`` nor NaN."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not (isinstance(value, float) and math.isnan(value))
    )


def integer(name: str, value: Any, lo: int = 1, hi: Optional[int] = None, why: str = "") -> int:
    """``value`` if it is an integer from ``lo`` (to ``hi``), else ``ValueError("name: must be an integer >= lo,
    got ...")`` (``in lo..hi`` with a ``hi``); ``why`` is said after the range (``" (epochs; 0 = none)"``)."""
    if is_integer(value) and value >= lo and (hi is None or value <= hi):
        return value
    allowed = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
    raise ValueError(f"{name}: must be an integer {allowed}{why}, got {value!r}")


def number(
    name: str, value: Any, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False, whole: bool = False
) -> float:
    """``value`` as a float (an int if ``whole``) if it is a number in the range, else a one-line ``ValueError``.

    A closed range reads "must be a number from 1 to 8", an open-ended one "must be >= 1.0" (or "> 0.0").
    """
    kind = "a whole number" if whole else "a number"
    ok = is_number(value)
    inside = ok and (value > lo if lo_open else value >= lo) and value <= hi and not (whole and value % 1)
    if inside:
        return int(value) if whole else float(value)
    if hi < math.inf:
        lo_s = f"> {lo:g} and <= {hi:g}" if lo_open else f"from {lo:g} to {hi:g}"
        raise ValueError(f"{name}: must be {kind} {lo_s}, got {value!r}")
    if not ok or (whole and value % 1):
        raise ValueError(f"{name}: must be {kind}, got {value!r}")
    raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {value!r}")

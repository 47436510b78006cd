"""How measured numbers are written for people: unmeasured (None or NaN) reads "n/a"."""

from __future__ import annotations


def measured(value: float | None) -> bool:
    return value is not None and value == value  # NaN is not equal to itself


def ms(value: float | None) -> str:
    """Milliseconds to a tenth: "12.3 ms"."""
    return f"{value:.1f} ms" if measured(value) else "n/a"


def pct(share: float | None, digits: int = 1) -> str:
    """A share (0..1) as a percentage: "12.3 %"."""
    return f"{100 * share:.{digits}f} %" if share is not None and measured(share) else "n/a"

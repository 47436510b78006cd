"""How measured numbers are written for people: unmeasured (None or NaN) reads "n/a"."""

from __future__ import annotations


def measured(value: float | None) -> bool:
    """The value was measured: neither None nor NaN."""
    return value is not None and value == value  # NaN is not equal to itself


def ms(value: float | None, unit: str = " ms") -> str:
    """Milliseconds to a tenth: "12.3 ms" (`unit="ms"`: "12.3ms", the text box's columns)."""
    return f"{value:.1f}{unit}" if measured(value) else "n/a"


def ms_fine(value: float | None) -> str:
    """Milliseconds with digits enough to tell a small measured value (a per-sample cost, a
    line's share of a step) from zero: "0.042 ms", "2.05 ms", "16.4 ms"."""
    if value is None or not measured(value):
        return "n/a"
    if abs(value) >= 10:
        return ms(value)
    if abs(value) >= 0.1:
        return f"{value:.2f} ms"
    return f"{value:.3f} ms"


def pct(share: float | None, digits: int = 1) -> str:
    """A share (0..1) as a percentage: "12.3 %"."""
    return f"{100 * share:.{digits}f} %" if share is not None and measured(share) else "n/a"

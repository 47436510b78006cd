"""The report's palette and its small HTML pieces: escaped text with `code` spans, badges, section
titles, values that read as code (inline styles only: JupyterLab's sanitizer drops <style>)."""

from __future__ import annotations

import re
from html import escape
from typing import TYPE_CHECKING, Any

from ..analysis.checklist import CHECK, FIX, OK
from ..analysis.summary_keys import Summary

if TYPE_CHECKING:
    pass


# Colours: a light card that keeps its own background in dark notebook themes.
FG, MUTED, BORDER, SUBTLE, BG = "#1f2328", "#57606a", "#d0d7de", "#f6f8fa", "#ffffff"
WAIT_COLOUR, COMPUTE_COLOUR, OTHER_COLOUR = "#e8590c", "#1c7ed6", "#adb5bd"
FORWARD_COLOUR, BACKWARD_COLOUR, OPTIMIZER_COLOUR = "#15aabf", "#37b24d", "#ae3ec9"  # the rest: compute's
LOOP_COLOUR, LOOP_BG = "#6741d9", "#f3f0ff"
LOADER_COLOUR, LOADER_BG = "#d9480f", "#fff4e6"
SEVERITY = {  # colour, background
    "info": ("#1864ab", "#e7f5ff"),
    "warn": ("#a35200", "#fff9db"),
    "critical": ("#c92a2a", "#fff5f5"),
}
BADGE = {  # colour, background
    OK: ("#2b8a3e", "#ebfbee"),
    FIX: ("#c92a2a", "#ffe3e3"),
    CHECK: ("#a35200", "#fff3bf"),
}
SANS = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'Liberation Mono', monospace"


def esc(value: Any) -> str:
    """`value` as text, HTML-escaped (quotes too)."""
    return escape(str(value), quote=True)


BACKTICKS = re.compile(r"`([^`]+)`")


def with_code(text: str) -> str:
    """Escaped text whose `quoted` parts show as code."""
    out, end = [], 0
    for match in BACKTICKS.finditer(text):
        out.append(esc(text[end : match.start()]))
        out.append(
            f'<code style="font-family:{MONO};font-size:12px;padding:0 3px;border-radius:3px;'
            f'background-color:{SUBTLE};color:{FG}">{esc(match.group(1))}</code>'
        )
        end = match.end()
    out.append(esc(text[end:]))
    return "".join(out)


def fmt_rate(value: float | None, unit: str) -> str:
    """A rate with its unit: "12.3 steps/s", "1,234 samples/s", "n/a steps/s"."""
    if value is None or value != value:
        return f"n/a {unit}"
    return f"{value:,.1f} {unit}" if value < 1000 else f"{value:,.0f} {unit}"


def compute_name(summary: Summary) -> str:
    """"GPU compute" when the verdict read the GPU clock, else "CPU compute"."""
    return "GPU compute" if summary.get("clock") == "gpu" else "CPU compute"


def badge(text: str, colour: str, background: str) -> str:
    """A small rounded label (a checklist item's status) in its colours."""
    return (
        f'<span style="display:inline-block;min-width:38px;text-align:center;padding:1px 6px;'
        f"border-radius:10px;font-size:11px;font-weight:600;letter-spacing:0.02em;"
        f'color:{colour};background-color:{background}">{esc(text)}</span>'
    )


def section_title(text: str) -> str:
    """The small capitalised title above a part of the report."""
    return (
        f'<div style="margin:14px 0 6px 0;font-size:11px;font-weight:700;color:{MUTED};'
        f'text-transform:uppercase;letter-spacing:0.06em">{esc(text)}</div>'
    )


# Notebook front-ends style tables (striped rows, right-aligned cells, theme colours): every
# table element states its own alignment, padding and colours so the card reads the same.
TABLE = (
    f"border-collapse:collapse;width:100%;font-size:12px;color:{FG};margin:0;"
    "table-layout:auto;border:none"
)
ROW = "background-color:transparent"
CELL = f"padding:3px 8px;border:none;border-bottom:1px solid {BORDER};line-height:1.4;color:{FG}"
CODE_LIKE = re.compile(r"[^\s]+|[\w.]+\((?:[^()]|\([^()]*\))*\)")


def value_html(text: str, strong: bool = False) -> str:
    """A value as code (`0`, `True`, `y.to(device)`), a phrase as plain text."""
    weight = "font-weight:600;" if strong else ""
    if len(text) <= 48 and CODE_LIKE.fullmatch(text):
        return (
            f'<span style="font-family:{MONO};font-size:12px;{weight}padding:0 4px;'
            f'border-radius:4px;background-color:{SUBTLE}">{esc(text)}</span>'
        )
    return f'<span style="{weight}">{esc(text)}</span>'

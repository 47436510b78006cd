"""The tune table, row by row: as plain text and as HTML with a bar per setting (the result and
the progress views draw it)."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from ..analysis.tune_plan import OK, TIMEOUT, Split, rate_text


def split_text(split: Mapping[str, Any]) -> str:
    """The num_workers=0 split (as TuneResult.split holds it) in one sentence."""
    from ..analysis.tune_plan import split_sentence

    return split_sentence(
        Split(
            split["batch_ms"],
            split["samples_per_batch"],
            split["getitem_ms"],
            split["collate_ms"],
            split["pin_ms"],
            split["cpu_share"],
            split["source"],
        )
    )


def fed(row: Mapping[str, Any], model: float | None) -> str:
    """"yes" when the row's rate keeps the model fed, "no" when not, "" when unknown."""
    from ..analysis.tune_plan import required_rate

    rate = row.get("batches_per_s")
    if model is None or rate is None:
        return ""
    return "yes" if rate >= required_rate(row["settings"]["num_workers"], model) else "no"


def table_lines(
    rows: Sequence[Mapping[str, Any]], model: float | None, best: Mapping[str, Any] | None
) -> list[str]:
    """The rows as a plain text table; the best one marked with *."""
    head = ("setting", "batches/s", "x model", "fed", "start-up", "samples")
    body = []
    for row in rows:
        rate = row.get("batches_per_s")
        startup = row.get("startup_s")
        cells = (
            str(row["label"]),
            rate_text(rate) if rate is not None else "-",
            f"{rate / model:.2f}" if rate is not None and model else "-",
            fed(row, model) or "-",
            f"{startup:.2f} s" if startup is not None else "-",
            f"{row['samples_measured']:,}" if row.get("samples_measured") is not None else "?",
        )
        if row.get("status") not in (OK, TIMEOUT):
            cells = (*cells[:5], f"{cells[5]}  {row.get('status')}: {row.get('message')}")
        body.append((row.get("settings") == best, cells))
    widths = [max([len(head[i])] + [len(c[i]) for _, c in body]) for i in range(5)]
    widths.append(max([len(head[5])] + [len(c[5].split("  ")[0]) for _, c in body]))

    def fmt(mark: str, cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        count, _, status = cells[5].partition("  ")
        rest = "  ".join(c.rjust(w) for c, w in zip((*cells[1:5], count), widths[1:], strict=True))
        return f"{mark} {first}  {rest}  {status}".rstrip()

    return [fmt(" ", head)] + [fmt("*" if is_best else " ", cells) for is_best, cells in body]


BAR = "#4e79a7"
BEST = "#59a14f"
MODEL = "#e15759"


CELL = "padding:2px 8px;text-align:right"


def _td(content: str, left: bool = False) -> str:
    style = CELL.replace("right", "left") if left else CELL
    return f"<td style='{style}'>{content}</td>"


def table_html(rows: Sequence[Mapping[str, Any]], model: float | None, best: Mapping[str, Any] | None) -> str:
    """The rows as an HTML table: a bar per setting against the model's rate (a red line), the
    best one in bold and green."""
    e = html.escape
    top = max([r.get("batches_per_s") or 0.0 for r in rows] + [model or 0.0]) or 1.0
    body = []
    for row in rows:
        rate = row.get("batches_per_s")
        is_best = row.get("settings") == best
        width = 100.0 * (rate or 0.0) / top
        bar = (
            f'<div style="position:relative;height:12px;width:220px;background:rgba(127,127,127,.15)">'
            f'<div style="height:12px;width:{width:.1f}%;background:{BEST if is_best else BAR}"></div>'
        )
        if model:
            bar += (
                f'<div style="position:absolute;top:-2px;left:{100.0 * model / top:.1f}%;'
                f'height:16px;border-left:2px solid {MODEL}"></div>'
            )
        bar += "</div>"
        status = row.get("status")
        note = "" if status in (OK, TIMEOUT) else f"{status}: {row.get('message')}"
        startup = row.get("startup_s")
        name = e(str(row["label"]))
        samples = row.get("samples_measured")
        cells = [
            f"<b>{name}</b>" if is_best else name,
            e(rate_text(rate)) if rate is not None else "-",
            bar,
            e(fed(row, model) or "-"),
            f"{startup:.2f} s" if startup is not None else "-",
            f"{samples:,}" if samples is not None else "?",
            e(note),
        ]
        body.append("<tr>" + "".join(_td(c, i in (0, 6)) for i, c in enumerate(cells)) + "</tr>")
    head = "".join(
        f"<th style='{CELL.replace('right', 'left') if h == 'setting' else CELL}'>{h}</th>"
        for h in ("setting", "batches/s", "", "fed", "start-up", "samples", "")
    )
    return (
        f"<table style='border-collapse:collapse;margin:4px 0'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )

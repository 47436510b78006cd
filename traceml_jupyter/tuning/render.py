"""TuneResult rendered: the plain-text table and the HTML table with a bar per setting."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..analysis.number_text import ms as _ms
from ..analysis.tune_plan import OK, TIMEOUT, Split, rate_text

if TYPE_CHECKING:
    from .result import TuneResult


def result_text(result: TuneResult) -> str:
    """The result as plain text: the model's rate, the table, the advice, the line to write."""
    lines = [
        f"traceml tune: {result.loader_label}, {len(result.rows)} setting(s) in "
        f"{result.elapsed_s:.1f} s (budget {result.budget_s:g} s)"
    ]
    if result.stopped:
        lines.append("  Stopped: the table has what was measured before the stop.")
    if result.error:
        lines.append(f"  Error: {result.error}")
    if result.model_batches_per_s is not None:
        lines.append(
            f"  model: {rate_text(result.model_batches_per_s)} batches/s "
            f"({_ms(result.compute_ms)} compute a step, {result.batches_per_step or 1:g} "
            f"batch(es) a step; {result.model_source})"
        )
    else:
        lines.append("  model: rate unknown (no %%traceml run of this loader, no compute_ms=)")
    lines.extend(
        "  " + line
        for line in table_lines(result.rows, result.model_batches_per_s, result.best_settings)
    )
    lines.extend(f"  {a}" for a in result.advice)
    if result.code:
        lines.append(f"  Write: {result.code}")
    if result.split is not None and not any(
        a.startswith("At num_workers=0") for a in result.advice
    ):
        lines.append("  " + split_text(result.split))
    lines.extend(f"  Note: {n}" for n in result.notes)
    return "\n".join(lines)


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


def result_html(result: TuneResult) -> str:
    """The result as HTML: a bar per setting against the model's rate, the advice, the line to
    write."""
    e = html.escape
    model = result.model_batches_per_s
    top = max([r.get("batches_per_s") or 0.0 for r in result.rows] + [model or 0.0]) or 1.0
    body = []
    for row in result.rows:
        rate = row.get("batches_per_s")
        is_best = row.get("settings") == result.best_settings
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
    model_line = (
        f"model: <b>{e(rate_text(model))}</b> batches/s ({e(_ms(result.compute_ms))} compute a "
        f"step, {result.batches_per_step or 1:g} batch(es) a step; {e(str(result.model_source))})"
        f' <span style="color:{MODEL}">&#9474;</span>'
        if model is not None
        else "model: rate unknown (no %%traceml run of this loader, no compute_ms=)"
    )
    parts = [
        '<div class="traceml-tune" style="font-family:var(--jp-ui-font-family,sans-serif);'
        'font-size:13px;line-height:1.5">',
        f"<div><b>traceml tune</b> {e(result.loader_label)}: {len(result.rows)} setting(s) in "
        f"{result.elapsed_s:.1f} s (budget {result.budget_s:g} s)</div>",
    ]
    if result.stopped:
        parts.append("<div><b>Stopped</b>: the table has what was measured before the stop.</div>")
    if result.error:
        parts.append(f"<div><b>Error</b>: {e(result.error)}</div>")
    parts.append(f"<div>{model_line}</div>")
    parts.append(
        f"<table style='border-collapse:collapse;margin:4px 0'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )
    parts.extend(f"<div>{e(a)}</div>" for a in result.advice)
    if result.code:
        parts.append(
            "<pre style='margin:4px 0;padding:4px 8px;background:rgba(127,127,127,.12)'>"
            f"{e(result.code)}</pre>"
        )
    if result.split is not None and not any(
        a.startswith("At num_workers=0") for a in result.advice
    ):
        parts.append(f"<div>{e(split_text(result.split))}</div>")
    parts.extend(f"<div><i>Note</i>: {e(n)}</div>" for n in result.notes)
    parts.append("</div>")
    return "".join(parts)



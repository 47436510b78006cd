"""Every renderer over every canned result (tests/result_factory.py), no cell run: the text box,
the HTML report, the report file's page, the JSON and compare each show what the result holds —
its verdict, its figures or n/a, its notes and error, its ranks, passes, findings, cost per line
and checklist — and nothing they should not (a script, a style sheet, a NaN)."""

from __future__ import annotations

import json
import re
from html import unescape
from typing import Any

import pytest
from report_page import Page, assert_cost_bars
from result_factory import CANNED, CHECKLIST, LINE_COSTS, QUOTED, result_of

from traceml_jupyter.analysis.checklist import Item
from traceml_jupyter.analysis.compare import compare_summaries
from traceml_jupyter.analysis.number_text import ms_fine
from traceml_jupyter.analysis.phases import phase_sentence
from traceml_jupyter.kernel.code_facts import CodeContext, KernelReading
from traceml_jupyter.result import RunResult, text, to_dict
from traceml_jupyter.views.report import ROOT_CLASS, render_html
from traceml_jupyter.views.report_file import report_page

NAMES = sorted(CANNED)
TILES = (("data_wait_ms", "Data wait"), ("compute_ms", "CPU compute"), ("step_ms", "Step time"))


@pytest.fixture(params=NAMES)
def result(request: pytest.FixtureRequest) -> RunResult:
    return CANNED[request.param]()


def words(value: str) -> str:
    return " ".join(value.split())


def test_every_branch_a_renderer_has_is_canned() -> None:
    results = {name: make() for name, make in CANNED.items()}
    assert any(r.data.phases for r in results.values())
    assert any(r.line_costs for r in results.values())
    assert any(r.summary.get("resource_findings") for r in results.values())
    assert any(r.reading.checklist for r in results.values()) and any(r.reading.quoted_cells for r in results.values())
    assert any(r.error for r in results.values()) and any(r.notes for r in results.values())
    assert any(r.ranks for r in results.values()) and any(r.gpu.used for r in results.values())


# -- the text box ------------------------------------------------------------------------------


def test_the_text_box_says_the_verdict_and_everything_the_result_holds(result: RunResult) -> None:
    box = text(result)
    lines = box.splitlines()
    assert lines[0].startswith(f"traceml: {result.name} - {result.n_steps} steps ({result.steps.definition})")
    if result.loop.line is not None:
        assert f", loop on line {result.loop.line}" in lines[0]
    assert f"Step Time: {result.verdict.label}" in box
    for phase in result.data.phases:
        assert f"Phase: {phase_sentence(phase)}" in lines
    for finding in result.summary.get("resource_findings") or []:
        assert any(line.startswith("Also: ") and finding["text"] in line for line in lines), finding["label"]
    assert (f"Stopped by: {result.error}" in lines) == (result.error is not None)
    assert [line for line in lines if line.startswith("Note: ")] == [f"Note: {note}" for note in result.notes]
    for rank in result.ranks or ():
        assert f"rank {rank['rank']}" in box


def test_unmeasured_figures_read_n_a_in_the_text_box_never_zero() -> None:
    box = text(CANNED["no steps"]())
    assert "n/a" in box and "0.0ms" not in box


# -- the HTML report ---------------------------------------------------------------------------


def test_the_html_report_is_self_contained_and_scoped(result: RunResult) -> None:
    html = render_html(result)
    assert html.startswith(f'<div class="{ROOT_CLASS}"')
    for banned in ("<script", "<style", "<link", "src=", "href=", "@import", "url("):
        assert banned not in html
    page = Page(html)
    box = page.one("tml-text")
    assert box.tag == "details"
    assert words(text(result)) in box.text  # the text box, folded under the report


def test_the_html_report_shows_the_verdict_and_the_figures_or_n_a(result: RunResult) -> None:
    page = Page(render_html(result))
    banner = page.one("tml-verdict")
    assert f"Step Time: {result.verdict.label}" in banner.text
    assert f"tml-{result.verdict.severity}" in banner.classes
    numbers = [e.text for e in page.by_class("tml-number")]
    s = result.summary
    if result.summary.get("clock") == "cpu":
        for tile, (key, title) in zip(numbers, TILES, strict=False):
            key = f"mean_{key}" if s.get(f"mean_{key}") is not None else key  # the means lead
            shown = ms_fine(s[key]) if s.get(key) is not None else "n/a"
            assert tile.startswith(f"{title} {shown}"), (tile, key)
    if s.get("step_ms") is None:  # unmeasured: n/a, never 0.0
        for tile in numbers:
            assert "n/a" in tile and "0.0" not in tile
        assert "n/a" in page.one("tml-evidence").text and "0.0" not in page.one("tml-evidence").text


def test_the_html_report_shows_what_the_result_holds(result: RunResult) -> None:
    page = Page(render_html(result))
    assert len(page.by_class("tml-phase")) == len(result.data.phases)
    findings = result.summary.get("resource_findings") or []
    assert len(page.by_class("tml-finding")) == len(findings)
    for finding in findings:
        assert finding["label"] in page.one("tml-resources").text
    if result.error:
        assert "Stopped by:" in page.one("tml-error").text and result.error in page.one("tml-error").text
    for note in result.notes:
        assert words(note) in page.one("tml-notes").text
    for item in result.reading.checklist or ():
        assert page.one(f"tml-item-{item['key']}")
    rank_rows = [e for e in page.elements if e.tag == "tr" and re.match(r"rank \d", e.text)]
    assert len(rank_rows) == len(result.ranks or ())
    if result.loop.cell_source:
        for number, code in enumerate(result.loop.cell_source.splitlines()[1:], start=2):
            assert words(code) in page.line(number).text


def test_the_ranks_are_one_row_each_with_their_figures() -> None:
    result = CANNED["two ranks"]()
    page = Page(render_html(result))
    rows = [e.text for e in page.elements if e.tag == "tr" and re.match(r"rank \d", e.text)]
    assert [row.split()[1] for row in rows] == ["0", "1"]
    for row, rank in zip(rows, result.ranks or (), strict=True):
        assert f"{ms_fine(rank['data_wait_ms'])} {ms_fine(rank['compute_ms'])}" in row
        assert ms_fine(rank["step_ms"]) in row and "holds the others back" not in row  # none waits
    for note in result.summary["rank_notes"]:
        assert note in text(result)


def test_a_cell_that_writes_html_shows_as_text() -> None:
    cell = "%%traceml\nlabel = \"<script>alert('x')</script>\"\nfor x, y in loader:\n    model(x).sum().backward()\n"
    result = result_of("escaped", [1.0] * 10, [5.0] * 10, cell_source=cell, loop_line=3, loop_where="this cell")
    html = render_html(result)
    assert "<script" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "label = \"<script>alert('x')</script>\"" in Page(html).line(2).text


def test_the_cost_per_line_sits_beside_each_body_line() -> None:
    result = CANNED["cost per line"]()
    page = Page(render_html(result))
    assert_cost_bars(page, LINE_COSTS)  # line 3 (the 5 ms sleep) dearest; `if loss > 0: continue` on 5-6


def test_without_a_cost_per_line_there_are_no_heat_bars() -> None:
    page = Page(render_html(CANNED["input-bound"]()))
    assert not page.by_class("tml-heat") and not page.by_class("tml-heat-note")
    assert "ms per step" not in page.one("tml-code-pane").text


def test_the_checklist_the_kernel_read_is_shown_fixes_first_and_the_rest_folded() -> None:
    result = CANNED["checklist read"]()
    page = Page(render_html(result))
    fix = page.one("tml-item-num_workers")
    assert "tml-fix" in fix.classes and "tml-folded" not in fix.ancestors
    assert "0 → 4" in fix.text and "In [3], line 2" in fix.text
    ok = page.one("tml-item-pin_memory")
    assert "tml-ok" in ok.classes and "tml-folded" in ok.ancestors and "Not applicable" in ok.text


# -- the report file's page --------------------------------------------------------------------


def test_the_report_file_is_a_whole_page_around_the_report(result: RunResult) -> None:
    page = report_page(result)
    assert page.startswith("<!DOCTYPE html>\n<html")
    title = page[page.index("<title>") + len("<title>") : page.index("</title>")]
    assert unescape(title) == f"traceml: {result.name} - {result.verdict.label}"
    assert render_html(result) in page  # the same report the notebook shows
    assert page.rstrip().endswith("</body></html>") and "<script" not in page


def test_the_report_file_shows_the_checklist_as_the_kernel_read_it() -> None:
    result = CANNED["input-bound"]()
    reading = KernelReading(CodeContext(), [Item.from_dict(item) for item in CHECKLIST])
    page = Page(report_page(result, reading))
    assert "tml-fix" in page.one("tml-item-num_workers").classes
    assert report_page(result, reading) != report_page(result)  # the reading is what adds it
    assert not Page(report_page(result)).by_class("tml-item-num_workers")


# -- the JSON ----------------------------------------------------------------------------------


def test_the_json_holds_the_result_with_null_for_what_was_not_measured(result: RunResult) -> None:
    document = json.loads(json.dumps(to_dict(result), allow_nan=False))
    assert document["name"] == result.name and document["verdict"]["label"] == result.verdict.label
    assert document["notes"] == list(result.notes) and document["error"] == result.error
    for key, value in result.summary.items():
        if value is None:
            assert document["summary"][key] is None, key
    assert document["phases"] == [dict(p) for p in result.data.phases]
    assert document["checklist"] == ([dict(i) for i in result.reading.checklist] if result.reading.checklist else None)
    assert document["quoted_cells"] == (dict(result.reading.quoted_cells) if result.reading.quoted_cells else None)
    if result.line_costs is not None:
        lines = [row["line"] for row in document["line_costs"]["statements"]]
        assert lines == [row["line"] for row in result.line_costs["statements"]]
    assert (document["ranks"] is None) == (result.ranks is None)


def test_the_checklist_and_the_cells_it_quotes_are_in_the_json() -> None:
    document = to_dict(CANNED["checklist read"]())
    assert [item["key"] for item in document["checklist"]] == [item["key"] for item in CHECKLIST]
    assert document["quoted_cells"] == QUOTED


# -- compare -----------------------------------------------------------------------------------


def compared(a: RunResult, b: RunResult) -> Any:
    return compare_summaries(a.name, a.summary, a.verdict.label, b.name, b.summary, b.verdict.label)


def test_each_result_compares_with_itself_and_with_another(result: RunResult) -> None:
    same = compared(result, result)
    other = CANNED["compute-bound"]()
    against = compared(result, other)
    for c in (same, against):
        as_dict = c.to_dict()
        json.dumps(as_dict, allow_nan=False)
        assert c.text().startswith(f"traceml compare: {c.name_a} -> {c.name_b}")
        assert c.conclusion in c.text()
    assert (same.label_a, same.label_b) == (result.verdict.label,) * 2
    if result.summary.get("steps_per_s"):
        assert same.speedup == pytest.approx(1.0)
        assert against.label_b == "COMPUTE-BOUND" and against.speedup is not None
    else:  # no analysed step: nothing to divide by
        assert same.speedup is None and against.speedup is None


def test_the_fix_that_removes_the_wait_compares_as_faster() -> None:
    c = compared(CANNED["input-bound"](), CANNED["compute-bound"]())
    assert c.speedup == pytest.approx(40.0 / 10.2, rel=0.02)
    assert "INPUT-BOUND -> COMPUTE-BOUND" in c.conclusion

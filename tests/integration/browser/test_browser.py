"""What a person sees in JupyterLab 4 and Notebook 7 (headless Chromium): the chart gains steps
while the traced cell runs, then the report shows the verdict and the checklist, with no widget
errors. Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import REPO
from jupyter_harness import (
    ensure_no_news_overrides,
    ensure_python3_kernel,
    jupyter_server,
    loader_cell,
    notebook,
    traced_cell,
)

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
SCREENSHOTS = REPO / "artifacts" / "screenshots"
EPOCHS = 3
SLEEP_MS = 10.0  # per sample, 8 a batch: >= 80 ms a step, 96 steps: the cell runs >= 8 s
TRACED = 2  # index of the traced cell
VIEWPORT = {"width": 1280, "height": 1000}
WIDGET_ERRORS = (
    "Error displaying widget",
    "Failed to load model class",
    "Error creating widget",
    "Could not create a view",
    "Loading widget...",
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs /usr/bin/chromium (scripts/install_browser.sh installs it)",
    ),
]

# What the traced cell's output shows: the marks of its bqplot figures, counted per figure
# (the first is the chart of the recent steps; the overview strip follows it).
SAMPLE_CHART = """(cell) => {
  const figures = [];
  for (const figure of cell.querySelectorAll('.bqplot.figure svg.svg-figure')) {
    let points = 0;
    for (const path of figure.querySelectorAll('path.line, path.area')) {
      const d = path.getAttribute('d') || '';
      points += (d.match(/-?[0-9]*[.]?[0-9]+(e-?[0-9]+)?/g) || []).length / 2;
    }
    figures.push({points, bars: figure.querySelectorAll('rect.bar').length});
  }
  return figures;
}"""


def browser_notebook(setup: str = "") -> nbformat.NotebookNode:
    cells = ["%load_ext traceml_jupyter", loader_cell(SLEEP_MS) + setup, traced_cell(EPOCHS)]
    return notebook(*cells)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    ensure_python3_kernel()
    ensure_no_news_overrides()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def cell_running(cell: Any) -> bool:
    """The front-end's own mark of a cell in progress: the prompt reads [*]."""
    return "*" in cell.locator(".jp-InputPrompt").inner_text()


def wait_for(what: str, check: Any, timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def halfway(cell: Any) -> bool:
    """The live header says `step k / N` with k at least N / 2."""
    header = " ".join(cell.locator(".widget-html-content").all_inner_texts())
    found = re.search(r"step ([0-9,]+) / ([0-9,]+)", header)
    if found is None:
        return False
    step, total = (int(n.replace(",", "")) for n in found.groups())
    return 2 * step >= total


def drawn(figures: list[dict[str, Any]]) -> bool:
    """The chart (first figure) shows at least one step."""
    return bool(figures) and bool(figures[0]["points"] or figures[0]["bars"])


def grown(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    """The chart (first figure) has more points or bars than before."""
    if not (before and after):
        return False
    return bool(after[0]["points"] > before[0]["points"] or after[0]["bars"] > before[0]["bars"])


def shoot(page: Any, element: Any, name: str) -> None:
    """`name.png`: the element alone; `name-page.png`: the whole window around it."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    element.scroll_into_view_if_needed()
    element.screenshot(path=str(SCREENSHOTS / f"{name}.png"))
    page.screenshot(path=str(SCREENSHOTS / f"{name}-page.png"))


def watch_traced_notebook(
    chromium: Any, app: str, tmp_path: Path, nb: nbformat.NotebookNode
) -> dict[str, Any]:
    """Open the notebook in `app`, Run All, and record what the page showed, live and after."""
    root = tmp_path / "root"
    root.mkdir()
    nbformat.write(nb, root / "traced.ipynb")
    seen: dict[str, Any] = {"page_errors": []}
    with jupyter_server(app, root, tmp_path) as server:
        context = chromium.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.on("pageerror", lambda exc: seen["page_errors"].append(f"{exc}\n{exc.stack}"))
            page.goto(server.page_url("traced.ipynb"))
            cells = page.locator(".jp-Notebook .jp-Cell")
            wait_for("the notebook's cells", lambda: cells.count() == len(nb.cells), 60)
            server.wait_kernel_idle(timeout=60)
            if app == "lab":  # fold the file browser: the report gets the width for two panes
                opened = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
                if opened.count():
                    opened.first.click()
            page.click(".lm-MenuBar-itemLabel:text-is('Run')")
            page.click("li.lm-Menu-item[data-command='runmenu:run-all']")
            cell = cells.nth(TRACED)
            wait_for("the traced cell to start", lambda: cell_running(cell), 30)

            def sample() -> list[dict[str, Any]]:
                return list(cell.evaluate(SAMPLE_CHART))

            def first_steps() -> list[dict[str, Any]] | None:
                now = sample()
                if drawn(now):
                    return now
                assert cell_running(cell), f"the cell ended before the chart showed a step: {now}"
                return None

            seen["first"] = wait_for("the chart's first steps", first_steps, 60)

            def more_steps() -> list[dict[str, Any]] | None:
                now = sample()
                return now if grown(seen["first"], now) else None

            try:
                seen["second"] = wait_for("the chart to gain steps", more_steps, 5)
            except AssertionError:
                seen["second"] = sample()
            seen["running_after_second"] = cell_running(cell)
            try:  # the picture for the README: a good part of the run drawn, still running
                wait_for("half of the run", lambda: halfway(cell) or not cell_running(cell), 60)
            finally:
                shoot(page, cell, f"{app}-live")

            wait_for("the traced cell to end", lambda: not cell_running(cell), 120, every=0.25)
            server.wait_kernel_idle(timeout=30)
            html = cell.locator(".jp-OutputArea-output[data-mime-type='text/html']")
            try:
                wait_for("the HTML report", lambda: "Why" in " ".join(html.all_inner_texts()), 10)
            except AssertionError:
                pass
            page.wait_for_timeout(500)  # let the last widget messages land before reading
            seen["report"] = " ".join(html.all_inner_texts())
            seen["outputs"] = cell.locator(".jp-OutputArea").inner_text()
            seen["page"] = page.locator("body").inner_text()
            if html.count():
                # Lab scrolls inside its own panel: a window as tall as the report shows all of it.
                height = int(html.last.bounding_box()["height"])
                page.set_viewport_size({"width": VIEWPORT["width"], "height": height + 400})
                page.wait_for_timeout(300)
                shoot(page, html.last, f"{app}-report")
                resources = html.last.locator(".tml-resources")  # memory and CPU beside the time
                if resources.count():
                    seen["resources"] = resources.first.inner_text()
                    shoot(page, resources.first, f"{app}-resources")
            else:
                shoot(page, cell, f"{app}-report")
        finally:
            context.close()
    return seen


@pytest.mark.parametrize("app", ["lab", "notebook"])
def test_the_chart_grows_while_the_cell_runs_then_the_report_shows(
    chromium: Any, app: str, tmp_path: Path
) -> None:
    seen = watch_traced_notebook(chromium, app, tmp_path, browser_notebook())
    assert_live_then_report(seen)
    if app == "lab" and os.environ.get("TRACEML_UPDATE_DOCS_SCREENSHOTS"):
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copy(SCREENSHOTS / "lab-live.png", REPO / "docs" / "live.png")
        shutil.copy(SCREENSHOTS / "lab-report.png", REPO / "docs" / "report-browser.png")
        shutil.copy(SCREENSHOTS / "lab-resources.png", REPO / "docs" / "resources.png")


def assert_live_then_report(seen: dict[str, Any]) -> None:
    first, second = seen["first"], seen["second"]
    assert grown(first, second), (
        f"the chart did not gain steps while the cell ran: {first} -> {second}"
    )
    assert seen["running_after_second"], "the second sample was taken after the cell ended"
    report = seen["report"]
    assert "INPUT-BOUND" in report, f"no verdict in the HTML report: {seen['outputs'][:2000]}"
    words = report.lower()
    for text in ("why", "next", "checklist", "num_workers=0", "worker processes (num_workers)"):
        assert text in words, f"{text!r} missing from the HTML report: {report[:3000]}"
    assert re.search(r"\bfix\b", words), f"no checklist item to fix: {report[:3000]}"
    # The Resources part: CPU against the usable cores, the process's memory, with plots.
    resources = seen.get("resources") or ""
    assert "usable cores busy" in resources and "CPU cores busy" in resources, resources[:2000]
    for text in WIDGET_ERRORS:
        assert text not in seen["page"], f"{text!r} on the page"
    widget_errors = [
        e for e in seen["page_errors"] if "widget" in e.lower() or "bqplot" in e.lower()
    ]
    assert not widget_errors, widget_errors


def test_the_saved_report_file_opens_in_the_browser_with_the_verdict_and_checklist(
    chromium: Any, ip: Any, tmp_path: Path
) -> None:
    """`--save report.html`: one page opened from disk (file://), no Jupyter server: it shows
    the chart, the verdict and the checklist, with no script and no request to the network."""
    from IPython.utils.capture import capture_output

    page_path = tmp_path / "report.html"
    with capture_output():
        assert ip.run_cell(loader_cell(1.0), store_history=True).error_in_exec is None
        result = ip.run_cell(
            f"%%traceml --name shared --no-live --save {page_path}\nfor x, y in loader:\n"
            "    opt.zero_grad()\n    loss_fn(model(x), y).backward()\n    opt.step()\n",
            store_history=True,
        )
    assert result.error_in_exec is None and page_path.exists()
    context = chromium.new_context(viewport=VIEWPORT, java_script_enabled=False)
    try:
        page = context.new_page()
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(page_path.as_uri())
        assert page.locator("script").count() == 0
        report = page.locator(".traceml-report")
        text = report.inner_text()
        assert "Step Time: INPUT-BOUND" in text, text[:2000]
        for words in ("Why", "Next", "CHECKLIST", "Worker processes (num_workers)"):
            assert words in text, f"{words!r} missing from the saved report: {text[:3000]}"
        assert page.locator(".tml-item-num_workers.tml-fix").is_visible()
        chart = page.locator(".tml-file-chart svg polygon")
        assert chart.count() == 2 and chart.first.is_visible()
        assert requests == [page_path.as_uri()], requests  # the page alone: nothing fetched
        height = int(page.locator(".traceml-file").bounding_box()["height"])
        page.set_viewport_size({"width": VIEWPORT["width"], "height": height + 40})
        shoot(page, page.locator(".traceml-file"), "report-file")
    finally:
        context.close()

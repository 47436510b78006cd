"""What a person sees in JupyterLab 4 when a traced cell starts two DDP ranks by fork (headless
Chromium): the live chart draws one line per rank (the rank that holds the others back in red),
then the report's per-rank table names it. The chart's screenshot is the README's picture."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import REPO
from jupyter_harness import jupyter_server, notebook
from ranks_cells import SETUP
from test_browser import (  # noqa: F401  (chromium is a fixture)
    CHROMIUM,
    SCREENSHOTS,
    VIEWPORT,
    WIDGET_ERRORS,
    cell_running,
    chromium,
    shoot,
    wait_for,
)

TRACED = 1
# 60 steps of about 45 ms (rank 1 reads 5 ms a sample): the chart is live for a few seconds.
STRAGGLER = """\
%%traceml --name ddp
STEPS = 60
mp.start_processes(train, args=(2, free_port(), (0.0, 0.005)), nprocs=2, start_method="fork")"""

LINES = """(cell) => {
  const figure = cell.querySelector('.bqplot.figure svg.svg-figure');
  if (!figure) return {lines: 0, legend: ''};
  const texts = cell.querySelectorAll('.bqplot.figure text');
  return {lines: figure.querySelectorAll('path.line').length,
          legend: Array.from(texts).map(t => t.textContent).join('|')};
}"""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (scripts/install_browser.sh)"),
]


def test_the_live_chart_has_a_line_per_rank(chromium: Any, tmp_path: Path) -> None:  # noqa: F811
    root = tmp_path / "root"
    root.mkdir()
    nbformat.write(notebook(SETUP, STRAGGLER), root / "ranks.ipynb")
    page_errors: list[str] = []
    with jupyter_server("lab", root, tmp_path) as server:
        context = chromium.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.goto(server.page_url("ranks.ipynb"))
            cells = page.locator(".jp-Notebook .jp-Cell")
            wait_for("the notebook's cells", lambda: cells.count() == 2, 60)
            server.wait_kernel_idle(timeout=60)
            opened = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
            if opened.count():
                opened.first.click()
            page.click(".lm-MenuBar-itemLabel:text-is('Run')")
            page.click("li.lm-Menu-item[data-command='runmenu:run-all']")
            cell = cells.nth(TRACED)
            wait_for("the traced cell to start", lambda: cell_running(cell), 30)
            drawn = wait_for("the ranks' lines", lambda: cell.evaluate(LINES)["lines"] or None, 60)
            wait_for("the traced cell to end", lambda: not cell_running(cell), 120, every=0.25)
            server.wait_kernel_idle(timeout=30)
            page.wait_for_timeout(500)  # the last widget messages
            seen = cell.evaluate(LINES)
            report = " ".join(cell.locator(".jp-OutputArea-output[data-mime-type='text/html']").all_inner_texts())
            shoot(page, cell.locator(".jp-OutputArea-child").first, "lab-ranks")
            body = page.locator("body").inner_text()
        finally:
            context.close()
    assert drawn and seen["lines"] >= 4, seen  # a step line and a data wait line per rank
    assert "rank 1 data wait" in seen["legend"], seen
    assert "RANK STRAGGLER" in report and "holds the others back" in report, report[:2000]
    for text in WIDGET_ERRORS:
        assert text not in body, f"{text!r} on the page"
    assert not [e for e in page_errors if "bqplot" in e.lower() or "widget" in e.lower()], page_errors
    if os.environ.get("TRACEML_UPDATE_DOCS_SCREENSHOTS"):
        shutil.copy(SCREENSHOTS / "lab-ranks.png", REPO / "docs" / "ranks.png")

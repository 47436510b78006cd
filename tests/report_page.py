"""The HTML report read as a user reads it: its elements with their classes, the classes of the
elements around them and their visible text (`Page(html).one("tml-verdict").text`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from html.parser import HTMLParser
from typing import Any

VOID = {"br", "hr", "img", "input", "meta", "link", "wbr"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str | None], ancestors: set[str]) -> None:
        self.tag, self.attrs = tag, attrs
        self.classes = set((attrs.get("class") or "").split())
        self.ancestors = ancestors
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.parts).split())


class Page(HTMLParser):
    """The report's elements with their visible text, to read it as a user would."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.stack: list[Element] = []
        self.elements: list[Element] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID:
            return
        ancestors = set().union(*(e.classes for e in self.stack)) if self.stack else set()
        element = Element(tag, dict(attrs), ancestors)
        self.stack.append(element)
        self.elements.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self.stack and self.stack.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        for element in self.stack:
            element.parts.append(data)

    def by_class(self, name: str) -> list[Element]:
        return [e for e in self.elements if name in e.classes]

    def one(self, name: str) -> Element:
        found = self.by_class(name)
        assert len(found) == 1, f"{len(found)} elements of class {name}"
        return found[0]

    def line(self, number: int) -> Element:
        return [e for e in self.by_class("tml-line") if e.attrs["title"].startswith(f"line {number}")][0]


def heat_of(page: Page, number: int) -> tuple[float | None, str | None, float | None]:
    """The bar beside a code line: its length (% of the costliest line's), its label, and the
    length of the thin host bar under it (CUDA)."""
    start = page.elements.index(page.line(number))
    width = label = host = None
    for e in page.elements[start + 1 :]:
        if "tml-line" in e.classes:
            break
        length = re.search(r"width:([\d.]+)%", e.attrs.get("style") or "")
        if "tml-heat-bar" in e.classes and length:
            width = float(length.group(1))
        elif "tml-heat-host" in e.classes and length:
            host = float(length.group(1))
        elif "tml-heat-ms" in e.classes:
            label = e.text
    return width, label, host


def assert_cost_bars(page: Page, costs: Mapping[str, Any]) -> None:
    """The cost per line beside the code of a loop on lines 2-7 whose line 3 is the dearest and
    whose lines 5-6 are one statement (`if ...: continue`): each timed line shows its ms per step
    and a bar on one scale, the loop line its data wait, line 1 (outside the loop) nothing."""
    from traceml_jupyter.analysis.number_text import ms_fine

    rows = {r["line"]: r for r in costs["statements"]}
    for line, row in rows.items():
        width, label, host = heat_of(page, line)
        assert label == ms_fine(row["ms_per_step"]) and host is None
        assert page.line(line).text.startswith(f"{line} {label} ")  # number, ms, then the code
    widths = {line: heat_of(page, line)[0] for line in rows}
    assert widths[3] == 100.0 and max(widths, key=lambda line: widths[line] or 0.0) == 3  # the dearest line
    assert 0 < (widths[7] or 0) < widths[3]
    # The statement on lines 5-6: line 6 carries the same bar, without a label.
    assert heat_of(page, 6) == (widths[5], "", None)
    # The loop line carries its data wait on the same scale; lines outside the loop, nothing.
    assert heat_of(page, 2)[1] == ms_fine(costs["fetch_ms_per_step"])
    assert heat_of(page, 1) == (None, None, None)
    note = page.one("tml-heat-note").text
    assert "(wall clock)" in note and f"over {costs['timed_steps']} timed steps" in note
    assert "ms per step" in page.one("tml-code-pane").text

"""The HTML report read as a user reads it: its elements with their classes, the classes of the
elements around them and their visible text (`Page(html).one("tml-verdict").text`)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

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

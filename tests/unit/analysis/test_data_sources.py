"""Advice that fits the source: a loop fed by a generator, a list, a custom iterator or a
`get_batch()` function (no DataLoader anywhere) gets an INPUT-BOUND sentence and a checklist
that name that source by its expression and line and say what makes such a source faster,
never DataLoader workers; a DataLoader keeps its own advice. The pure parts (what a source is,
the sentences); through a traced cell: tests/integration/shell/test_data_source_advice.py."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from traceml_jupyter.analysis.checklist import FIX, OK, Facts, evaluate
from traceml_jupyter.analysis.data_sources import (
    DATALOADER_INPUT_NEXT,
    DATALOADER_STRAGGLER_NEXT,
    feeder,
    input_next,
    phase_remedy,
    straggler_next,
)
from traceml_jupyter.capture.data.sources import expression_type, fed_expression, object_type

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DATALOADER_WORDS = ("DataLoader workers", "persistent workers", "pinned memory")


# -- the pure parts ---------------------------------------------------------------------------


def summary(kind: str | None, type_: str | None, label: str = "`slow()` on line 3") -> dict[str, Any]:
    return {
        "data_source": label,
        "data_source_kind": kind,
        "data_source_type": type_,
        "data_source_line": 3,
    }


def test_the_sentences_fit_the_source() -> None:
    for kind, type_ in (("dataloader", "dataloader"), (None, None)):
        assert input_next(summary(kind, type_)) == DATALOADER_INPUT_NEXT
        assert straggler_next(summary(kind, type_)) == DATALOADER_STRAGGLER_NEXT
    for type_, noun in (("generator", "a generator"), ("iterator", "an iterator"), ("function", "a function"), (None, "the loop's own source")):
        text = input_next(summary("loop", type_))
        assert text.startswith(f"Feed the loop faster: `slow()` on line 3 ({noun}) makes every batch")
        assert not any(word in text for word in DATALOADER_WORDS)
        assert "`slow()` on line 3" in straggler_next(summary("loop", type_))
    saturated = {**summary("dataloader", "dataloader"), "cpu_saturated": True}
    assert input_next(saturated).startswith("Make each sample cheaper: the CPU is saturated")
    busy = input_next({**summary("loop", "generator"), "cpu_saturated": True})
    assert busy.startswith("Make each item of `slow()` on line 3 (a generator) cheaper")
    listed = input_next(summary("loop", "list", "`batches` on line 3"))
    assert "(a list) fed the steps" in listed and "a larger batch" in listed
    assert phase_remedy("dataloader") == "more workers, persistent_workers=True"
    assert "background thread" in phase_remedy("call")


def test_the_checklist_reads_the_source_not_a_loader() -> None:
    source = feeder(summary("call", "function", "`get_batch('train')` on line 3"))
    assert source is not None
    items = {i.key: i for i in evaluate(Facts("INPUT-BOUND", None, 2, feeder=source))}
    assert items["data_source"].status == FIX and items["data_source"].bears_on_verdict
    assert "a function" in items["data_source"].seen and "dataloader" not in items
    calm = {i.key: i for i in evaluate(Facts("COMPUTE-BOUND", None, 2, feeder=source))}
    assert calm["data_source"].status == OK and not calm["data_source"].bears_on_verdict
    plain = {i.key for i in evaluate(Facts("INPUT-BOUND", None, 2))}
    assert "dataloader" in plain and "data_source" not in plain  # the source unknown: as before


def test_what_a_source_is() -> None:
    def gen() -> Any:
        yield 1

    class It:
        def __next__(self) -> int:
            return 1

    assert object_type(gen()) == object_type(gen) == "generator"
    assert object_type([1]) == "list" and object_type((1,)) == "tuple"
    assert object_type(It) == object_type(It()) == "iterator"
    assert object_type(enumerate([1])) is None and object_type(zip([1], [2], strict=True)) is None
    assert object_type(len) == "function"
    names = {"gen": gen, "data": [1], "It": It, "get_batch": len}
    for text, expected in (
        ("enumerate(tqdm(gen()))", "generator"),
        ("data", "list"),
        ("It()", "iterator"),
        ("get_batch('train')", "function"),
        ("(x for x in data)", "generator"),
        ("unknown()", None),
    ):
        assert expression_type(fed_expression(text), names) == expected, text
    node = fed_expression("next(it)")
    assert isinstance(node, ast.Name) and node.id == "it"
    assert fed_expression("for x") is None

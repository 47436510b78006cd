"""The summary's keys are one list: the `Summary` TypedDict that mypy checks every reader
against is the list docs/api.md documents, and every key a summary is built with is one of
them (the few places that fill keys from a tuple name the summary's keys)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import numpy as np
from synthetic import step_columns

from traceml_jupyter.analysis.rank_verdict import MEDIAN_KEYS, STRAGGLER_EVIDENCE, with_ranks
from traceml_jupyter.analysis.resources import RESOURCE_KEYS
from traceml_jupyter.analysis.step_parts import epoch_startup, parts_summary, trend
from traceml_jupyter.analysis.step_pattern import step_pattern
from traceml_jupyter.analysis.summary import GPU_WORK_KEYS, HEADLINE_KEYS, summarize
from traceml_jupyter.analysis.summary_keys import (
    SUMMARY_KEYS,
    EpochStartup,
    StepPattern,
    Straggler,
    Summary,
    Trend,
)

REPO = Path(__file__).resolve().parents[3]


def documented() -> list[str]:
    """The keys of docs/api.md's "The summary" table, in its order."""
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("### The summary", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [key for row in rows for key in re.findall(r"`([a-z_0-9]+)`", row)]


def test_the_summary_type_is_the_list_the_docs_hold() -> None:
    assert list(SUMMARY_KEYS) == documented()
    assert set(typing.get_type_hints(Summary)) == set(SUMMARY_KEYS)


def test_the_keys_filled_from_a_tuple_are_the_summarys() -> None:
    for keys in (HEADLINE_KEYS, GPU_WORK_KEYS, RESOURCE_KEYS, MEDIAN_KEYS):
        assert set(keys) <= set(SUMMARY_KEYS), set(keys) - set(SUMMARY_KEYS)
    assert set(STRAGGLER_EVIDENCE) <= set(Straggler.__annotations__)


def test_a_summary_and_its_parts_hold_only_their_types_keys() -> None:
    rng = np.random.default_rng(3)
    n = 60
    wait = np.where(np.arange(n) % 3 == 0, 30.0, 1.0) + rng.uniform(0, 0.1, n)
    compute = np.linspace(5.0, 9.0, n)  # slower and slower: a trend
    cols = step_columns(wait, compute)
    summary = summarize(cols, n)
    assert set(summary) <= set(SUMMARY_KEYS)
    analysed = cols["step"] >= summary["warmup_steps"]
    assert set(parts_summary(cols, analysed, "cpu")) <= set(SUMMARY_KEYS)
    pattern = step_pattern(cols, analysed, "cpu", (0, 20, 40), 2)
    found = trend(cols, analysed, "cpu")
    startup = epoch_startup(cols, (0, 20, 40), 1000.0, {"num_workers": 2}, "cpu")
    assert pattern is not None and found is not None and startup is not None
    assert set(pattern) <= set(StepPattern.__annotations__)
    assert set(found) <= set(Trend.__annotations__)
    assert set(startup) <= set(EpochStartup.__annotations__)
    ranks = [{"rank": r, "n_analysed": 50, "step_ms": 10.0 + 5 * r, "data_wait_ms": 5.0 * r} for r in (0, 1)]
    assert set(with_ranks(summary, ranks)[0]) <= set(SUMMARY_KEYS)

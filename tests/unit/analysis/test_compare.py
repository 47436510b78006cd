"""Comparing two runs: the pure rule from two summaries, and `%traceml compare` in a real shell."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.core.formatters import DisplayFormatter
from synthetic import step_columns

import traceml_jupyter
from traceml_jupyter import kernel_state
from traceml_jupyter.analysis.compare import Comparison, compare_summaries, speed_words
from traceml_jupyter.analysis.summary import summarize, with_batch_size
from traceml_jupyter.analysis.verdict import diagnose
from traceml_jupyter.run import Run

MS = 1_000_000  # ns


def summary_of(
    wait_ms: float, compute_ms: float, n: int = 40, batch_size: int | None = 64
) -> dict[str, Any]:
    summary = summarize(step_columns(np.full(n, wait_ms), np.full(n, compute_ms)), n)
    with_batch_size(summary, batch_size)
    return summary


def compared(a: tuple[float, float], b: tuple[float, float], **kw: Any) -> Comparison:
    sa, sb = summary_of(*a), summary_of(*b)
    return compare_summaries("slow", sa, diagnose(sa).label, "fixed", sb, diagnose(sb).label, **kw)


# -- the pure rule ------------------------------------------------------------------------------


def test_the_fix_that_removes_the_wait_is_named_with_its_speed_up_and_verdict_change() -> None:
    c = compared((60.0, 30.0), (0.5, 29.5))
    assert c.label_a == "INPUT-BOUND" and c.label_b == "COMPUTE-BOUND"
    assert c.speedup == pytest.approx(3.0)
    assert c.conclusion == "3.0x faster: INPUT-BOUND -> COMPUTE-BOUND"
    rows = {row[0]: row[1:] for row in c.rows}
    assert rows["Step time (median)"] == ("90.0 ms", "30.0 ms", "-60.0 ms (-67 %)")
    assert rows["Data wait (median)"] == ("60.0 ms", "0.5 ms", "-59.5 ms (-99 %)")
    assert rows["CPU compute (median)"] == ("30.0 ms", "29.5 ms", "-0.5 ms (-2 %)")
    assert rows["Throughput (samples/s)"][2] == "3.0x faster"
    assert rows["Verdict"] == ("INPUT-BOUND", "COMPUTE-BOUND", "changed")
    saved = c.to_dict()
    assert (saved["verdict_a"], saved["verdict_b"], saved["conclusion"]) == (
        "INPUT-BOUND",
        "COMPUTE-BOUND",
        c.conclusion,
    )


def test_still_input_bound_with_every_core_busy_says_the_cpu_is_the_ceiling() -> None:
    c = compared((90.0, 10.0), (25.0, 9.5), workers_b=2, cpus=2)
    assert c.conclusion == "2.9x faster; still INPUT-BOUND: the CPU is now the ceiling"


def test_still_input_bound_with_cores_to_spare_gives_the_share_left() -> None:
    c = compared((90.0, 10.0), (25.0, 9.5), workers_b=2, cpus=8)
    assert c.conclusion.startswith("2.9x faster; still INPUT-BOUND: data wait is still 72.")


def test_slower_and_unchanged_runs_say_so() -> None:
    assert compared((0.5, 20.0), (0.5, 30.0)).conclusion.startswith("1.5x slower; still COMPUTE")
    same = compared((0.5, 20.0), (0.5, 20.2))
    assert same.conclusion.startswith("about as fast (0.99x); still COMPUTE-BOUND")
    assert speed_words(1.04) == "about as fast (1.04x)"
    assert speed_words(0.5) == "2.0x slower"


def test_throughput_counts_samples_when_batch_sizes_differ() -> None:
    a = summary_of(0.5, 10.0, batch_size=32)  # 10.5 ms for 32 samples
    b = summary_of(0.5, 15.0, batch_size=64)  # 15.5 ms for 64 samples: slower steps, more work
    c = compare_summaries("small", a, "COMPUTE-BOUND", "large", b, "COMPUTE-BOUND")
    assert c.speedup == pytest.approx((64 / 15.5) / (32 / 10.5))
    assert c.conclusion.startswith("1.4x faster")


def test_a_run_without_analysed_steps_is_not_compared() -> None:
    a, b = summary_of(60.0, 30.0), summary_of(0.5, 30.0, n=1)
    c = compare_summaries("slow", a, diagnose(a).label, "short", b, diagnose(b).label)
    assert c.conclusion == "No comparison: short has too few analysed steps."


def test_different_clocks_are_said_first() -> None:
    a, b = summary_of(60.0, 30.0), summary_of(0.5, 30.0)
    b["clock"] = "gpu"
    c = compare_summaries("cpu run", a, "INPUT-BOUND", "gpu run", b, "COMPUTE-BOUND")
    assert c.caveats == ["cpu run was timed on the CPU clock and gpu run on the GPU clock."]
    assert c.text().splitlines()[1] == "  " + c.caveats[0]  # before the conclusion
    assert ("Compute (median)", "30.0 ms", "30.0 ms", "+0.0 ms (+0 %)") in c.rows


def test_text_and_html_show_both_runs_and_the_conclusion() -> None:
    sa, sb = summary_of(60.0, 30.0), summary_of(0.5, 29.5)
    c = compare_summaries("<slow>", sa, "INPUT-BOUND", "fixed & fast", sb, "COMPUTE-BOUND")
    text = str(c)
    assert text.splitlines()[0] == "traceml compare: <slow> -> fixed & fast"
    assert text.splitlines()[1] == "  3.0x faster: INPUT-BOUND -> COMPUTE-BOUND"
    assert "Data wait (median)" in text and "-59.5 ms (-99 %)" in text
    page = c._repr_html_()
    assert "&lt;slow&gt;" in page and "<slow>" not in page
    assert "fixed &amp; fast" in page
    assert "3.0x faster: INPUT-BOUND -&gt; COMPUTE-BOUND" in page
    assert "<script" not in page and "<style" not in page and 'style="' in page


# -- %traceml compare in a real shell -----------------------------------------------------------


def recorded_run(name: str, wait_ms: float, compute_ms: float, n: int = 40) -> Run:
    """A finished run with exact step timings, as if its loop had waited and computed so."""
    run = Run(name)
    run.recording.batch_size = 64
    t = 0
    for _ in range(n):
        t1 = t + int(wait_ms * MS)
        t2 = t1 + int(compute_ms * MS)
        run.recording.recorder.add(t, t1, t2)
        t = t2
    return run.finish()


@pytest.fixture
def two_runs() -> Iterator[tuple[Run, Run]]:
    before = list(kernel_state.RUNS)
    kernel_state.RUNS.clear()  # only these two: names from other tests ("slow", ...) must not match
    runs = recorded_run("slow run", 60.0, 30.0), recorded_run("fixed", 0.5, 29.5)
    yield runs
    kernel_state.RUNS[:] = before


def test_compare_by_name_in_the_shell(ip: Any, two_runs: tuple[Run, Run]) -> None:
    c = ip.run_line_magic("traceml", 'compare "slow run" fixed')
    assert isinstance(c, Comparison)
    assert (c.name_a, c.name_b) == ("slow run", "fixed")
    # Steps of exactly the same length: no noise, so the interval is the ratio itself.
    assert c.change == "IMPROVEMENT"
    assert c.conclusion == (
        "IMPROVEMENT: 3.00x faster (95 % interval 3.00x to 3.00x); INPUT-BOUND -> COMPUTE-BOUND"
    )


def test_compare_defaults_to_the_last_two_runs(ip: Any, two_runs: tuple[Run, Run]) -> None:
    c = ip.run_line_magic("traceml", "compare")
    assert (c.name_a, c.name_b) == ("slow run", "fixed")
    one = ip.run_line_magic("traceml", "compare 'slow run'")
    assert (one.name_a, one.name_b) == ("slow run", "fixed")
    assert traceml_jupyter.compare("slow run", "fixed").conclusion == c.conclusion
    assert traceml_jupyter.compare(two_runs[1], two_runs[0]).conclusion.startswith(
        "REGRESSION: 3.00x slower"
    )


def test_the_cell_shows_html_and_text(ip: Any, two_runs: tuple[Run, Run]) -> None:
    shown = ip.run_line_magic("traceml", 'compare "slow run" fixed')  # the cell's value
    data, _ = DisplayFormatter().format(shown)  # as a notebook front-end formats it
    assert "IMPROVEMENT: 3.00x faster" in data["text/html"]
    assert "INPUT-BOUND -&gt; COMPUTE-BOUND" in data["text/html"]
    assert data["text/plain"].startswith("traceml compare: slow run -> fixed")


def test_unknown_names_list_the_known_runs(ip: Any, two_runs: tuple[Run, Run]) -> None:
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("traceml", "compare slow fixed")
    assert "no run named 'slow'" in str(err.value)
    assert "'slow run'" in str(err.value) and "'fixed'" in str(err.value)


def test_bad_compare_commands_are_usage_errors(ip: Any, two_runs: tuple[Run, Run]) -> None:
    with pytest.raises(UsageError, match="two run names at most"):
        ip.run_line_magic("traceml", "compare slow run fixed")
    with pytest.raises(UsageError, match="latest run"):
        ip.run_line_magic("traceml", "compare fixed")
    with pytest.raises(UsageError, match="unknown command 'diff'"):
        ip.run_line_magic("traceml", "diff")


def test_compare_needs_two_runs(ip: Any) -> None:
    before = list(kernel_state.RUNS)
    kernel_state.RUNS.clear()
    try:
        with pytest.raises(UsageError, match="needs two runs; this kernel has 0"):
            ip.run_line_magic("traceml", "compare")
    finally:
        kernel_state.RUNS[:] = before

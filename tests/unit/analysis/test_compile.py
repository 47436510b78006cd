"""torch.compile's facts in words (analysis/compile.py), from canned facts as the capture reads
them off torch's record: compile time placed in the steps that held it and kept out of the
steady state, each recompilation's cause and fix, each graph break's line and fix, the limit hit
said loudly, and the verdict when most of the cell compiled."""

from __future__ import annotations

import copy
from typing import Any, cast

import numpy as np
from result_factory import CANNED, COMPILED, frame, result_of

from traceml_jupyter.analysis.compile import (
    CompileFacts,
    break_fix,
    compile_lines,
    compile_per_step,
    read_compile,
    recompile_cause,
    step_list,
)
from traceml_jupyter.result import from_dict, to_dict


def facts(**more: Any) -> CompileFacts:
    out = copy.deepcopy(COMPILED)
    out.update(more)
    return cast(CompileFacts, out)


def columns(step_ms: list[float]) -> dict[str, np.ndarray]:
    ends = np.cumsum(step_ms) / 1e3
    return {
        "step": np.arange(len(step_ms)),
        "time_s": np.concatenate([[0.0], ends[:-1]]),
        "step_ms": np.asarray(step_ms, dtype=float),
    }


def test_the_compile_time_is_placed_in_the_steps_whose_interval_holds_it() -> None:
    cols = columns([2000.0] + [10.0] * 38 + [300.0])
    per_step = compile_per_step(facts(), cols)
    assert sorted(per_step) == [0, 39]
    assert abs(per_step[0] - 1.90) < 1e-9 and abs(per_step[39] - 0.26) < 1e-6
    # a compile before the first step (a warm-up call above the loop) is in no step
    outside = compile_per_step(facts(spans=[[-1.0, -0.5]]), cols)
    assert list(outside) == [-1] and abs(outside[-1] - 0.5) < 1e-9


def test_without_the_callbacks_the_frames_own_intervals_are_used() -> None:
    cols = columns([2000.0] + [10.0] * 39)
    per_step = compile_per_step(facts(spans=[]), cols)
    assert abs(sum(per_step.values()) - (1.5 + 0.39 + 0.2)) < 1e-9


def test_the_compile_line_says_how_long_in_which_steps_and_what_share_of_the_cell() -> None:
    cols = columns([2000.0] + [10.0] * 38 + [300.0])
    reading = read_compile(facts(), cols, wall_ms=2800.0)
    assert reading.compiling_steps == (0, 39)
    lines = compile_lines(reading, "<cell>")
    assert lines[0] == "compiling: 2.2 s in steps 1 and 40, 77 % of this cell (kept out of the steady state)"
    assert reading.mostly_compiling


def test_a_recompile_at_the_last_batch_says_drop_last() -> None:
    cols = columns([2000.0] + [10.0] * 38 + [300.0])
    (recompile,) = read_compile(facts(), cols, 2800.0).recompiles
    assert recompile.step == 39 and recompile.seconds == 0.2
    assert "7 instead of 32" in recompile.cause and "drop_last=True" in recompile.fix
    line = compile_lines(read_compile(facts(), cols, 2800.0))[1]
    assert line.startswith("recompiled forward() at step 40, 0.2 s: a batch of another size")


def test_each_cause_of_a_recompile_has_its_fix() -> None:
    seq = recompile_cause("0/0: tensor 'x' size mismatch at index 1. expected 128, actual 97")
    assert "varies" in seq[0] and "mark_dynamic(x, 1)" in seq[1] and "dynamic=True" in seq[1]
    assert "dtype" in recompile_cause("0/0: tensor 'x' dtype mismatch. expected Float, actual Half")[0]
    assert "Python value" in recompile_cause("0/0: L['n'] == 3")[0]
    assert "no_grad" in recompile_cause("0/0: ___check_global_state() grad_mode")[0]


def test_a_graph_break_is_named_at_the_cells_line_with_its_reason_and_fix() -> None:
    reading = read_compile(facts(), columns([2000.0] + [10.0] * 39), 2400.0)
    (brk,) = reading.breaks
    assert (brk.filename, brk.line, brk.function) == ("<cell>", 4, "forward")
    assert brk.reason.startswith("Failed to trace builtin operator: ") and "print" in brk.fix
    assert any(line.startswith("graph break in forward() at line 4: ") for line in compile_lines(reading, "<cell>"))
    # in a file of its own: the file's name and line
    assert any("at model.py:4" in line for line in compile_lines(
        read_compile(facts(frames=[
            frame("0/0", "forward", 0.05, 1.0, filename="/src/model.py", break_reasons=["Tensor.item"]),
            frame("1/0", "torch_dynamo_resume_in_forward_at_4", 1.1, 0.1, filename="/src/model.py"),
        ]), columns([2000.0]), 2000.0)
    ))


def test_a_break_that_no_compiled_frame_places_is_said_with_torchs_reason_and_count() -> None:
    # A library's `logging` call in compiled code: torch counts the break, but compiles no frame
    # after it (no resume function), so no line is known; its reason and count are still said.
    logger = "logging.Logger method not supported for non-export cases"
    reading = read_compile(
        facts(graph_breaks=4, graph_break_reasons={**facts()["graph_break_reasons"], logger: 3}),
        columns([2000.0] + [10.0] * 39), 2400.0,
    )
    assert reading.unplaced == ((logger, 3),)
    lines = compile_lines(reading, "<cell>")
    assert f"graph break ×3, no line (torch compiled nothing after it): {logger} — take the print out" in "\n".join(lines)
    assert sum(line.startswith("graph break") for line in lines) == 2  # the cell's break, and this one
    assert read_compile(facts(), columns([2000.0] + [10.0] * 39), 2400.0).unplaced == ()


def test_each_kind_of_graph_break_has_its_fix() -> None:
    assert ".item()" in break_fix("Unsupported Tensor.item() call with capture_scalar_outputs=False")
    assert "torch.where" in break_fix("Data-dependent branching")
    assert "torch.compiler.disable" in break_fix("Attempted to call function marked as skipped")
    assert "compile the model" in break_fix("Unsupported Tensor.backward() call: Dynamo currently does not support")
    assert "out of the compiled function" in break_fix("the function `Optimizer.zero_grad` should not be traced")


def test_the_recompile_limit_hit_is_said_loudly() -> None:
    limited = facts(frames=[*COMPILED["frames"], frame("0/8", "forward", 2.5, 0.01, failed="Dynamo recompile limit exceeded")])
    lines = compile_lines(read_compile(limited, columns([2000.0] + [10.0] * 39), 2400.0))
    assert any(line.startswith("RECOMPILE LIMIT HIT: torch.compile gave up on forward(): it runs eagerly") for line in lines)


def test_steps_are_counted_from_one() -> None:
    assert step_list([0]) == "step 1" and step_list([0, 4, 8]) == "steps 1, 5 and 9"


def test_the_compiling_steps_are_kept_out_of_the_steady_state_and_the_verdict_says_so() -> None:
    result = CANNED["compiled"]()
    summary = result.summary
    assert summary["compiling_steps"] == [0, 39]
    assert summary["warmup_steps"] >= 1  # the first step's compile is warm-up
    assert abs(summary["step_ms"] - 10.2) < 0.01  # the steady median: no compiling step in it
    assert summary["stats"]["step_ms"]["max"] < 20.0  # the last batch's recompile is out too
    assert result.verdict.label == "WARMUP"
    assert result.verdict.why.startswith("Compiling took 2.2 s in steps 1 and 40,")
    assert "COMPUTE-BOUND" in result.verdict.next  # what the steps after compiling alone say


def test_a_short_compile_leaves_the_verdict_to_the_steps() -> None:
    small = facts(spans=[[0.001, 0.05]], frames=[frame("0/0", "forward", 0.001, 0.049)])
    result = result_of("brief", [0.2] * 200, [60.0] + [10.0] * 199, compiled=small, cell_source=None)
    assert result.summary["compiling_steps"] == [0]
    assert result.verdict.label != "WARMUP"


def test_the_compile_facts_go_to_the_json_and_back() -> None:
    result = CANNED["compiled"]()
    doc = to_dict(result)
    assert doc["compile"]["frames"][2]["recompile_reason"].endswith("actual 7")
    assert from_dict(doc) == result
    plain = CANNED["compute-bound"]()
    assert to_dict(plain)["compile"] is None and plain.summary["compile_s"] is None


def test_the_report_shows_the_compile_findings_and_what_torch_compiled() -> None:
    from traceml_jupyter.views.report import render_html

    html = render_html(CANNED["compiled"]())
    assert "compiling: 2.2 s in steps 1 and 40" in html  # the Also line
    assert "Compile (torch 2.13.0) — graph breaks (torch&#x27;s counter): 2" in html
    assert html.count('class="tml-compiled"') == 3
    assert "recompiled: 0/0: tensor &#x27;x&#x27; size mismatch" in html
    assert "after a graph break at line 4" in html
    assert 'class="tml-compile"' not in render_html(CANNED["compute-bound"]())


def test_compare_shows_the_compile_time_of_both_runs() -> None:
    from traceml_jupyter.analysis.compare import compile_rows

    compiled, plain = CANNED["compiled"]().summary, CANNED["compute-bound"]().summary
    assert compile_rows(plain, plain) == []
    ((what, a, b, change),) = compile_rows(compiled, plain)
    assert what == "Compiling (torch.compile)" and b == "none" and change == ""
    assert a.startswith("2.2 s, ") and a.endswith("of the cell, 2 step(s)")
    ((_, _, _, change),) = compile_rows(compiled, compiled)
    assert change == "+0.0 s"


def test_a_forward_and_its_resume_recompiled_for_one_cause_are_one_line() -> None:
    reason = "0/0: tensor 'x' size mismatch at index 0. expected 32, actual 7"
    twice = facts(frames=[
        *COMPILED["frames"],
        frame("1/1", "torch_dynamo_resume_in_forward_at_4", 2.63, 0.05, recompile_reason=reason),
    ])
    lines = compile_lines(read_compile(twice, columns([2000.0] + [10.0] * 38 + [300.0]), 2800.0))
    recompiled = [line for line in lines if line.startswith("recompiled")]
    assert recompiled == [
        "recompiled forward() and forward() after line 4 at step 40, 0.2 s: a batch of another size (7 instead "
        "of 32: often the last one) — drop_last=True on the DataLoader, or torch._dynamo.mark_dynamic(x, 0) on the batch"
    ]
    assert "value read into Python" in recompile_cause("1/0: ___stack0 == 4.71  # if y.sum().item() > 1e9:")[0]
    assert "value read into Python" in recompile_cause("1/1: ___stack0 <= 1000000000.0  # if y.sum().item() > 1e9:")[0]


# The eager share as the capture samples it (capture/compiled/eager_share.py): steps 11-16 ran
# under the profiler, 12-15 measured whole, 35 % of their time eager between graphs.
EAGER = {"share": 0.35, "eager_s": 0.014, "graphs_s": 0.02, "steps_s": 0.04, "steps": [11, 14], "profiled": [10, 15],
         "clock": "cpu", "note": None}  # fmt: skip


def eager_run(eager: dict[str, Any] | None, profiled_ms: float = 10.0) -> Any:
    step_ms = [2000.0] + [profiled_ms if 10 <= k <= 15 else 10.0 for k in range(1, 39)] + [300.0]
    return result_of(
        "eager", [0.2] * 40, step_ms, cell_source="%%traceml\nfor x in loader:\n    model(x)\n",
        cell_filename="<cell>", compiled=facts(eager=eager),
    )


def test_a_large_eager_share_is_an_also_line_beside_the_graph_breaks() -> None:
    from traceml_jupyter.result import lines_after_verdict

    lines = lines_after_verdict(eager_run(EAGER))
    said = [line for _, line in lines if line.startswith("eager between graphs: ")]
    assert said == [
        "eager between graphs: 35 % of a step runs eagerly between the compiled graphs (host time, sampled over "
        "steps 12–15) — fix the graph breaks below"
    ]
    small = lines_after_verdict(eager_run({**EAGER, "share": 0.03}))
    unmeasured = lines_after_verdict(eager_run({**EAGER, "share": None, "note": "a profiler was running"}))
    assert not [line for _, line in small + unmeasured if line.startswith("eager between graphs")]


def test_the_steps_the_profiler_ran_in_are_kept_out_of_the_steady_state() -> None:
    slowed = eager_run(EAGER, profiled_ms=14.0)  # the profiler's overhead on the sampled steps
    assert slowed.summary["stats"]["step_ms"]["max"] < 14.0
    assert slowed.summary["n_analysed"] == eager_run(None).summary["n_analysed"] - 6
    assert slowed.summary["eager_share"] == 0.35 and eager_run(None).summary["eager_share"] is None


def test_the_report_says_the_eager_share_next_to_the_graph_breaks() -> None:
    from traceml_jupyter.views.report import render_html

    html = render_html(eager_run(EAGER))
    under = "graph breaks (torch&#x27;s counter): 2</div><div class=\"tml-eager\""
    assert under in html
    assert "35 % of a step runs eagerly between the compiled graphs (host time, sampled over steps 12–15)</div>" in html
    why = render_html(eager_run({**EAGER, "share": None, "note": "the backend marks no graph call"}))
    assert "The share of a step run eagerly between graphs was not measured: the backend marks no graph call" in why


def test_the_eager_share_goes_to_the_json_and_back_and_older_files_have_none() -> None:
    result = eager_run(EAGER)
    doc = to_dict(result)
    assert doc["compile"]["eager"]["steps"] == [11, 14]
    assert from_dict(doc) == result
    older = to_dict(CANNED["compiled"]())  # facts as written before the eager share was measured
    assert "eager" not in older["compile"]
    loaded = from_dict(older)
    assert read_compile(loaded.compiled, loaded.steps.columns, loaded.loop.wall_ms).eager is None


def test_compare_shows_the_eager_share_of_both_runs() -> None:
    from traceml_jupyter.analysis.compare import compile_rows

    rows = compile_rows(eager_run(EAGER).summary, eager_run({**EAGER, "share": 0.05}).summary)
    assert rows[1] == ("Eager between graphs (torch.compile)", "35.0 %", "5.0 %", "-30 points")
    assert len(compile_rows(CANNED["compiled"]().summary, CANNED["compiled"]().summary)) == 1


def test_the_compile_facts_the_capture_writes_are_those_the_analysis_reads_and_the_docs_name() -> None:
    """capture/compiled's TypedDicts (what it writes), analysis/compile.py's (what the result
    holds and the JSON's `compile` is), and docs/compile.md's "In the JSON": the same keys."""
    import re
    from pathlib import Path

    from traceml_jupyter.analysis import compile as facts_of
    from traceml_jupyter.capture.compiled import compile_record, eager_share

    assert set(compile_record.CompileRecord.__annotations__) == set(facts_of.CompileFacts.__annotations__)
    assert set(eager_share.EagerShare.__annotations__) == set(facts_of.EagerShare.__annotations__)
    assert set(compile_record.FrameCompiled.__annotations__) == set(facts_of.FrameCompiled.__annotations__)
    docs = (Path(__file__).parents[3] / "docs" / "compile.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(\w+)`", docs.split("## In the JSON", 1)[1]))
    for kind in (facts_of.CompileFacts, facts_of.EagerShare, facts_of.FrameCompiled):
        assert set(kind.__annotations__) <= named, set(kind.__annotations__) - named

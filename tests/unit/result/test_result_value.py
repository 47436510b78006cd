"""A finished run is a value: frozen, read-only arrays, notes a tuple; one codec writes and reads
it (every schema version), its fields are the JSON's keys and docs/api.md's; every renderer
takes it as it is and leaves it as it was."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any

import pytest
from helpers import REPO, TESTS
from result_factory import CANNED

from traceml_jupyter.analysis.compare import compare_summaries
from traceml_jupyter.result import RunResult, from_dict, text, to_dict
from traceml_jupyter.result.codec import DERIVED, PATHS, LoadError
from traceml_jupyter.views.report import render_html

NAMES = sorted(CANNED)


@pytest.fixture(params=NAMES)
def result(request: pytest.FixtureRequest) -> RunResult:
    return CANNED[request.param]()


def test_the_canned_results_are_the_runs_they_stand_for() -> None:
    assert CANNED["input-bound"]().verdict.label == "INPUT-BOUND"
    assert CANNED["compute-bound"]().verdict.label == "COMPUTE-BOUND"
    assert CANNED["spiky"]().verdict.label == "INPUT STRAGGLER"
    assert CANNED["no steps"]().verdict.label == "NO DATA"
    assert CANNED["gpu clock"]().summary["clock"] == "gpu"
    assert len(CANNED["two ranks"]().ranks or ()) == 2


def test_a_result_reads_back_from_its_json_as_the_same_value(result: RunResult) -> None:
    document = json.loads(json.dumps(to_dict(result), allow_nan=False))
    back = from_dict(document)
    assert back == result
    assert to_dict(back) == document  # and writes the same JSON again
    assert back.schema_version == document["schema_version"] and back.unsaved == frozenset()


def test_the_first_schema_version_reads_back_and_round_trips() -> None:
    document = json.loads((TESTS / "data" / "run_v1.json").read_text())
    first = from_dict(document)
    assert first.schema_version == 1 and first.verdict.label == "INPUT-BOUND"
    assert {"loop.cell_source", "machine", "reading.quoted_cells"} <= first.unsaved
    again = from_dict(json.loads(json.dumps(to_dict(first), allow_nan=False)))
    assert again == first


def test_a_result_cannot_be_changed(result: RunResult) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.notes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.steps.n_steps = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        result.summary["clock"] = "gpu"  # type: ignore[index]
    with pytest.raises(TypeError):
        result.columns["step_ms"] = None  # type: ignore[index]
    for name, column in result.columns.items():
        assert not column.flags.writeable, name
    assert isinstance(result.notes, tuple) and isinstance(result.data.sources, tuple)


def test_every_renderer_takes_the_value_and_leaves_it_as_it_was(result: RunResult) -> None:
    before = to_dict(result)
    box = text(result)
    assert box.startswith(f"traceml: {result.name} - {result.n_steps} steps")
    assert f"Step Time: {result.verdict.label}" in box
    page = render_html(result)
    assert result.verdict.label in page
    json.dumps(to_dict(result), allow_nan=False)  # unmeasured values are null, never NaN
    same = compare_summaries(result.name, result.summary, result.verdict.label, "again", result.summary, result.verdict.label)
    assert same.to_dict()["verdict_a"] == same.to_dict()["verdict_b"]
    assert to_dict(result) == before


def test_the_kernels_reading_is_a_new_value() -> None:
    result = CANNED["input-bound"]()
    read = result.with_reading([{"key": "num_workers", "status": "fix"}], {"In [2]": "loader = ..."})
    assert read is not result and result.reading.checklist is None
    assert read.reading.checklist == ({"key": "num_workers", "status": "fix"},)
    assert to_dict(read)["quoted_cells"] == {"In [2]": "loader = ..."}


# -- one field list: the result's fields, the JSON's keys, docs/api.md ------------------------------


def _fields(cls: Any) -> set[str]:
    """The result's fields, a section's as "section.field"."""
    out = set()
    for name, kind in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(kind) and kind.__module__ == RunResult.__module__:
            out |= {f"{name}.{f.name}" for f in dataclasses.fields(kind)}
        else:
            out.add(name)
    return out


def _has(document: dict[str, Any], dotted: str) -> bool:
    value: Any = document
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return True


def test_each_field_of_the_result_has_its_place_in_the_json() -> None:
    provenance = {"schema_version", "unsaved", "kept"}
    assert _fields(RunResult) - provenance == set(PATHS)
    document = to_dict(CANNED["input-bound"]())
    for field, path in PATHS.items():
        assert _has(document, path), f"{field}: {path} is not written"
    written = set(document)
    placed = {p.split(".")[0] for p in [*PATHS.values(), *DERIVED]}
    assert written == placed


def test_every_key_of_the_json_is_documented() -> None:
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    section = api.split("## The JSON", 1)[1]
    documented = set(re.findall(r"`([a-z_0-9]+)`", section))
    missing = set(to_dict(CANNED["input-bound"]())) - documented
    assert not missing, f"docs/api.md's JSON section misses {sorted(missing)}"


def test_a_document_that_is_no_run_is_refused_in_one_line() -> None:
    with pytest.raises(LoadError, match="not a traceml run"):
        from_dict([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(LoadError, match="steps.step_ms is missing"):
        from_dict({"schema_version": 2, "name": "x", "summary": {}, "verdict": {"label": "X"}, "steps": {}})

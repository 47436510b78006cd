"""CPU OVERSUBSCRIBED on synthetic host figures: torch's threads times (1 + the workers that keep a
core busy) over the usable cores is named with its figures and fix, in the findings and the
checklist; a machine with spare cores, or workers that wait, get nothing."""

from __future__ import annotations

from typing import Any

import numpy as np

from traceml_jupyter.analysis.checklist import torch_threads_item
from traceml_jupyter.analysis.checklist.facts import Facts
from traceml_jupyter.analysis.threads import busy_workers, oversubscription


def worker(cpu_s: float, span_s: float = 2.0, loader: int = 1) -> dict[str, Any]:
    return {"pid": 1, "loader": loader, "first_s": 0.5, "last_s": 0.5 + span_s, "cpu_s": cpu_s}


def steps(compute: list[float]) -> dict[str, np.ndarray]:
    return {"step": np.arange(len(compute)), "compute_ms": np.asarray(compute, dtype=np.float64)}


UNSTABLE = steps([1.0, 1.1, 9.0, 1.0, 8.5, 1.2, 1.0, 9.2, 1.1, 1.0, 1.0, 8.8])


def test_two_threads_beside_two_busy_workers_on_two_cores_are_named() -> None:
    host = {"torch_threads": 2, "usable_cores": 2.0, "workers": [worker(1.8), worker(1.6)]}
    out, found = oversubscription(host, UNSTABLE, 0, loader=1)
    o = out["cpu_oversubscription"]
    assert out["cpu_torch_threads"] == 2
    assert (o["threads"], o["busy_workers"], o["usable_cores"], o["wanted_cores"]) == (2, 2, 2.0, 6)
    assert o["compute_p90_p50"] == float(np.percentile(UNSTABLE["compute_ms"], 90) / np.median(UNSTABLE["compute_ms"]))
    assert o["suggested_threads"] == 1 and o["suggested_workers"] == 1
    assert [f.label.value for f in found] == ["CPU OVERSUBSCRIBED"] and found[0].severity == "warn"
    assert "want 2 x (1 + 2) = 6 cores; 2 are usable" in found[0].text
    assert "`torch.set_num_threads(1)`" in found[0].next and "`num_workers=1`" in found[0].next
    item = torch_threads_item(Facts(loader=None, verdict="COMPUTE-BOUND", cpu_count=2, oversubscription=o))
    assert item is not None and item.status == "fix" and item.to_try == "torch.set_num_threads(1)"
    assert item.bears_on_verdict  # compute was unstable


def test_spare_cores_or_waiting_workers_get_nothing() -> None:
    spare = {"torch_threads": 2, "usable_cores": 8.0, "workers": [worker(1.8), worker(1.6)]}
    out, found = oversubscription(spare, UNSTABLE, 0)
    assert out["cpu_oversubscription"] is None and not found
    sleeping = {"torch_threads": 1, "usable_cores": 2.0, "workers": [worker(0.1), worker(0.2)]}
    assert busy_workers(sleeping["workers"]) == 0
    assert oversubscription(sleeping, UNSTABLE, 0)[0]["cpu_oversubscription"] is None
    assert torch_threads_item(Facts(loader=None, verdict="COMPUTE-BOUND", cpu_count=2)) is None


def test_without_torch_or_cores_nothing_is_said() -> None:
    out, found = oversubscription({"usable_cores": 2.0, "workers": []}, UNSTABLE, 0)
    assert out == {"cpu_torch_threads": None, "cpu_oversubscription": None} and not found
    assert oversubscription(None, UNSTABLE, 0) == ({"cpu_torch_threads": None, "cpu_oversubscription": None}, [])


def test_steady_compute_is_said_as_info() -> None:
    host = {"torch_threads": 4, "usable_cores": 2.0, "workers": []}
    out, found = oversubscription(host, steps([2.0] * 12), 0)
    assert out["cpu_oversubscription"]["wanted_cores"] == 4 and found[0].severity == "info"
    assert out["cpu_oversubscription"]["suggested_workers"] is None

"""Queries of CUDA's state after the user's code broke the context (a sticky error: every later
runtime call returns it): each gives its fallback (cuda_state.cuda_or), so a traced cell's start
never fails on them and the user's own CUDA call reports the error."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from traceml_jupyter.capture.gpu import cuda_clock, cuda_graphs, gpu_activity
from traceml_jupyter.capture.gpu.cuda_state import cuda_initialized, cuda_or

STICKY = "CUDA error: an illegal memory access was encountered"


class StickyCuda:
    """torch.cuda once a kernel hit an illegal address: initialised, every query raises."""

    def is_initialized(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        def query(*args: Any) -> Any:
            raise RuntimeError(STICKY)

        return query


def test_every_query_of_a_broken_context_gives_its_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=StickyCuda()))
    assert cuda_initialized()
    assert cuda_clock.current_device() is None
    assert cuda_clock.allocation_counts() == {}
    assert cuda_clock.busy_devices([0, 1]) == set()
    assert cuda_graphs.stream_capturing() is False
    assert gpu_activity.memory_stats() == {}


def test_cuda_or_answers_the_query_or_the_default() -> None:
    assert cuda_or(None, int, "3") == 3

    def broken() -> int:
        raise RuntimeError(STICKY)

    assert cuda_or(-1, broken) == -1
    with pytest.raises(KeyboardInterrupt):  # the user's, never swallowed
        cuda_or(-1, lambda: (_ for _ in ()).throw(KeyboardInterrupt()))

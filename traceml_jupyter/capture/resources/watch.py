"""The resources of one traced run, sampled while it runs, with or without a view: GPU
utilisation (NVML, nvml.py), GPU memory per step (the allocator, gpu_memory.py), the host's CPU
and memory of the training process and its DataLoader workers (psutil, host.py), what earlier
cells hold on the GPU when the cell starts, and the facts of an out-of-memory error.

`resources_watched(run, capture)` wraps a capture: the samplers start with it and stop (their
threads joined) when it ends, also on an error; then what they saw is left on the run and no
thread, psutil handle or NVML handle remains. Views only read `run.resource_watch` (live) and
what the run keeps. Nothing here raises into the user's code: a failure is a note.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Literal

from ...facts.resources import HeldBefore, OomFacts
from ...failures import never_raise, read_or
from ..data.probes import user_namespace
from ..gpu.cuda_state import cuda_initialized
from ..steps.step_model import ITERATION
from . import gpu_memory
from .gpu_memory import (
    GpuMemory,
    held_before,
    is_cuda_oom,
    oom_facts,
    reads_peak,
)
from .host import HostSampler
from .nvml import GpuSampler


class ResourceWatch:
    """The samplers of one run (see the module docstring)."""

    def __init__(self, run: Any, capture: Any) -> None:
        self.run = run
        self.capture = capture
        origin = run.recorder.origin_ns
        self.gpu = GpuSampler(origin, device_of_loop=lambda: run.cuda_device)
        self.host = HostSampler(origin)
        self.memory = GpuMemory(resets=not reads_peak(run.cell_source, run.loop_cell_source))
        self.held: HeldBefore | None = None
        self.oom: OomFacts | None = None
        self.notes: list[str] = []

    def start(self) -> None:
        """On the cell's thread, before its code runs: what earlier cells hold (CUDA
        initialised only), the host sampler's thread, and the capture's hooks to the watches."""
        run, capture = self.run, self.capture
        if cuda_initialized(gpu_memory.cuda_module()):  # the tensors of the user's namespace
            self.held = read_or(None, held_before, user_namespace())
        capture.memory = self.memory
        capture.on_workers = self.host.add_workers
        self.host.start()
        run.observe(self.tick)

    def tick(self, run: Any) -> None:
        """At the run's ticks (main thread): start NVML once the loop's GPU is known."""
        if not run.finished:
            self.gpu.start_when_ready()

    def failed(self, error: BaseException) -> None:
        """The cell raised: an out-of-memory error's facts are read now, while they hold."""
        with never_raise(self.notes, "The out-of-memory error was not read"):
            if not is_cuda_oom(error):
                return
            self.oom = oom_facts(error, self.run.cuda_device)
            # The step it happened in: where iterations are the steps, the located loop closed
            # the failing one as the error left it (a partial step); else it is still open.
            recorded = int(self.run.recorder.n_steps)
            closed = self.capture.model.level == ITERATION and recorded > 0
            step = recorded if closed else recorded + 1
            self.oom["step"] = step
            self.oom["completed_steps"] = step - 1

    def stop(self) -> None:
        """Stop every sampler (threads joined) and leave what they saw on the run."""
        run, capture = self.run, self.capture
        capture.memory = None
        capture.on_workers = None
        try:
            run.stop_observing(self.tick)
        except ValueError:
            pass
        self.gpu.stop()
        self.host.stop()
        gpu_samples = self.gpu.samples.columns()
        run.gpu_samples = gpu_samples
        run.gpu_note = None if len(gpu_samples["time_s"]) else self.gpu.note
        run.gpu_device = self.gpu.device
        run.host = self.host.result()
        memory = self.memory
        if memory.steps_read:
            run.extra_columns.update(memory.columns())
        run.gpu_memory = memory.result() if memory.device is not None else None
        run.held_before = self.held
        run.oom = self.oom
        run.notes.extend(self.notes + run.host.get("notes", []))
        if memory.off is not None and memory.device is not None:
            run.notes.append(memory.off)


class resources_watched:  # lower case: it reads as a statement, `with resources_watched(run, capture):`
    """Sample the run's resources for the duration (see the module docstring). The edges of
    the watch: its start, the cell's error, its stop; a failure of ours there is a note."""

    def __init__(self, run: Any, capture: Any) -> None:
        self.run = run
        self.watch = ResourceWatch(run, capture)

    def __enter__(self) -> ResourceWatch:
        self.run.resource_watch = self.watch
        with never_raise(self.run.notes, "Resources were not sampled"):
            self.watch.start()
        return self.watch

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if error is not None:
            self.watch.failed(error)
        self.run.resource_watch = None
        with never_raise(self.run.notes, "Resources not reported"):  # as the cell ends: never mask the user's error
            self.watch.stop()
        return False  # the cell's error goes on as it was

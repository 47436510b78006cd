"""The sampler thread both samplers run: a sample each period until stopped, the rate halved
when the kept samples are, a failure its note, and no thread left once stopped."""

from __future__ import annotations

import threading
import time

from traceml_jupyter.capture.resources.samples import SampleBuffer, Sampler


class Counting(Sampler):
    """Samples a counter; raises at sample `fail_at`; records what the life cycle called."""

    def __init__(self, capacity: int = 2048, fail_at: int | None = None, opens: bool = True) -> None:
        super().__init__("traceml-test-sampler", SampleBuffer(("time_s",), capacity), period_s=0.001)
        self.fail_at, self.opens = fail_at, opens
        self.calls: list[str] = []
        self.errors: list[Exception] = []

    def begin(self) -> bool:
        self.calls.append("begin")
        return self.opens

    def sample_once(self) -> None:
        if self.fail_at is not None and len(self.samples) + 1 == self.fail_at:
            raise RuntimeError("the device went away")
        self.samples.add_row([float(len(self.samples))])

    def last_sample(self) -> None:
        self.calls.append("last")

    def end(self) -> None:
        self.calls.append("end")

    def failed(self, error: Exception) -> None:
        self.errors.append(error)


def sampler_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "traceml-test-sampler"]


def test_a_sampler_samples_on_its_thread_until_stopped_and_leaves_no_thread() -> None:
    sampler = Counting()
    sampler.start_thread()
    assert sampler_threads() == ["traceml-test-sampler"]
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        sampler.wake()  # sample now (as new workers ask), whatever the period
        time.sleep(0.001)
    sampler.stop_thread()
    assert len(sampler.samples) >= 3
    assert not sampler.running and sampler_threads() == []
    assert sampler.calls == ["begin", "last", "end"] and not sampler.errors


def test_a_failing_sample_becomes_the_samplers_note_and_still_ends() -> None:
    sampler = Counting(fail_at=3)
    sampler.start_thread()
    assert sampler._thread is not None
    sampler._thread.join(timeout=10)
    assert not sampler.running and len(sampler.samples) == 2
    assert [str(e) for e in sampler.errors] == ["the device went away"]
    assert sampler.calls == ["begin", "end"]  # no last sample after a failure, but the end
    sampler.stop_thread()  # stopping a sampler that already ended is harmless


def test_a_sampler_with_nothing_to_sample_takes_none() -> None:
    sampler = Counting(opens=False)
    sampler.start_thread()
    sampler.stop_thread()
    assert len(sampler.samples) == 0 and sampler.calls == ["begin", "end"]


class Waits:
    """An event that records each wait's timeout and stops the sampler after `n` of them."""

    def __init__(self, sampler: Sampler, n: int) -> None:
        self.sampler, self.n = sampler, n
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.n:
            self.sampler._stop.set()
        return False

    def clear(self) -> None:
        pass


def test_the_rate_halves_each_time_the_kept_samples_do() -> None:
    sampler = Counting(capacity=4)
    waits = Waits(sampler, 20)
    sampler._wake = waits  # type: ignore[assignment]
    sampler._run()  # the thread's body, on this thread
    expected: list[float] = []
    kept, period = 0, 0.001  # the rule written out: when 4 are kept, 2 go and the period doubles
    for _ in range(20):
        expected.append(period)
        if kept == 4:
            kept, period = 2, period * 2
        kept += 1
    assert waits.timeouts == expected

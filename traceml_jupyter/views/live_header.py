"""The live chart's header, pure: the numbers of the steps so far (rate, medians, the verdict and
its share, the ranks, GPU and host resources) and their text and HTML. While the run records they
are read off the recording (a bounded window); once it has finished, off its result, as the
report shows them."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import numpy as np

from ..analysis.number_text import pct as _pct
from ..analysis.summary_keys import Summary
from ..analysis.verdict import VerdictLabel
from .live_svg import LEGEND_HTML, WINDOW

if TYPE_CHECKING:
    from ..result import RunResult
    from .live_lanes import LaneFeed


class StepsSoFar(Protocol):
    """The steps recorded so far, as the live chart reads them (the capture's Recorder)."""

    @property
    def origin_ns(self) -> int | None:
        """perf_counter_ns when the recording began."""
    @property
    def n_steps(self) -> int:
        """The steps recorded so far."""
    def tail(self, n: int) -> dict[str, np.ndarray]:
        """The last `n` steps' columns."""


class LiveRecording(Protocol):
    """What the live chart reads of a run while it records (recording.Recording), and its
    result once it has finished (`finished`, `result`). Read-only, but for `notes` (a view's
    failure is a note on the run) and `observe` (the chart's refresh is one of its observers)."""

    @property
    def name(self) -> str:
        """The run's name."""
    @property
    def finished(self) -> bool:
        """The run has finished: `result` is frozen."""
    @property
    def result(self) -> RunResult:
        """The result: frozen once finished, else so far."""
    @property
    def notes(self) -> list[str]:
        """What could not be measured or shown (a view appends its failure)."""
    @property
    def recorder(self) -> StepsSoFar:
        """The per-step columns recorded so far."""
    @property
    def n_steps(self) -> int:
        """The steps recorded so far."""
    @property
    def warmup(self) -> int | None:
        """The warm-up steps asked for (None: automatic)."""
    @property
    def expected_steps(self) -> int | None:
        """The steps a pass was expected to have."""
    @property
    def loops_started(self) -> int:
        """Passes begun over the located loop."""
    @property
    def loop_line(self) -> int | None:
        """The located loop's line."""
    @property
    def loop_where(self) -> str | None:
        """Where the loop is ("this cell", a function)."""
    @property
    def cell_source(self) -> str | None:
        """The traced cell's text."""
    @property
    def gpu_used(self) -> bool:
        """The loop ran on a CUDA device."""
    @property
    def batch_size(self) -> int | None:
        """Samples in a batch, if known."""
    @property
    def error(self) -> str | None:
        """What stopped the cell, if anything."""
    @property
    def gpu_samples(self) -> Mapping[str, Any] | None:
        """NVML samples kept once the watch stopped."""
    @property
    def gpu_note(self) -> str | None:
        """Why GPU figures are missing."""
    @property
    def rank_collector(self) -> object:
        """ranks.Collector while ranks stream (its live(window))."""
    @property
    def loader_lanes(self) -> LaneFeed | None:
        """The lanes inside the DataLoader's workers while the cell runs (capture/loader/lanes.py)."""
    @property
    def resource_watch(self) -> Any:
        """The capture's ResourceWatch while it samples."""
    @property
    def step_parts(self) -> Any:
        """The capture's StepParts: columns(cols) of sampled steps."""
    def observe(self, observer: Callable[[Any], None]) -> None:
        """Call `observer` at the run's ticks, and once when it finishes."""


SEVERITY_COLOUR = {"critical": "#c0392b", "warn": "#b9770e", "info": "#2e7d32"}


def format_duration(seconds: float | None) -> str:
    """A duration as the header says it: "<0.1 s", "4.2 s", "12 min 05 s", "1 h 02 min"."""
    if seconds is None or not np.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 0.1:
        return "<0.1 s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def verdict_share(label: str, summary: Summary) -> str:
    """The share behind a verdict, as the header says it ("data wait 94 % of step")."""
    if label == VerdictLabel.INPUT_BOUND:
        return f"data wait {_pct(summary.get('data_wait_share'), 0)} of step"
    if label == VerdictLabel.INPUT_STRAGGLER:
        return f"stalls cost {_pct(summary.get('straggler_share'), 0)} of the time"
    if label == VerdictLabel.COMPUTE_BOUND:
        return f"compute {_pct(summary.get('compute_share'), 0)} of step"
    if label == VerdictLabel.MIXED:
        return (
            f"data wait {_pct(summary.get('data_wait_share'), 0)}, "
            f"compute {_pct(summary.get('compute_share'), 0)} of step"
        )
    if label == VerdictLabel.RANK_STRAGGLER:
        return rank_share(summary.get("straggler"))
    if label == VerdictLabel.WARMUP:
        return "warming up"
    if label == VerdictLabel.TOO_SHORT:
        return "steps too short to judge"
    return "no step yet"


def window_throughput(tail: Mapping[str, np.ndarray]) -> float | None:
    """Steps per second over the steps of the window (from the first fetch to the last body end)."""
    n = len(tail["step"])
    if n < 2:
        return None
    span = float(tail["time_s"][-1] + tail["step_ms"][-1] / 1e3 - tail["time_s"][0])
    return n / span if span > 0 else None


def rank_share(straggler: Mapping[str, Any] | None) -> str:
    """"rank 1 holds the others back (input, 93 % of a step)"."""
    if not straggler:
        return "ranks balanced"
    return (
        f"rank {straggler['rank']} holds the others back ({straggler['cause']}, "
        f"{_pct(straggler.get('score'), 0)} of a step)"
    )


# What the header says (live_numbers; with_ranks_live adds `ranks`). "pass" is a keyword: the
# functional form of TypedDict.
HeaderNumbers = TypedDict(
    "HeaderNumbers",
    {
        "name": str,
        "step": int,
        "total": "int | None",
        "pass": "tuple[int, int, int] | None",
        "steps_per_s": "float | None",
        "samples_per_s": "float | None",
        "eta_s": "float | None",
        "verdict": str,
        "severity": str,
        "share": str,
        "finished": bool,
        "elapsed_s": "float | None",
        "error": "str | None",
        "ranks": str,
        "compiling": bool,
    },
    total=False,
)


def live_ranks(run: LiveRecording) -> dict[str, Any] | None:
    """Several forked ranks: each one's last WINDOW steps and the rank that holds the others
    back (ranks.Collector.live); None for one process."""
    live = getattr(run.rank_collector, "live", None)
    return live(WINDOW) if live is not None else None


def with_ranks_live(numbers: HeaderNumbers, ranks: Mapping[str, Any]) -> None:
    """The header while ranks run: how many, and the rank that holds the others back (the
    window of the rank the run shows cannot tell: it waits in backward like any other)."""
    numbers["ranks"] = f"{len(ranks['series'])} ranks"
    if numbers["finished"]:
        return
    slowest = ranks.get("slowest")
    if slowest is not None:
        numbers["verdict"], numbers["severity"] = VerdictLabel.RANK_STRAGGLER, "warn"
        numbers["share"] = rank_share({"rank": slowest, "cause": ranks.get("cause"), "score": ranks.get("score")})


def clock_columns(
    tail: Mapping[str, np.ndarray], gpu_used: bool
) -> tuple[dict[str, np.ndarray], bool]:
    """The window's steps on the GPU clock when the loop used the GPU and at least two of them
    have resolved GPU timings (the newest may not have yet), else every step on the CPU clock."""
    if gpu_used and "step_gpu_ms" in tail:
        done = np.isfinite(tail["step_gpu_ms"])
        if int(done.sum()) >= 2:
            return {k: v[done] for k, v in tail.items()}, True
    return dict(tail), False


def live_numbers(
    run: LiveRecording,
    tail: Mapping[str, np.ndarray],
    total: int | None,
    pass_info: tuple[int, int, int] | None,
) -> HeaderNumbers:
    """What the header says: position, throughput, ETA and the running verdict.

    While the loop runs the verdict comes from the window (bounded work); at the end it is the
    run's own verdict, as the report shows it.
    """
    from ..analysis.summary import summarize
    from ..analysis.verdict import diagnose

    finished, eta, elapsed = run.finished, None, None
    if finished:  # the final state: the run's result
        result = run.result
        step, batch, error = result.n_steps, result.steps.batch_size, result.error
        summary, verdict = result.summary, result.verdict
        steps_per_s, elapsed = summary.get("steps_per_s"), loop_seconds(result)
    else:
        step, batch, error = run.n_steps, run.batch_size, run.error
        cols, on_gpu = clock_columns(tail, run.gpu_used)
        summary = summarize(cols, step, run.warmup, on_gpu)
        verdict = diagnose(summary)
        steps_per_s = window_throughput(tail)
        if steps_per_s and total is not None and total >= step:
            eta = (total - step) / steps_per_s
        elif steps_per_s and pass_info is not None:
            eta = (pass_info[1] - pass_info[0]) / steps_per_s
    return {
        "name": run.name,
        "step": step,
        "total": total,
        "pass": pass_info,
        "steps_per_s": steps_per_s,
        "samples_per_s": steps_per_s * batch if steps_per_s and batch else None,
        "eta_s": eta,
        "verdict": verdict.label,
        "severity": verdict.severity,
        "share": verdict_share(verdict.label, summary),
        "finished": finished,
        "elapsed_s": elapsed,
        "error": error,
        "compiling": not finished and bool(getattr(getattr(run, "compile_watch", None), "compiling", False)),
    }


def loop_seconds(result: RunResult) -> float:
    """Time inside the loop (every step, fetch and body), in seconds."""
    return float((result.summary.get("totals_ms") or {}).get("step_ms", 0.0)) / 1e3


def _count(n: float | None, unit: str) -> str:
    if n is None:
        return f"? {unit}"
    return f"{n:,.0f} {unit}" if n >= 100 else f"{n:,.1f} {unit}"


def header_parts(numbers: HeaderNumbers, gpu: str) -> list[str]:
    """The header's pieces, in order, as plain text."""
    step, total, pass_info = numbers["step"], numbers["total"], numbers["pass"]
    if numbers["finished"]:
        where = f"done: {step:,} steps in {format_duration(numbers['elapsed_s'])}"
        if not step:
            where = "done: the loop ran no step"
        if numbers["error"]:
            where = f"stopped after {step:,} steps ({numbers['error']})"
    elif total is not None:
        where = f"step {step:,} / {total:,}"
    elif pass_info is not None:
        where = f"step {step:,} (pass {pass_info[2]}: {pass_info[0]:,} / {pass_info[1]:,})"
    else:
        where = f"step {step:,}"
    parts = [where]
    if numbers.get("compiling"):
        parts.append("compiling… (torch.compile)")  # a long first step is not hung (docs/compile.md)
    if numbers["steps_per_s"] is not None or not numbers["finished"]:
        parts.append(_count(numbers["steps_per_s"], "steps/s"))
    if numbers["samples_per_s"] is not None:
        parts.append(_count(numbers["samples_per_s"], "samples/s"))
    if not numbers["finished"] and numbers["eta_s"] is not None:
        parts.append(f"ETA {format_duration(numbers['eta_s'])}")
    if numbers.get("ranks"):
        parts.append(str(numbers["ranks"]))
    parts.append(f"{numbers['verdict']}: {numbers['share']}")
    parts.append(gpu)
    return parts


def gpu_text(run: LiveRecording) -> str:
    """"GPU 87 % | mem 10.2 / 80 GiB" while it runs (the allocator's figure for this process
    on a CUDA loop, else NVML's device-wide one), "GPU 87 % on average" at the end, else why
    there is no GPU figure."""
    watch = run.resource_watch
    if watch is None:  # once finished: what the result kept
        if run.finished:
            gpu = run.result.gpu
            return kept_gpu_text(gpu.samples, gpu.note, gpu.used)
        return kept_gpu_text(run.gpu_samples, run.gpu_note, run.gpu_used)
    sampler, memory = watch.gpu, watch.memory
    latest = sampler.samples.latest()
    mem = None
    total = memory.capacity_mib or sampler.mem_total_mib
    if memory.last is not None:
        used: float | None = memory.last["allocated_mib"]
    else:
        used = latest[1] if latest is not None else None
    if used is not None:
        mem = f"{used / 1024:.1f} / {total / 1024:.0f} GiB" if total else f"{used / 1024:.1f} GiB"
    if latest is not None:
        util = latest[0]
        busy = f"{util:.0f} %" if np.isfinite(util) else "n/a"  # a MIG slice: no utilisation
        return f"GPU {busy} | mem {mem}"
    if mem is not None:
        return f"GPU mem {mem}"
    return sampler.note or "GPU: starting NVML"


def kept_gpu_text(samples: Mapping[str, Any] | None, note: str | None, used: bool) -> str:
    """"GPU 87 % on average" over the NVML samples a run kept, else why there is no figure."""
    utils = np.asarray((samples or {}).get("gpu_util_pct", ()), dtype=np.float64)
    utils = utils[np.isfinite(utils)]
    if len(utils):
        return f"GPU {float(np.mean(utils)):.0f} % on average"
    return note or ("GPU n/a" if not used else "GPU: not sampled")


def host_text(run: LiveRecording) -> str | None:
    """"CPU 1.8 / 2 cores | RSS 1.2 GiB": the cores busy in the training process and its
    DataLoader workers, of the usable ones, and the process's memory (newest sample while it
    runs, the loop's median at the end); None before the sampler has two samples."""
    watch = run.resource_watch
    if watch is None:  # once finished: what the result kept
        return kept_host_text(run.result.summary) if run.finished else None
    row = watch.host.latest()
    if row is None:
        return None
    cores = row["process_cores"] + row["workers_cores"]
    return _host_line(cores, watch.host.usable_cores, row["process_rss_mib"], False)


def kept_host_text(summary: Summary) -> str | None:
    """The cores busy and the memory a finished run's summary kept, as host_text says them."""
    cores, usable = summary.get("cpu_cores"), summary.get("cpu_usable_cores")
    if cores is None or not usable:
        return None
    return _host_line(cores, usable, summary.get("host_rss_mib"), bool(summary.get("cpu_saturated")))


def _host_line(cores: float, usable: float, rss: float | None, saturated: bool) -> str:
    text = f"CPU {cores:.1f} / {usable:g} cores" + (" (saturated)" if saturated else "")
    if rss is not None and np.isfinite(rss):
        text += f" | RSS {rss / 1024:.1f} GiB" if rss >= 1024 else f" | RSS {rss:.0f} MiB"
    return text


def resources_text(run: LiveRecording) -> str:
    """The header's last part: GPU, then CPU and memory (what the capture samples while the run
    records; once it has finished and its watch stopped, what its result kept)."""
    host = host_text(run)
    return gpu_text(run) + (f" | {host}" if host else "")


def header_text(numbers: HeaderNumbers, gpu: str) -> str:
    """The header as one line of text (live_numbers' `numbers`, resources_text's `gpu`)."""
    return f"traceml {numbers['name']} | " + " | ".join(header_parts(numbers, gpu))


def header_html(numbers: HeaderNumbers, gpu: str) -> str:
    """The header as HTML: the verdict in its severity's colour, the chart's legend."""
    parts = [html.escape(p) for p in header_parts(numbers, gpu)]
    colour = SEVERITY_COLOUR.get(numbers["severity"], "#555")
    verdict = html.escape(str(numbers["verdict"]))
    parts[-2] = parts[-2].replace(verdict, f'<b style="color:{colour}">{verdict}</b>', 1)
    sep = ' <span style="color:#999">&middot;</span> '
    if not numbers.get("ranks"):  # the ranks' chart has a legend of its own
        parts.append(LEGEND_HTML)
    return (
        '<div class="traceml-live-header" style="font-family:var(--jp-ui-font-family,sans-serif);'
        'font-size:13px;line-height:1.5">'
        f"<b>traceml</b> {html.escape(str(numbers['name']))}{sep}{sep.join(parts)}</div>"
    )

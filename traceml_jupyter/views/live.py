"""The live view of a traced cell: a header line and a bqplot chart of data wait vs compute per step.

A thin view over the Run: `start(run)` registers `view.refresh` as an observer (the step hook
calls it on the main thread at most 4 times a second, and once more when the run finishes).
Each refresh reads a bounded tail of the recorder and sends one batched update per widget it
changes. Without a widget front-end it becomes an updating HTML display, or nothing.

Widgets are built only for runs that last past the first update (about a second), and only
the KEEP_LIVE_CHARTS newest finished runs keep them: an older chart is replaced in place by a
static picture of its final state and its widgets are closed, so a long session does not pile
them up.
"""

from __future__ import annotations

import ast
import html
from collections.abc import Mapping
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from ..analysis.cell_code import parse_cell
from ..analysis.number_text import pct as _pct
from ..analysis.verdict import VerdictLabel
from ..capture.locate import range_call
from ..kernel.shell import ipython_shell
from . import environment

if TYPE_CHECKING:
    from ..run import Run

WINDOW = 300  # steps in the rolling chart
OVERVIEW_BINS = 128  # bins of the overview strip over the whole run
# Each refresh (at most 4 a second) redraws one widget, so the view sends at most one comm
# message per refresh and 4 a second: the bars twice a second, the header 1.5 times, the
# overview strip every 2 s. The final refresh redraws all three.
ROTATION = ("header", "bars", "header", "bars", "header", "bars", "overview", "bars")
MESSAGES_PER_S = 4.0  # chart updates a second of run, the final three included
FINAL_MESSAGES = 3
OVERVIEW_READ_CAP = 1 << 17  # most new steps read in one refresh for the overview
WAIT_COLOUR = "#f28e2b"  # warm: the loop waits for data
COMPUTE_COLOUR = "#4e79a7"  # cool: the loop body runs
# The parts of sampled steps, stacked under the rest of compute (all of it on other steps).
PART_COLOURS = ("#76b7b2", "#59a14f", "#b07aa1")  # forward, backward, optimizer
WINDOW_ROWS = ("data wait", "forward", "backward", "optimizer", "compute")
SEVERITY_COLOUR = {"critical": "#c0392b", "warn": "#b9770e", "info": "#2e7d32"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Finished runs whose chart stays made of live widgets (22 each); an older chart is replaced
# in place by a static picture of its final state and its widgets are closed.
KEEP_LIVE_CHARTS = 3

# -- pure pieces ------------------------------------------------------------------------------


def _int_value(node: ast.expr, names: Mapping[str, Any]) -> int | None:
    """An int from a literal, a name bound to an int, or + - * // of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return int(node.value)
    if isinstance(node, ast.Name):
        value = names.get(node.id)
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            return None
        try:
            return int(value.__index__())  # type: ignore[union-attr]
        except Exception:
            return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand, names)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp):
        a, b = _int_value(node.left, names), _int_value(node.right, names)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.FloorDiv) and b:
            return a // b
    return None


def range_length(node: ast.expr, names: Mapping[str, Any]) -> int | None:
    """len() of `range(...)`, `trange(...)`, `tqdm(range(...))` or `enumerate(range(...))`."""
    call = range_call(node)
    if call is None or not 1 <= len(call.args) <= 3 or call.keywords:
        return None
    args = [_int_value(arg, names) for arg in call.args]
    if any(a is None for a in args) or (len(args) == 3 and not args[2]):
        return None
    return len(range(*args))  # type: ignore[arg-type]


def _path_to(node: ast.AST, line: int) -> list[ast.AST] | None:
    """The nodes from `node` down to the `for` statement on `line` (that statement excluded)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.For) and child.lineno == line:
            return [node]
        end = getattr(child, "end_lineno", None)
        if end is not None and not child.lineno <= line <= end:  # type: ignore[attr-defined]
            continue
        found = _path_to(child, line)
        if found is not None:
            return [node] + found
    return None


def loops_around(source: str | None, loop_line: int | None) -> list[ast.For] | None:
    """The `for` statements of the cell that enclose the step loop on `loop_line`, outermost
    first; None when that is unknowable (not in the cell's own code, inside a while or a def)."""
    if not source or loop_line is None:
        return None
    tree = parse_cell(source)
    if tree is None:
        return None
    path = _path_to(tree, loop_line)
    if path is None:
        return None
    unknown = (ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    if any(isinstance(node, unknown) for node in path):
        return None
    return [node for node in path if isinstance(node, ast.For)]


def passes_of(loops: list[ast.For] | None, names: Mapping[str, Any]) -> int | None:
    """How many times the step loop runs: the product of the range loops around it."""
    if loops is None:
        return None
    total = 1
    for loop in loops:
        n = range_length(loop.iter, names)
        if n is None:
            return None
        total *= max(n, 0)
    return total


def format_duration(seconds: float | None) -> str:
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


def verdict_share(label: str, summary: Mapping[str, Any]) -> str:
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


# -- several processes (ranks/ sends their steps) ------------------------------------------------------
RANK_COLOURS = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#bab0ac")
STRAGGLER_COLOUR = "#c0392b"
WAIT_OPACITY = 0.45


def rank_share(straggler: Mapping[str, Any] | None) -> str:
    """"rank 1 holds the others back (input, 93 % of a step)"."""
    if not straggler:
        return "ranks balanced"
    return (
        f"rank {straggler['rank']} holds the others back ({straggler['cause']}, "
        f"{_pct(straggler.get('score'), 0)} of a step)"
    )


def live_ranks(run: Run) -> dict[str, Any] | None:
    """Several forked ranks: each one's last WINDOW steps and the rank that holds the others
    back (ranks.Collector.live); None for one process."""
    live = getattr(run.rank_collector, "live", None)
    return live(WINDOW) if live is not None else None


def with_ranks_live(numbers: dict[str, Any], ranks: Mapping[str, Any]) -> None:
    """The header while ranks run: how many, and the rank that holds the others back (the
    window of the rank the run shows cannot tell: it waits in backward like any other)."""
    numbers["ranks"] = f"{len(ranks['series'])} ranks"
    if numbers["finished"]:
        return
    slowest = ranks.get("slowest")
    if slowest is not None:
        numbers["verdict"], numbers["severity"] = VerdictLabel.RANK_STRAGGLER, "warn"
        numbers["share"] = rank_share({"rank": slowest, "cause": ranks.get("cause"), "score": ranks.get("score")})


def rank_lines(feed: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, list[str], list[float], list[str]]:
    """x, y (one row per line, NaN-padded), colours, opacities and labels: for each rank its
    step time, then its data wait (paler, same colour); the straggler in red."""
    series = list(feed["series"])
    width = max((len(s["step"]) for s in series), default=0)
    xs, ys, colours, opacities, labels = [], [], [], [], []
    for i, s in enumerate(series):
        colour = STRAGGLER_COLOUR if s["rank"] == feed.get("slowest") else RANK_COLOURS[i % len(RANK_COLOURS)]
        for column, opacity, what in (("step_ms", 1.0, "step"), ("data_wait_ms", WAIT_OPACITY, "data wait")):
            x = np.full(width, np.nan)
            y = np.full(width, np.nan)
            n = len(s["step"])
            x[:n] = np.asarray(s["step"], dtype=np.float64)
            y[:n] = np.asarray(s[column], dtype=np.float64)
            xs.append(x)
            ys.append(y)
            colours.append(colour)
            opacities.append(opacity)
            labels.append(f"rank {s['rank']} {what}")
    if not xs:
        return np.zeros((0, 0)), np.zeros((0, 0)), [], [], []
    return np.vstack(xs), np.vstack(ys), colours, opacities, labels


def rank_svg(feed: Mapping[str, Any], width: int = 640, height: int = 170) -> str:
    """The per-rank chart as a small inline SVG (front-ends without widgets, and the static
    picture of a finished chart): step time per rank, data wait paler, the straggler in red."""
    x, y, colours, opacities, labels = rank_lines(feed)
    if not x.size or not np.isfinite(y).any():
        return ""
    left, bottom, top = 44.0, 18.0, 8.0
    x0, x1 = float(np.nanmin(x)), float(np.nanmax(x))
    peak = float(np.nanmax(y)) or 1.0
    span = (x1 - x0) or 1.0

    def px(a: np.ndarray) -> np.ndarray:
        return left + (a - x0) / span * (width - left - 8.0)

    def py(a: np.ndarray) -> np.ndarray:
        return height - bottom - a / peak * (height - bottom - top)

    parts = []
    for row in range(len(labels)):
        ok = np.isfinite(x[row]) & np.isfinite(y[row])
        if ok.sum() < 2:
            continue
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px(x[row][ok]), py(y[row][ok]), strict=True))
        parts.append(
            f'<polyline fill="none" stroke="{colours[row]}" stroke-opacity="{opacities[row]}" '
            f'stroke-width="1.5" points="{points}"><title>{html.escape(labels[row])}</title></polyline>'
        )
    legend = "".join(
        f'<text x="{left + 6 + 150 * (i // 2)}" y="{top + 10 + 12 * (i % 2)}" font-size="10" '
        f'fill="{colours[i]}" fill-opacity="{max(opacities[i], 0.7)}">{html.escape(labels[i])}</text>'
        for i in range(len(labels))
    )
    axes = (
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 8}" y2="{height - bottom}" stroke="#999"/>'
        f'<text x="2" y="{top + 8}" font-size="10" fill="#555">{peak:.3g} ms</text>'
        f'<text x="2" y="{height - bottom}" font-size="10" fill="#555">0</text>'
        f'<text x="{left}" y="{height - 4}" font-size="10" fill="#555">step {x0:.0f}</text>'
        f'<text x="{width - 60}" y="{height - 4}" font-size="10" fill="#555">step {x1:.0f}</text>'
    )
    return (
        f'<svg class="traceml-rank-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'xmlns="http://www.w3.org/2000/svg" style="display:block">' + axes + "".join(parts) + legend + "</svg>"
    )


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
    run: Run,
    tail: Mapping[str, np.ndarray],
    total: int | None,
    pass_info: tuple[int, int, int] | None,
) -> dict[str, Any]:
    """What the header says: position, throughput, ETA and the running verdict.

    While the loop runs the verdict comes from the window (bounded work); at the end it is the
    run's own verdict, as the report shows it.
    """
    from ..analysis.summary import summarize
    from ..analysis.verdict import diagnose

    step = run.n_steps
    if run.finished:
        summary, verdict = run.summary, run.verdict_detail
        steps_per_s = summary.get("steps_per_s")
    else:
        cols, on_gpu = clock_columns(tail, bool(run._gpu_used))
        summary = summarize(cols, step, run.warmup, on_gpu)
        verdict = diagnose(summary)
        steps_per_s = window_throughput(tail)
    eta: float | None = None
    if steps_per_s and not run.finished:
        if total is not None and total >= step:
            eta = (total - step) / steps_per_s
        elif pass_info is not None:
            eta = (pass_info[1] - pass_info[0]) / steps_per_s
    batch = run.batch_size
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
        "finished": run.finished,
        "elapsed_s": _loop_seconds(run) if run.finished else None,
        "error": run.error,
    }


def _loop_seconds(run: Run) -> float:
    """Time inside the loop (every step, fetch and body), in seconds."""
    return float(run.recorder.totals().get("step_ms", 0.0)) / 1e3


def _count(n: float | None, unit: str) -> str:
    if n is None:
        return f"? {unit}"
    return f"{n:,.0f} {unit}" if n >= 100 else f"{n:,.1f} {unit}"


def header_parts(numbers: Mapping[str, Any], gpu: str) -> list[str]:
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


def gpu_text(run: Run) -> str:
    """"GPU 87 % | mem 10.2 / 80 GiB" while it runs (the allocator's figure for this process
    on a CUDA loop, else NVML's device-wide one), "GPU 87 % on average" at the end, else why
    there is no GPU figure."""
    watch = run.resource_watch
    if watch is None:
        samples = run.gpu_samples or {}
        utils = np.asarray(samples.get("gpu_util_pct", ()), dtype=np.float64)
        utils = utils[np.isfinite(utils)]
        if len(utils):
            return f"GPU {float(np.mean(utils)):.0f} % on average"
        return run.gpu_note or ("GPU n/a" if not run._gpu_used else "GPU: not sampled")
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


def host_text(run: Run) -> str | None:
    """"CPU 1.8 / 2 cores | RSS 1.2 GiB": the cores busy in the training process and its
    DataLoader workers, of the usable ones, and the process's memory (newest sample while it
    runs, the loop's median at the end); None before the sampler has two samples."""
    watch = run.resource_watch
    if watch is not None:
        row = watch.host.latest()
        if row is None:
            return None
        cores = row["process_cores"] + row["workers_cores"]
        usable, rss = watch.host.usable_cores, row["process_rss_mib"]
        saturated = False
    else:
        s = run.summary if run.finished else {}
        cores, usable, rss = s.get("cpu_cores"), s.get("cpu_usable_cores"), s.get("host_rss_mib")
        saturated = bool(s.get("cpu_saturated"))
        if cores is None or not usable:
            return None
    text = f"CPU {cores:.1f} / {usable:g} cores" + (" (saturated)" if saturated else "")
    if rss is not None and np.isfinite(rss):
        text += f" | RSS {rss / 1024:.1f} GiB" if rss >= 1024 else f" | RSS {rss:.0f} MiB"
    return text


def resources_text(run: Run) -> str:
    """The header's last part: GPU, then CPU and memory."""
    host = host_text(run)
    return gpu_text(run) + (f" | {host}" if host else "")


def header_text(numbers: Mapping[str, Any], gpu: str) -> str:
    return f"traceml {numbers['name']} | " + " | ".join(header_parts(numbers, gpu))


def header_html(numbers: Mapping[str, Any], gpu: str) -> str:
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


LEGEND_HTML = (
    f'<span style="color:{WAIT_COLOUR}">&#9632;</span> data wait '
    f'<span style="color:{PART_COLOURS[0]}">&#9632;</span> forward '
    f'<span style="color:{PART_COLOURS[1]}">&#9632;</span> backward '
    f'<span style="color:{PART_COLOURS[2]}">&#9632;</span> optimizer '
    f'<span style="color:{COMPUTE_COLOUR}">&#9632;</span> compute (the rest)'
)


def window_rows(wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None) -> np.ndarray:
    """The window's stacked rows (WINDOW_ROWS): data wait, forward, backward and optimizer of
    sampled steps (0 elsewhere), and the rest of compute (all of it on steps not sampled)."""
    n = len(wait)
    split = [np.zeros(n)] * 3
    if parts is not None:
        split = [np.nan_to_num(np.asarray(parts[k], dtype=np.float64)[-n:]) for k in ("forward", "backward", "optimizer")]
    rest = np.maximum(np.asarray(compute, dtype=np.float64) - split[0] - split[1] - split[2], 0.0)
    return np.vstack([wait, *split, rest])


def window_parts(run: Run, cols: Mapping[str, np.ndarray], on_gpu: bool) -> dict[str, np.ndarray] | None:
    """The parts of the window's steps on its clock (None: the run has no parts)."""
    parts = getattr(run, "step_parts", None)
    if parts is None or not len(cols["step"]):
        return None
    try:
        got = parts.columns(dict(cols))
    except Exception:
        return None
    suffix = "_gpu_ms" if on_gpu else "_ms"
    return {k: got[k + suffix] for k in ("forward", "backward", "optimizer") if k + suffix in got}


def waiting_html(name: str) -> str:
    return (
        '<div class="traceml-live-header" style="font-size:13px">'
        f"<b>traceml</b> {html.escape(name)}: waiting for the first step&hellip;</div>"
    )


class Overview:
    """The whole run in at most OVERVIEW_BINS bins of equal width (a power of two of steps):
    mean data wait and compute per bin, accumulated from the steps each refresh adds."""

    def __init__(self, bins: int = OVERVIEW_BINS) -> None:
        self.bins = bins
        self.width = 1
        self.count = np.zeros(bins)
        self.wait = np.zeros(bins)
        self.compute = np.zeros(bins)

    def add(self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        """Add steps in order. Where the recorder kept one step in k (very long runs), a row
        stands for the steps up to the next row, and counts that many times."""
        if not len(step):
            return
        while int(step[-1]) // self.width >= self.bins:
            self.width *= 2
            for values in (self.count, self.wait, self.compute):
                merged = values.reshape(-1, 2).sum(axis=1)
                values[:] = 0.0
                values[: len(merged)] = merged
        weight = np.diff(step, append=step[-1] + 1).astype(np.float64)
        ok = np.isfinite(wait) & np.isfinite(compute)
        index = (step[ok] // self.width).astype(np.int64)
        weight = weight[ok]
        size = self.bins
        self.count += np.bincount(index, weights=weight, minlength=size)[:size]
        self.wait += np.bincount(index, weights=wait[ok] * weight, minlength=size)[:size]
        self.compute += np.bincount(index, weights=compute[ok] * weight, minlength=size)[:size]

    def means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bin centres (1-based steps), mean data wait and mean compute in ms, filled bins only."""
        used = self.count > 0
        centre = (np.flatnonzero(used) + 0.5) * self.width + 0.5
        n = self.count[used]
        return centre, self.wait[used] / n, self.compute[used] / n


def svg_chart(wait: np.ndarray, compute: np.ndarray, width: int = 640, height: int = 110) -> str:
    """Stacked areas (data wait under compute) as a small inline SVG, for front-ends without widgets."""
    n = len(wait)
    if n < 2:
        return ""
    top = wait + compute
    peak = float(np.nanmax(top)) or 1.0
    x = np.linspace(0.0, width, n)

    def points(upper: np.ndarray, lower: np.ndarray) -> str:
        ys = height - np.concatenate([upper, lower[::-1]]) / peak * (height - 4)
        xs = np.concatenate([x, x[::-1]])
        return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs, ys, strict=True))

    zero = np.zeros(n)
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'xmlns="http://www.w3.org/2000/svg" style="display:block">'
        f'<polygon fill="{COMPUTE_COLOUR}" points="{points(top, wait)}"/>'
        f'<polygon fill="{WAIT_COLOUR}" points="{points(wait, zero)}"/>'
        f'<text x="4" y="12" font-size="11" fill="#333">max {peak:.3g} ms / step</text></svg>'
    )


# -- front-ends ---------------------------------------------------------------------------------


def static_chart_html(header: str, window: np.ndarray, overview: np.ndarray) -> str:
    """A finished chart as inline HTML: its last header, then the window and the whole run
    (rows: data wait, compute) as small SVGs. Reads the same on GitHub and nbviewer."""
    parts = [header]
    if window.ndim == 2 and window.shape[1] >= 2:
        parts.append(svg_chart(window[0], window[1]))
    if overview.ndim == 2 and overview.shape[1] >= 2:
        parts.append(
            '<div style="font-size:11px;color:#555;margin-top:4px">whole run (mean per bin)</div>'
            + svg_chart(overview[0], overview[1], height=40)
        )
    parts.append(
        '<div style="font-size:11px;color:#777">Static picture of the finished live chart '
        "(its widgets were released: newer runs have the live ones).</div>"
    )
    return '<div class="traceml-live-static">' + "".join(parts) + "</div>"


def _two_rows(rows: np.ndarray) -> np.ndarray:
    """The window's stacked rows as data wait and compute (the static picture's two colours)."""
    if rows.ndim == 2 and rows.shape[0] > 2:
        return np.vstack([rows[0], rows[1:].sum(axis=0)])
    return rows


def widgets_under(root: Any) -> list[Any]:
    """Every widget reachable from `root` through its synced traits: children, marks, axes,
    scales, figures, layouts, styles (each one holds a comm until closed)."""
    from ipywidgets import Widget

    found: dict[int, Any] = {}
    stack = [root]
    while stack:
        widget = stack.pop()
        if id(widget) in found:
            continue
        found[id(widget)] = widget
        for name in widget.keys:
            value = getattr(widget, name, None)
            if isinstance(value, dict):  # a mark's scales
                value = list(value.values())
            values = value if isinstance(value, (list, tuple)) else [value]
            stack.extend(v for v in values if isinstance(v, Widget))
    return list(found.values())


class WidgetDisplay:
    """Displays a widget with a plain-text fallback (never "VBox(children=...)"), the same way
    under ipywidgets 7 and 8 (both speak version 2 of the widget view format)."""

    def __init__(self, widget: Any, text: str) -> None:
        self.widget = widget
        self.text = text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {
            "text/plain": self.text,
            WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
        }


def vertical_axis() -> dict[str, str]:
    """A y axis on the left: `orientation` in bqplot 0.12 (ipywidgets 7), `side` alone in 0.13.
    Set at creation, so bqplot sends no update for it afterwards."""
    from bqplot import Axis

    if "orientation" in Axis.class_traits():
        return {"orientation": "vertical", "side": "left"}
    return {"side": "left"}


class WidgetChart:
    """Header (ipywidgets.HTML), a bqplot figure of the window, and a thin overview strip.

    Scales fit their data in the browser, so a refresh changes only the mark data and the
    header text: one update message per changed widget, x and y batched with hold_sync.
    """

    def __init__(self, run_name: str) -> None:
        import ipywidgets as widgets
        from bqplot import Axis, Bars, Figure, LinearScale

        self.header = widgets.HTML(value=waiting_html(run_name))
        x, y = LinearScale(), LinearScale(min=0.0)
        empty_x, empty_y = np.zeros(0), np.zeros((2, 0))
        self.bars = Bars(
            x=empty_x,
            y=np.zeros((len(WINDOW_ROWS), 0)),
            scales={"x": x, "y": y},
            type="stacked",
            colors=[WAIT_COLOUR, *PART_COLOURS, COMPUTE_COLOUR],
            labels=list(WINDOW_ROWS),
            padding=0.1,
        )
        self.figure = Figure(
            marks=[self.bars],
            axes=[
                Axis(scale=x, label="step", tick_format="d"),
                Axis(scale=y, label="ms per step", tick_format=".3~g", **vertical_axis()),
            ],
            layout=widgets.Layout(width="100%", height="240px"),
            fig_margin={"top": 10, "bottom": 40, "left": 60, "right": 30},
            animation_duration=0,
        )
        ox, oy = LinearScale(), LinearScale(min=0.0)
        self.overview_bars = Bars(
            x=empty_x,
            y=empty_y,
            scales={"x": ox, "y": oy},
            type="stacked",
            colors=[WAIT_COLOUR, COMPUTE_COLOUR],
            padding=0.0,
        )
        self.overview = Figure(
            marks=[self.overview_bars],
            axes=[Axis(scale=ox, tick_format="d", num_ticks=6)],
            title="whole run (mean per bin)",
            title_style={"font-size": "11px"},
            layout=widgets.Layout(width="100%", height="80px"),
            fig_margin={"top": 18, "bottom": 22, "left": 60, "right": 30},
            animation_duration=0,
        )
        self.box = widgets.VBox([self.header, self.figure, self.overview])
        self.handle: Any = None  # the display of the box, updated when the chart is released
        self.rank_lines: Any = None  # several processes: one line per rank in place of the bars
        self.rank_series: Mapping[str, Any] | None = None

    def show(self, text: str) -> Any:
        return WidgetDisplay(self.box, text)

    def picture(self, text: str) -> HtmlStatus:
        """The chart as it is now, without widgets."""
        if self.rank_series is not None:
            body = str(self.header.value) + rank_svg(self.rank_series)
            return HtmlStatus(text, '<div class="traceml-live-static">' + body + "</div>")
        return HtmlStatus(
            text,
            static_chart_html(
                str(self.header.value),
                _two_rows(np.asarray(self.bars.y, dtype=np.float64)),
                np.asarray(self.overview_bars.y, dtype=np.float64),
            ),
        )

    def release(self, text: str) -> None:
        """Replace the displayed chart by its static picture, then close every widget of it."""
        try:
            if self.handle is not None:
                self.handle.update(self.picture(text))
        finally:
            for widget in widgets_under(self.box):
                widget.close()

    def draw_header(self, value: str) -> None:
        if self.header.value != value:
            self.header.value = value

    def draw_window(
        self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None = None
    ) -> None:
        with self.bars.hold_sync():
            self.bars.x = step.astype(np.float64)
            self.bars.y = window_rows(wait, compute, parts)

    def draw_overview(self, centre: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        with self.overview_bars.hold_sync():
            self.overview_bars.x = centre
            self.overview_bars.y = np.vstack([wait, compute])

    def draw_ranks(self, feed: Mapping[str, Any]) -> None:
        """Several processes: each rank's step time (its data wait paler) in place of the bars,
        the rank that holds the others back in red; one update message."""
        from bqplot import Lines

        self.rank_series = feed
        x, y, colours, opacities, labels = rank_lines(feed)
        if self.rank_lines is None:
            self.rank_lines = Lines(
                x=x, y=y, scales=self.bars.scales, colors=colours, opacities=opacities,
                labels=labels, display_legend=True, stroke_width=1.5,
            )
            self.figure.marks = [self.rank_lines]
            return
        with self.rank_lines.hold_sync():
            self.rank_lines.x, self.rank_lines.y = x, y
            self.rank_lines.colors, self.rank_lines.opacities = colours, opacities
            self.rank_lines.labels = labels


class HtmlStatus:
    """The updating HTML display used where widgets cannot be drawn."""

    def __init__(self, text: str, body: str) -> None:
        self.text, self.body = text, body

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text, "text/html": self.body}


class HtmlChart:
    """Header and a small SVG of the window in one display, updated through its display handle."""

    def __init__(self, run_name: str) -> None:
        self.status = HtmlStatus(
            f"traceml {run_name}: waiting for the first step", waiting_html(run_name)
        )
        self.handle: Any = None
        self._header = ""
        self._svg = ""

    def show(self, text: str) -> Any:
        return self.status

    def draw_header(self, value: str) -> None:
        self._header = value

    def draw_window(
        self, step: np.ndarray, wait: np.ndarray, compute: np.ndarray, parts: dict[str, np.ndarray] | None = None
    ) -> None:
        self._svg = svg_chart(wait, compute)

    def draw_overview(self, centre: np.ndarray, wait: np.ndarray, compute: np.ndarray) -> None:
        pass

    def draw_ranks(self, feed: Mapping[str, Any]) -> None:
        self._svg = rank_svg(feed)

    def publish(self, text: str) -> None:
        self.status = HtmlStatus(text, self._header + self._svg)
        if self.handle is not None:
            self.handle.update(self.status)


# -- the view -----------------------------------------------------------------------------------


class LiveView:
    """Refreshed by the run (observer); `close()` ends it, leaving the last picture displayed."""

    def __init__(
        self,
        run: Run,
        chart: WidgetChart | HtmlChart | None,
        shell: Any = None,
        widgets: bool = False,
    ) -> None:
        self.run = run
        self.chart = chart
        self.shell = shell
        # A widget front-end: the HTML chart becomes the bqplot chart at the first update
        # (about a second in). Shorter runs never build widgets: their final picture is HTML.
        self.widgets_wanted = widgets
        self.overview = Overview()
        self.refreshes = 0  # refreshes done (the final one included)
        self.refresh_ns = 0  # time spent refreshing, for the overhead benchmark
        self.final_done = False
        self.closed = False
        self._seen = 0
        self._overview_of: Any = run.recorder  # the recorder the overview has read
        self._loops: list[ast.For] | None = None
        self._loops_parsed = False
        self._passes: int | None = None

    def display(self) -> None:
        if self.chart is None:
            return
        from IPython.display import display as ipython_display

        display: Any = ipython_display  # untyped in IPython
        self.chart.handle = display(self.chart.show(self._text()), display_id=True)

    def _text(self) -> str:
        return f"traceml {self.run.name}: live chart (shown by notebook front-ends with widgets)"

    def _become_widgets(self) -> None:
        """Swap the HTML chart for the bqplot chart, in the same output (a display update)."""
        self.widgets_wanted = False
        html = self.chart
        if not isinstance(html, HtmlChart) or html.handle is None:
            return
        try:
            chart = WidgetChart(self.run.name)
        except ImportError:  # no bqplot: the HTML chart goes on
            return
        except Exception as exc:
            self.run.notes.append(f"The live chart stayed HTML: {type(exc).__name__}: {exc}")
            return
        chart.handle = html.handle
        self.chart = chart  # from now on released (and its widgets closed) like any chart
        chart.handle.update(chart.show(self._text()))

    # -- numbers the header needs ----------------------------------------------------------
    def _total(self) -> tuple[int | None, tuple[int, int, int] | None]:
        """Expected steps of the whole run (per pass x passes), else the position in this pass."""
        run = self.run
        per_pass = run.expected_steps
        if not per_pass:
            return None, None
        if self._passes is None and run.loop_where == "this cell":
            if not self._loops_parsed:
                self._loops = loops_around(run.cell_source, run.loop_line)
                self._loops_parsed = True
            names = getattr(self.shell, "user_ns", None) or {}
            self._passes = passes_of(self._loops, names)
        if self._passes and per_pass * self._passes >= run.n_steps:
            return per_pass * self._passes, None
        started = max(1, int(getattr(run, "_loops_started", 1)))
        in_pass = run.n_steps - (started - 1) * per_pass
        if not 0 <= in_pass <= per_pass:
            return None, None
        return None, (in_pass, per_pass, started)

    def _gpu_text(self) -> str:
        """GPU, CPU and memory for the header, read from what capture samples (never sampled
        here): the run's resource watch while it runs, what the run kept once it ended."""
        return resources_text(self.run)

    # -- the observer ----------------------------------------------------------------------
    def refresh(self, run: Run | None = None) -> None:
        if self.closed or self.final_done:
            return
        began = perf_counter_ns()
        run = self.run
        final = run.finished
        if not final:
            if self.chart is not None and not self._within_budget(began):
                return  # a refresh skipped costs nothing: the next tick tries again
            if self.widgets_wanted:
                self._become_widgets()
        if self.chart is not None:
            self._draw(final)
        self.refreshes += 1
        self.final_done = final
        self.refresh_ns += perf_counter_ns() - began

    def _within_budget(self, now_ns: int) -> bool:
        """One more update keeps the run at most MESSAGES_PER_S a second, with room kept for
        the final refresh (so the first update comes about a second into the run)."""
        origin = self.run.recorder.origin_ns or now_ns
        allowed = MESSAGES_PER_S * (now_ns - origin) / 1e9
        return self.refreshes + 1 + FINAL_MESSAGES <= allowed

    def _draw(self, final: bool) -> None:
        chart, run = self.chart, self.run
        assert chart is not None
        recorder = run.recorder
        if recorder is not self._overview_of:  # several ranks: the run now shows another rank
            self.overview, self._seen, self._overview_of = Overview(), 0, recorder
        ranks = live_ranks(run)
        new = recorder.n_steps - self._seen
        fresh = recorder.tail(max(WINDOW, min(new, OVERVIEW_READ_CAP)))  # one read a refresh
        if new > 0:
            unseen = fresh["step"] >= self._seen
            self.overview.add(
                fresh["step"][unseen],
                fresh["data_wait_ms"][unseen],
                fresh["compute_ms"][unseen],
            )
            self._seen = recorder.n_steps
        tail = {name: column[-WINDOW:] for name, column in fresh.items()}
        if not len(tail["step"]) and not final:
            return
        turn = ROTATION[self.refreshes % len(ROTATION)]
        total, pass_info = self._total()
        numbers = live_numbers(run, tail, total, pass_info)
        if ranks is not None:
            with_ranks_live(numbers, ranks)
        gpu = self._gpu_text()
        if final or turn == "header":
            chart.draw_header(header_html(numbers, gpu))
        if (final or turn == "bars") and ranks is not None:
            chart.draw_ranks(ranks)
        elif (final or turn == "bars") and len(tail["step"]) >= 2:
            # On a GPU, the steps whose events have resolved, on the GPU clock: what the host
            # waited while queued work hid it is no data wait (the report says the same).
            cols, on_gpu = clock_columns(tail, bool(run._gpu_used))
            suffix = "_gpu_ms" if on_gpu else "_ms"
            parts = window_parts(run, cols, on_gpu)
            if parts is None:
                chart.draw_window(cols["step"] + 1, cols["data_wait" + suffix], cols["compute" + suffix])
            else:
                chart.draw_window(cols["step"] + 1, cols["data_wait" + suffix], cols["compute" + suffix], parts)
        if final or turn == "overview":
            centre, wait, compute = self.overview.means()
            if len(centre) >= 2:
                chart.draw_overview(centre, wait, compute)
        if isinstance(chart, HtmlChart):
            chart.publish(header_text(numbers, gpu))

    def close(self) -> None:
        """Final refresh (if the run's own did not happen). The chart stays displayed: its
        saved state is the run's evidence."""
        if self.closed:
            return
        try:
            if not self.final_done:
                self.refresh(self.run)
        finally:
            self.closed = True
        if isinstance(self.chart, WidgetChart):
            _live_charts.append(self)
            release_charts(KEEP_LIVE_CHARTS)

    def release(self) -> None:
        """Swap a finished widget chart for its static picture and close its widgets."""
        chart, self.chart = self.chart, None
        if isinstance(chart, WidgetChart):
            chart.release(f"traceml {self.run.name}: {self.run.n_steps} steps (static picture)")


_live_charts: list[LiveView] = []  # finished views whose chart is still widgets, oldest first


def release_charts(keep: int = 0) -> int:
    """Release the charts of all but the `keep` newest finished runs (each becomes a static
    picture of its final state). Returns how many were released."""
    released = 0
    while len(_live_charts) > keep:
        view = _live_charts.pop(0)
        try:
            view.release()
        except Exception:  # a front-end gone away must not cost the cell
            pass
        released += 1
    return released


def live_widget_count() -> int:
    """Widgets alive in this kernel (ipywidgets 8: `widget._instances`; 7: `Widget.widgets`)."""
    from ipywidgets.widgets import widget

    instances = getattr(widget, "_instances", None)
    if instances is None:
        instances = widget.Widget.widgets
    return len(instances)


def start(run: Run, show: bool = True) -> LiveView | None:
    """Show the live view of `run` under the cell and register it with the run.

    A widget front-end gets the bqplot chart once the run lasts long enough for an update
    (about a second; before that, and for shorter runs, the HTML chart); a kernel without
    ipywidgets/bqplot an updating HTML display; a terminal, or `show=False` (--no-live),
    nothing on screen (the GPU is still sampled for the report). Never raises: a view that
    cannot start is a note on the run.
    """
    shell = ipython_shell()
    try:
        mode = environment.live_mode(shell) if show else "none"
        if mode == "widget":
            environment.enable_custom_widget_manager_once()
        chart = HtmlChart(run.name) if mode != "none" else None
        view = LiveView(run, chart, shell, widgets=mode == "widget")
        view.display()
    except Exception as exc:
        run.notes.append(f"The live view could not start: {type(exc).__name__}: {exc}")
        return None
    run.observe(view.refresh)
    return view

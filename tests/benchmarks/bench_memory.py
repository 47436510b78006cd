"""Memory and scale: 10^4, 10^5 and 10^6 steps of a trivial body under a run, the memory it
adds per step, and the time to build the report once the loop ends.

    .venv/bin/python tests/benchmarks/bench_memory.py [--sizes 10000 100000 1000000]

Each size runs in a fresh process (so RSS starts from the same place): once plain for time,
peak RSS and the report time, once under tracemalloc for the Python-level bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import Table, num, show, target  # noqa: E402

SIZES = [10_000, 100_000, 1_000_000]
TARGET_BYTES_PER_STEP = 64
TARGET_REPORT_S = 0.5


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def one_run(n: int, traced_memory: bool) -> dict[str, Any]:
    """In the child process: one run of `n` steps through the Python API, then its report."""
    import tracemalloc

    from traceml_jupyter.capture.session import capture_session
    from traceml_jupyter.capture.steps.recorder import HISTORY_CAP
    from traceml_jupyter.run import Run

    warm = Run("warm-up")  # imports, numpy, first-call paths: out of the measured run
    with capture_session(warm.recording):
        for _ in warm.loop(range(1000)):
            pass
    warm.finish()
    _ = warm.summary, warm.verdict, warm.text()
    render_html = report_renderer()
    if render_html is not None:
        render_html(warm)

    out: dict[str, Any] = {"n": n, "history_cap": HISTORY_CAP, "html": render_html is not None}
    out["peak_reset"] = reset_peak_rss()
    rss0, peak0 = rss_bytes(), peak_rss_bytes()  # imports psutil before tracing starts
    if traced_memory:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    run = Run("memory")
    with capture_session(run.recording):  # as trace() and %%traceml record: the hooks, then the run's wrap-up
        t0 = time.perf_counter()
        for _ in run.loop(range(n)):
            pass
        out["loop_s"] = time.perf_counter() - t0
    if traced_memory:
        cur, peak = tracemalloc.get_traced_memory()
        out["loop_peak_bytes"] = peak - base
        out["kept_bytes"] = cur - base
        tracemalloc.reset_peak()
    recorder = run.recording.recorder  # what the recording held, measured after the report
    t0 = time.perf_counter()
    run.finish()
    assert run.n_steps == n, (run.n_steps, n)  # a benchmark that recorded nothing reports nothing
    _ = run.summary, run.verdict
    text = run.text()
    t_text = time.perf_counter()
    html = render_html(run) if render_html is not None else ""
    t1 = time.perf_counter()
    out["report_s"] = t1 - t0
    out["report_text_s"] = t_text - t0
    out["report_html_s"] = t1 - t_text if render_html is not None else None
    out["report_chars"] = len(text) + len(html)
    out["recorder_bytes"] = recorder.nbytes()
    out["stride"] = recorder.stride
    out["n_steps"] = run.n_steps
    if traced_memory:
        cur, peak = tracemalloc.get_traced_memory()
        out["report_peak_bytes"] = peak - base
        out["after_report_bytes"] = cur - base
        tracemalloc.stop()
    out["rss_added_bytes"] = rss_bytes() - rss0
    out["peak_rss_added_bytes"] = max(0, peak_rss_bytes() - max(peak0, rss0))
    return out


def report_renderer() -> Any:
    """`traceml_jupyter.views.report.report_html` when the HTML report exists (another issue)."""
    try:
        from traceml_jupyter.views.report import report_html as render_html
    except ImportError:
        return None
    return render_html


def child(n: int, traced_memory: bool) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", str(n), str(int(traced_memory))],
        capture_output=True, text=True, timeout=600,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    raise RuntimeError(f"memory child failed (exit {done.returncode}): {done.stderr[-2000:]}")


def mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.2f}"


def measure(sizes: list[int] | None = None) -> list[Table]:
    sizes = sizes or SIZES
    rows = []
    results = []
    for n in sizes:
        plain = child(n, traced_memory=False)
        traced = child(n, traced_memory=True)
        results.append((n, plain, traced))
        print(f"  measured {n:,} steps", file=sys.stderr, flush=True)
    cap = results[0][1]["history_cap"]
    ok_bytes = True
    flat_limit = None
    for n, plain, traced in results:
        per_step = traced["loop_peak_bytes"] / n
        kept_per_step = traced["kept_bytes"] / n
        if n <= cap:
            ok_bytes = ok_bytes and per_step <= TARGET_BYTES_PER_STEP
        rows.append([
            f"{n:,}", mib(traced["loop_peak_bytes"]), num(per_step, 1), mib(traced["kept_bytes"]),
            num(kept_per_step, 1), mib(plain["recorder_bytes"]), str(plain["stride"]),
            mib(traced["report_peak_bytes"]), mib(plain["peak_rss_added_bytes"]),
            num(plain["loop_s"] / n * 1e6, 2), num(plain["report_s"] * 1e3, 1),
            num(plain["report_html_s"] * 1e3 if plain["report_html_s"] is not None else None, 1),
        ])
    beyond = [(n, t["kept_bytes"]) for n, _, t in results if n > cap]
    peaks = ", ".join(f"{n:,}: {mib(t['loop_peak_bytes'])}" for n, _, t in results)
    below = [(n, t) for n, _, t in results if n <= cap]
    if beyond:
        # Flat: past the cap, the kept history is the cap's worth of steps plus one raw chunk.
        from traceml_jupyter.capture.steps.recorder import CHUNK, COLUMNS, GPU_COLUMNS

        flat_limit = cap * 8 * len(COLUMNS + GPU_COLUMNS) + CHUNK * 24 * 1.25
        flat_ok = all(kept <= flat_limit for _, kept in beyond)
    else:
        flat_ok = None
    report_s = max(p["report_s"] for n, p, _ in results if n == max(sizes))
    table = Table(
        "Memory and scale: a trivial body under `Run.loop` (the hook `%%traceml` uses)",
        ["steps", "peak MiB during loop", "peak B/step", "kept MiB after loop", "kept B/step",
         "Recorder.nbytes MiB", "stride", "peak MiB incl. report", "peak RSS added MiB",
         "µs/step (loop)", "report ms", "of which HTML ms"],
        rows,
    )
    table.notes += [
        "Python allocations by tracemalloc (numpy arrays and array buffers included), relative to "
        "just before the run; peak RSS from a second, untraced run of the same size (the kernel's "
        "peak, VmHWM, reset just before the run; it moves in pages and arenas, and includes the "
        "report). Each size runs in a fresh process after a 1,000-step warm-up run.",
        "peak B/step is the transient peak: when a chunk of 65,536 raw steps is folded into the "
        "kept history, the kept columns are copied (np.concatenate) while the chunk's derived "
        "columns also exist.",
        f"Exact history is kept up to HISTORY_CAP = {cap:,} steps, then one step in `stride`.",
        "report = run.finish() + run.summary + run.verdict + run.text()"
        + (" + report.report_html(run)." if results[0][1]["html"] else "; traceml_jupyter.views.report "
           "does not exist yet, so no HTML was rendered."),
    ]
    t_rows = [
        [f"≤ {TARGET_BYTES_PER_STEP} B/step up to the cap ({cap:,} steps)",
         "; ".join(f"{n:,} steps: {t['loop_peak_bytes'] / n:,.1f} B/step at the peak, "
                   f"{t['kept_bytes'] / n:,.1f} kept" for n, t in below) or "—",
         target(ok_bytes if below else None, f"≤ {TARGET_BYTES_PER_STEP} B/step")],
        ["flat past the cap",
         (", ".join(f"{n:,}: {mib(k)} MiB kept" for n, k in beyond) + (f" (bound {mib(flat_limit)} MiB)" if flat_limit else "") or "—")
         + f"; peak MiB during the loop {peaks} (bounded, but the folds copy the kept history)",
         target(flat_ok, "kept history bounded")],
        [f"report < {TARGET_REPORT_S:g} s at {max(sizes):,} steps", f"{report_s * 1e3:,.0f} ms",
         target(report_s < TARGET_REPORT_S, f"< {TARGET_REPORT_S * 1e3:g} ms")],
    ]
    return [table, Table("Memory targets", ["target", "measured", "result"], t_rows)]


def main(argv: list[str] | None = None) -> list[Table]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print("RESULT " + json.dumps(one_run(int(argv[1]), bool(int(argv[2])))), flush=True)
        return []
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    args = parser.parse_args(argv)
    tables = measure(args.sizes)
    show(tables)
    return tables


if __name__ == "__main__":
    main()

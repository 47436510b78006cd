"""The report's evidence table: the medians behind the verdict, GPU utilisation, the copies to
the GPU and the synchronising calls the run measured, line by line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..analysis.checklist import per_step_bytes
from ..analysis.number_text import ms_fine
from ..analysis.number_text import pct as fmt_pct
from ..analysis.verdict import sync_sentence
from .report_style import CELL, MUTED, ROW, TABLE, compute_name, esc, fmt_rate, with_code

if TYPE_CHECKING:
    from ..kernel.code_facts import CodeContext
    from ..result import RunResult


def _gpu_column(samples: Any, name: str) -> list[float]:
    """The finite values of one column of the run's NVML samples (Gpu.samples)."""
    if not isinstance(samples, Mapping) or samples.get(name) is None:
        return []
    values = [float(v) for v in samples[name]]
    return [v for v in values if v == v]


def gpu_utilisation(result: RunResult) -> str:
    """'median 87 %, max 99 %, memory up to 10.2 GiB (40 samples)', or why there is none."""
    samples = result.gpu.samples
    values = sorted(_gpu_column(samples, "gpu_util_pct"))
    if values:
        text = f"median {values[len(values) // 2]:.0f} %, max {values[-1]:.0f} %"
        memory = _gpu_column(samples, "gpu_mem_used_mib")
        if memory:
            text += f", memory up to {max(memory) / 1024:.1f} GiB"
        return text + f" ({len(values)} samples, NVML)"
    memory = _gpu_column(samples, "gpu_mem_used_mib")
    if memory:  # NVML gave memory but no utilisation (a MIG slice, an unsupported device)
        return f"n/a (NVML reports no utilisation here), memory up to {max(memory) / 1024:.1f} GiB"
    note = result.gpu.note
    if note:  # the sampler's notes read "GPU n/a (no NVML)": the row says "GPU" already
        note = str(note).removeprefix("GPU ").strip()
        return note if note.startswith("n/a") else f"n/a ({note})"
    used = result.gpu.used
    return "n/a (not sampled)" if used else "n/a (no GPU used)"


def _yes_no(part: int, whole: int) -> str:
    if part >= whole:
        return "yes"
    return "no" if part == 0 else f"{part} of {whole} copies"


def _where(code: CodeContext, row: Mapping[str, Any]) -> str:
    if row.get("in_cell"):
        return f"line {row['line']}"
    return f"{code.label(str(row['filename']))}, line {row['line']}"


COPIES_MEDIAN = "H2D copies (median per step)"  # the label the H2D-BOUND verdict uses too


def copy_rows(result: RunResult, code: CodeContext) -> list[tuple[str, str]]:
    """Evidence of the copies to the GPU (result.gpu.h2d): the median per step, then each copying
    line (where `code` says it is) with bytes per step, bandwidth, pinned or not and
    non_blocking or not."""
    h2d = result.gpu.h2d
    sites = (h2d.get("sites") or []) if h2d else []
    if not sites:
        return []
    s = result.summary
    rows = []
    if s.get("h2d_ms") is not None:
        share = fmt_pct(s.get("h2d_share"))
        rows.append((COPIES_MEDIAN, f"{ms_fine(s['h2d_ms'])}, {share} of the step"))
    for site in sites[:4]:
        copies = int(site["copies"])
        rate = f" at {site['gb_per_s']:.1f} GB/s" if site.get("gb_per_s") else ""
        took = f" in {ms_fine(site['ms_per_step'])}" if site.get("ms_per_step") is not None else ""
        rows.append(
            (
                f"Copy, {_where(code, site)}",
                f"{per_step_bytes(float(site['bytes_per_step']))}/step{took}{rate}; "
                f"pinned: {_yes_no(int(site['pinned']), copies)}; "
                f"non_blocking: {_yes_no(int(site['non_blocking']), copies)}",
            )
        )
    return rows


def sync_rows(result: RunResult, code: CodeContext) -> list[tuple[str, str]]:
    """Evidence of the synchronising calls (result.gpu.sync_stalls): the sentence for the costliest
    line of the cell, then the other syncing lines (where `code` says they are)."""
    stalls = result.gpu.sync_stalls
    sites = (stalls or {}).get("sites") or []
    if not sites:
        return []
    rows = []
    top = result.summary.get("sync_top")
    sentence = sync_sentence(top)
    if sentence:
        rows.append(("Sync stall", sentence))
    for site in sites[:4]:
        if sentence and top and site["line"] == top.get("line") and site.get("in_cell"):
            continue
        call = f"`{site['call']}`" if site.get("call") else ", ".join(site.get("kinds") or [])
        wait = site.get("wait_ms_per_step")
        waited = " (wait not timed)"
        if wait is not None:
            waited = f", host waits {ms_fine(wait)} per step"
        per = float(site["calls_per_step"])
        rows.append((f"Syncs, {_where(code, site)}", f"{call or 'sync'} {per:.2g} per step{waited}"))
    return rows


def evidence_rows(result: RunResult, code: CodeContext) -> list[tuple[str, str]]:
    """Label and value rows under the timing table: the run's, the verdict's own extra evidence,
    then the copies to the GPU and the syncs measured on the way (rows not already shown)."""
    s = result.summary
    steps = f"{s.get('n_analysed', 0)} of {s.get('n_steps', 0)} ({s.get('warmup_steps', 0)} warm-up)"
    clock = "GPU (CUDA events)" if s.get("clock") == "gpu" else "CPU (wall clock, perf_counter)"
    samples = fmt_rate(s.get("samples_per_s"), "samples/s")
    if s.get("batch_size"):
        samples += f" (batch {s['batch_size']})"
    compute = compute_name(s)
    rows = [
        ("Data wait share (median)", fmt_pct(s.get("data_wait_share"))),
        (f"{compute} share (median)", fmt_pct(s.get("compute_share"))),
        ("Analysed steps", steps),
        ("Clock", clock),
        ("Throughput", f"{fmt_rate(s.get('steps_per_s'), 'steps/s')}, {samples}"),
        ("GPU utilisation", gpu_utilisation(result)),
    ]
    shown = {
        "Data wait (median)",
        f"{compute} (median)",
        "Step time (median)",
        "Data wait share",
        "Analysed steps",
        "Clock",
    }
    watched = copy_rows(result, code) + sync_rows(result, code)
    if any(k.startswith("Copy, ") for k, _ in watched):
        shown.add("Copy lines")  # each copying line has its own row
    rows += [(k, v) for k, v in result.verdict.evidence if k not in shown]
    labels = {k for k, _ in rows}
    return rows + [(k, v) for k, v in watched if k not in labels]


def evidence_table(result: RunResult, code: CodeContext) -> str:
    """The medians, p90 and max of data wait, compute and step time, then the evidence rows
    (evidence_rows), as two HTML tables."""
    s = result.summary
    stats = s.get("stats") or {}
    left = CELL + ";text-align:left"
    num = CELL + ";text-align:right;white-space:nowrap"
    head = "".join(
        f'<th style="{num};color:{MUTED};font-weight:600">{h}</th>' for h in ("median", "p90", "max")
    )
    rows = [f'<tr style="{ROW}"><th style="{left}"></th>{head}</tr>']
    for key, label in (
        ("data_wait_ms", "Data wait"),
        ("compute_ms", compute_name(s)),
        ("step_ms", "Step time"),
    ):
        st = stats.get(key)
        values = "".join(
            f'<td style="{num}">{ms_fine(st[q] if st else None)}</td>' for q in ("median", "p90", "max")
        )
        rows.append(f'<tr style="{ROW}"><td style="{left}">{esc(label)}</td>{values}</tr>')
    table = f'<table class="tml-evidence" style="{TABLE}">{"".join(rows)}</table>'
    kv = "".join(
        f'<tr style="{ROW}"><td style="{left};color:{MUTED};width:45%">{esc(k)}</td>'
        f'<td style="{left}">{with_code(v)}</td></tr>'
        for k, v in evidence_rows(result, code)
    )
    more = f'<table class="tml-facts" style="{TABLE};margin-top:8px">{kv}</table>'
    return table + more

"""The report's "Inside the DataLoader" part (views/report_loader.py) and the text box, on
results made from values (tests/result_factory.py): a worker that died is shown first, as a
critical finding with its fix, also when it died before it made a batch."""

from __future__ import annotations

from result_factory import result_of

from traceml_jupyter.analysis.loader_inside import summarise
from traceml_jupyter.result.render import text
from traceml_jupyter.views.report_loader import loader_inside_html
from traceml_jupyter.views.report_style import SEVERITY

MS = 1_000_000


def batch(pid: int, worker: int, k: int) -> tuple[int, ...]:
    start = 10 * k * MS
    return (0, pid, worker, 0, k, 2 * k + worker, start, start + 8 * MS, start + 9 * MS, 8 * MS, 8, 64, *[-1, 0] * 4)


def began(pid: int, worker: int, k: int, first: int) -> tuple[int, ...]:
    return (1, pid, worker, 0, k, 2 * k + worker, 0, 8, 1, *range(first, first + 8), -1, -1, -1)


def test_a_worker_killed_by_the_oom_killer_leads_the_part_in_red_and_the_text_box() -> None:
    records = [batch(100, 0, 0), batch(101, 1, 0), began(101, 1, 1, 24)]
    inside = summarise(records, [], 0, [], [], [(1, 101, -9)])
    result = result_of("oom", [1.0] * 4, [2.0] * 4, loader_inside=inside, error="RuntimeError: DataLoader worker (pid(s) 101) exited unexpectedly")
    html = loader_inside_html(result)
    died = html[html.index('class="tml-inside-stopped"'):]
    assert SEVERITY["critical"][0] in died[:300] and ">WORKER DIED<" in died
    assert "DataLoader worker 1 (pid 101) died (killed by signal 9, SIGKILL: out of memory?) while loading samples 24-31, after 1 batch" in died
    assert html.index("tml-inside-stopped") < html.index("tml-inside-workers")  # first, then the workers' table
    lines = text(result).splitlines()
    also = [i for i, line in enumerate(lines) if line.startswith("Also: inside the loader, WORKER DIED: DataLoader worker 1 (pid 101)")]
    stopped = [i for i, line in enumerate(lines) if line.startswith("Stopped by: RuntimeError")]
    assert also and stopped and also[0] < stopped[0]


def test_a_worker_that_died_before_any_batch_still_gets_the_part() -> None:
    inside = summarise([began(100, 0, 0, 0)], [], 0, [], [], [(0, 100, -11)])
    html = loader_inside_html(result_of("crash", [1.0] * 3, [2.0] * 3, loader_inside=inside))
    assert "crashed (signal 11, SIGSEGV) while loading samples 0-7, after 0 batches" in html
    assert "tml-inside-workers" not in html and "tml-inside-lanes" not in html  # (no batch: no table, no lanes)
    assert loader_inside_html(result_of("none", [1.0] * 3, [2.0] * 3)) == ""

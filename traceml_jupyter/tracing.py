"""`trace()`: the same capture, analysis and report as `%%traceml`, for scripts, library code
and `torchrun` ranks, where no cell is rewritten."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from . import ranks
from .history import keep_in_history
from .kernel.code_facts import read_kernel_at_end
from .ranks import gather, shows_report
from .run import Run
from .views.display import register_views, show_report


@contextmanager
def trace(name: str | None = None, warmup: int | None = None, show: bool = True) -> Iterator[Run]:
    """Time training outside the magic (scripts, library code, `torchrun`)::

        with traceml_jupyter.trace("baseline") as run:
            for x, y in run.loop(loader):
                ...
        print(run.verdict)

    Inside the block every DataLoader fetch, `backward()` and optimizer step is seen (steps are
    what the training does, as in `%%traceml`); `run.loop(it)` marks the loop whose iterations
    are steps when the training has neither. At the end the report is shown (printed outside
    IPython), also after an error. On one rank of several (`torchrun`, a process group set up),
    the ranks' summaries are gathered at the end: `run.result.ranks` on every rank, `run.straggler`,
    and rank 0 alone prints the report, with the per-rank table.
    """
    register_views()  # run.save("x.html")
    run = Run(name, warmup)
    error: BaseException | None = None
    try:
        with ranks.followed(run.recording):  # the capture, across processes
            yield run
    except BaseException as exc:
        error = exc
        raise
    finally:
        gather(run.recording, error)  # torchrun: every rank's summary on every rank (no-op otherwise)
        run.finish(error)
        if show and shows_report(run):
            show_report(run)  # with the checklist, kept on the run
        else:
            read_kernel_at_end(run)
        if shows_report(run):  # one process of several saves the run
            keep_in_history(run)  # into TRACEML_HISTORY when set (never raises)

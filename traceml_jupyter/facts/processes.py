"""The processes a traced cell started (processes/children.py): the result's `processes`."""

from __future__ import annotations

from typing import TypedDict


class ProcessRow(TypedDict):
    """A process the cell started, as `run.processes` keeps it (docs/api.md): its pid, command
    line, rank (None: not one of a job), the steps it sent, how it ended (finished, failed,
    stopped: closed without an end, not traced, running), its exit status and error, and why it
    was not traced."""

    pid: int | None
    command: str
    rank: int | None
    n_steps: int
    status: str
    exit_status: int | None
    error: str | None
    note: str | None

"""The command line: `traceml-jupyter run [--name N] [--save PATH] -- python train.py ARGS`.

The command runs as it would without us (same arguments, stdin/stdout/stderr, working directory,
environment plus the channel's variables); every Python process it starts that trains is
traced as a cell's children are (children.py): `python train.py`, `torchrun --nproc_per_node 2
train.py` (each rank, and the per-rank table), a shell script that runs Python. When it ends, the
report is printed as the text box, `--save` writes the run, and the command's exit status is ours.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .failures import failure_text

if TYPE_CHECKING:
    from .run import Run

USAGE = "traceml-jupyter run [--name NAME] [--warmup N] [--loop FILE:LINE] [--save PATH] -- COMMAND [ARGS...]"


def save(run: Run, path: str) -> None:
    """Save the run to `path` (.json, or a standalone .html report)."""
    from .views.display import register_views

    register_views()  # Run.save writes .html through the report page
    run.save(path)


# --save PATH: the file extensions written (JSON, what load() reads back; the report as a page).
WRITERS: dict[str, Callable[[Run, str], None]] = {".json": save, ".html": save}


def parser() -> argparse.ArgumentParser:
    """The command line's parser: `traceml-jupyter run [options] -- COMMAND ...`."""
    top = argparse.ArgumentParser(
        prog="traceml-jupyter",
        description="Time every training step of a command's Python processes: data wait vs compute, and a verdict.",
    )
    commands = top.add_subparsers(dest="what", required=True, metavar="run")
    run = commands.add_parser(
        "run",
        usage=USAGE,
        help="run a command and trace the Python processes it starts that train",
        description=(
            "Run COMMAND (python train.py, torchrun --nproc_per_node 2 train.py, a shell script) as "
            "it would run without traceml; print the report of its training when it ends. The "
            "exit status is COMMAND's."
        ),
        epilog="example: traceml-jupyter run --name baseline -- python train.py --epochs 3",
    )
    run.add_argument("--name", default=None, help="label of the run (default: the command)")
    run.add_argument("--warmup", type=int, default=None, metavar="N", help="steps kept out of the verdict (default: a few)")
    run.add_argument(
        "--loop",
        default=None,
        metavar="FILE:LINE",
        help="the loop whose iterations are steps, where the training has no optimizer step or backward()",
    )
    run.add_argument(
        "--save",
        default=None,
        metavar="PATH",
        help="write the run to PATH (" + ", ".join(sorted(WRITERS)) + ")",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    return top


def _command(args: argparse.Namespace, top: argparse.ArgumentParser) -> list[str]:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        top.error(f"no command to run: {USAGE}")
    if args.warmup is not None and args.warmup < 0:
        top.error("--warmup must be 0 or more")
    if args.loop is not None:
        from .processes.children import script_loop

        try:
            if script_loop(args.loop) is None:
                top.error(f"--loop {args.loop}: give FILE:LINE (--loop train.py:57)")
        except ValueError as exc:
            top.error(str(exc))
    if args.save is not None and os.path.splitext(args.save)[1].lower() not in WRITERS:
        top.error(f"--save {args.save}: the file name must end in " + " or ".join(sorted(WRITERS)))
    return command


def exit_code(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_command(
    command: Sequence[str], name: str | None = None, warmup: int | None = None, loop: str | None = None
) -> tuple[int, Run]:
    """Run `command` with the channel in its environment; its status and the run."""
    from .processes import children
    from .processes.startup_hook import command_line
    from .run import Run

    run = Run(name or command_line(command), warmup)
    channel = children.Channel(loop=children.script_loop(loop))
    recording = run.recording
    collector = children.ChildCollector(recording, channel)
    recording.rank_collector = collector
    returncode = 127
    error: BaseException | None = None
    try:
        collector.start()
        env = {**os.environ, **channel.env(os.environ)}
        try:
            process = subprocess.Popen(list(command), env=env)
        except OSError as exc:
            print(f"traceml-jupyter: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127, run
        try:
            returncode = process.wait()
        except KeyboardInterrupt as exc:  # Ctrl-C reached the command too: let it end as it does
            error = exc
            try:
                returncode = process.wait()
            except KeyboardInterrupt:
                process.kill()
                returncode = process.wait()
    finally:
        collector.adopt_into(recording, 0.0 if error is not None else _drain_s())
        channel.close()
    if returncode != 0 and recording.error is None:
        recording.error = f"`{command_line(command)}` exited with status {exit_code(returncode)}"
    run.finish(error)
    return exit_code(returncode), run


def _drain_s() -> float:
    from .ranks import collector

    return collector.DRAIN_S


def report(run: Run, command: Sequence[str]) -> None:
    """The text box (and the checklist's fixes) on stdout, or one line when nothing trained."""
    from .processes import children
    from .processes.startup_hook import command_line
    from .views.display import show_report

    if run.n_steps == 0:
        line = children.no_training_line(run.result, [command_line(command)], "the command")
        print(line or "traceml: no step ran.", flush=True)
        return
    show_report(run)  # the text box; the checklist is kept on the run
    for line in checklist_lines(run.result.reading.checklist or []):
        print(line)
    sys.stdout.flush()


def checklist_lines(items: Sequence[Mapping[str, Any]]) -> list[str]:
    """The checklist's items to act on, one line each: what was seen, where, what to try."""
    lines = []
    for item in items:
        if item.get("status") not in ("fix", "check") or not item.get("bears_on_verdict"):
            continue
        where = f" ({item['where']})" if item.get("where") else ""
        to_try = f": try {item['to_try']}" if item.get("to_try") else ""
        lines.append(f"Checklist: {item['status']} {item['title']} - {item['seen']}{where}{to_try}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """`traceml-jupyter run -- python train.py`: run the command with its processes traced, print
    the report, save it if asked; the command's own exit status is returned."""
    top = parser()
    args = top.parse_args(argv)
    command = _command(args, top)
    if hasattr(signal, "SIGINT"):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    status, run = run_command(command, args.name, args.warmup, args.loop)
    try:
        report(run, command)
    except Exception as exc:  # the command's status is what matters to a script
        print(f"traceml-jupyter: could not build the report: {failure_text(exc)}", file=sys.stderr)
    if args.save:
        try:
            WRITERS[os.path.splitext(args.save)[1].lower()](run, args.save)
            print(f"traceml: saved {run.name} to {args.save}")
        except Exception as exc:
            print(f"traceml-jupyter: could not save to {args.save}: {failure_text(exc)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Run the demo notebook headless in a real Jupyter kernel, print the verdict box of every run
and the comparison, and write an HTML copy of the executed notebook to open in a browser.

    python scripts/run_demo.py
    python scripts/run_demo.py --notebook notebooks/loops_in_functions.ipynb --out artifacts
    python scripts/run_demo.py --one-thread   # a busy 2-core machine: steadier timings
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "notebooks" / "dataloader_bottleneck.ipynb"
KERNEL = "python3"

HEAD = re.compile(r"^traceml: (?P<name>.+?) - (?P<steps>\d+) steps?\b")
LABEL = re.compile(r"Step Time: (?P<label>[A-Z][A-Z0-9 /-]*[A-Z])")


@dataclass(frozen=True)
class Report:
    """One run's report as the notebook shows it in plain text."""

    name: str
    steps: int
    label: str
    box: str  # the bordered verdict box
    text: str  # the whole text/plain report


def ensure_kernel(name: str = KERNEL) -> None:
    """Install this Python's kernelspec under `name` when Jupyter does not know one."""
    from jupyter_client.kernelspec import KernelSpecManager

    if name not in KernelSpecManager().find_kernel_specs():
        cmd = [sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def execute(
    path: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> tuple[Any, float, BaseException | None]:
    """Run every cell of the notebook at `path` (its folder as the working directory), in a
    kernel with `env` as its environment (default: this one). Returns the executed notebook,
    the seconds it took, and the error that stopped it."""
    import nbformat
    from nbclient import NotebookClient

    ensure_kernel()
    nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(path.parent)}}
    )
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        # stderr: the kernel's own log (the cells' stderr is in the notebook)
        client.execute(stderr=subprocess.DEVNULL, **({"env": env} if env is not None else {}))
    except Exception as exc:  # CellExecutionError, a timeout, a dead kernel
        error = exc
    return nb, time.perf_counter() - start, error


def plain_outputs(nb: Any) -> list[str]:
    """The text/plain of every display and result, and every stream, in notebook order."""
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream":
                texts.append(str(out.get("text", "")))
            elif "text/plain" in out.get("data", {}):
                texts.append(str(out["data"]["text/plain"]))
    return texts


def reports(nb: Any) -> list[Report]:
    """The final report of each traced run, in notebook order."""
    found = []
    for text in plain_outputs(nb):
        head, label = HEAD.match(text), LABEL.search(text)
        if head and label:
            box = [line for line in text.splitlines() if line.startswith(("+", "|"))]
            found.append(
                Report(head["name"], int(head["steps"]), label["label"], "\n".join(box), text)
            )
    return found


def comparisons(nb: Any) -> list[str]:
    """The text of each `%traceml compare` output."""
    return [text for text in plain_outputs(nb) if text.startswith("traceml compare:")]


def errors(nb: Any) -> list[str]:
    return [
        f"{out.get('ename')}: {out.get('evalue')}"
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]


def write_html(nb: Any, path: Path) -> Path:
    """The executed notebook as one HTML file (nbconvert's lab template)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)  # type: ignore[no-untyped-call]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=DEMO, help="the notebook to run")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts", help="folder for the HTML")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run")
    parser.add_argument(
        "--one-thread",
        action="store_true",
        help="torch in the kernel uses one thread (OMP_NUM_THREADS=1): steadier timings on a "
        "busy 2-core machine, where other processes can slow two-thread steps up to 10x",
    )
    args = parser.parse_args(argv)

    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.one_thread else None
    print(f"Running {args.notebook} in a {KERNEL} kernel ...", flush=True)
    nb, seconds, error = execute(args.notebook.resolve(), args.timeout, env)
    print(
        "\nEach run's verdict: per step, the mean time the loop waited for its batch (data wait),\n"
        "spent in the loop body (compute), and both together (step time): they add up, and\n"
        "steps x step time is the loop's time. The lines under them: the warm-up steps the\n"
        "verdict leaves out (their time of the whole loop's), and the steps' shape where a mean\n"
        "alone would mislead."
    )
    from traceml_jupyter.demo import STORY

    for report in reports(nb):
        story = STORY.get(report.name)
        print(f"\n{report.name} ({report.steps} steps){': ' + story if story else ''}\n{report.box}")
    for text in comparisons(nb):
        print(f"\n{text}")
    html = write_html(nb, args.out / (args.notebook.stem + ".html"))
    print(f"\nExecuted in {seconds:.0f} s. HTML copy: {html}")
    if error is not None:
        for line in errors(nb) or [f"{type(error).__name__}: {error}"]:
            print(f"The notebook stopped: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

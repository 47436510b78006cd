"""The package as others get it: what the wheel and the sdist hold, and the wheel at work.

    python scripts/check_wheel.py contents DIST   # the files in DIST/*.whl and DIST/*.tar.gz
    cd "$(mktemp -d)" && VENV/bin/python /path/to/scripts/check_wheel.py smoke

`contents` (any Python) checks the wheel holds every module of the source tree (every
subpackage: capture/, analysis/, views/, processes/ with the children's start-up hook),
`py.typed`, the LICENSE, the command line's entry point and the source's `__version__`, and no
tests; and that the sdist holds what builds that wheel. `smoke` (the Python of a venv the wheel
was installed into, run from a directory outside the checkout so the source tree cannot shadow
the wheel) loads the extension in a real IPython shell, traces one cell, and traces a child
through the installed `traceml-jupyter` command. Exit status 1 and one line per failure.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "traceml_jupyter"


def source_version() -> str:
    """`__version__` as traceml_jupyter/__init__.py assigns it (the one place it is written)."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise SystemExit(f"no __version__ in {PACKAGE}/__init__.py")


def package_files() -> set[str]:
    """The files a wheel must carry: every module of the package, and py.typed."""
    found = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")
    }
    assert f"{PACKAGE}/py.typed" in found, "py.typed is missing from the source tree"
    return found


def check_contents(dist: Path) -> list[str]:
    version = source_version()
    wheels = sorted(dist.glob(f"{PACKAGE}-{version}-*.whl"))
    sdists = sorted(dist.glob(f"{PACKAGE}-{version}.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"expected one wheel and one sdist of version {version} in {dist}, found "
                f"{[p.name for p in dist.iterdir()]}"]
    failures: list[str] = []
    wanted = package_files()
    license_text = (ROOT / "LICENSE").read_bytes()
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        info = f"{PACKAGE}-{version}.dist-info"
        failures += [f"wheel lacks {name}" for name in sorted(wanted - names)]
        failures += [f"wheel holds a test file {n}" for n in sorted(names) if n.startswith("tests/")]
        if f"{info}/licenses/LICENSE" not in names:
            failures.append(f"wheel lacks {info}/licenses/LICENSE")
        elif wheel.read(f"{info}/licenses/LICENSE") != license_text:
            failures.append("the wheel's LICENSE differs from the checkout's")
        metadata = wheel.read(f"{info}/METADATA").decode()
        if f"\nVersion: {version}\n" not in metadata:
            failures.append(f"the wheel's METADATA does not say Version: {version}")
        if "License-Expression: Apache-2.0" not in metadata:
            failures.append("the wheel's METADATA has no License-Expression: Apache-2.0")
        if "traceml-jupyter = traceml_jupyter.cli:main" not in wheel.read(f"{info}/entry_points.txt").decode():
            failures.append("the wheel has no traceml-jupyter command")
    top = f"{PACKAGE}-{version}"
    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.removeprefix(top + "/") for m in sdist.getmembers()}
    for name in sorted(wanted | {"LICENSE", "README.md", "pyproject.toml"}):
        if name not in members:
            failures.append(f"sdist lacks {name}")
    return failures


CELL = """\
%%traceml --name smoke
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 48
    def __getitem__(self, i):
        time.sleep(0.02)  # 80 ms a batch of 4: INPUT-BOUND even on a loaded machine
        return torch.ones(8), 0

model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(Slow(), batch_size=4):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""

CHILD = CELL.split("\n", 1)[1]  # the same loop as a script, without the magic line


def _verdict_lines(report: str) -> str:
    """The report's first line (the run, its steps) and its verdict line, or what was shown."""
    lines = report.strip().splitlines()
    verdict = [line.strip("| ") for line in lines if "Step Time:" in line]
    return "\n".join(lines[:1] + verdict) if lines else "(no report)"


def smoke() -> list[str]:
    import importlib.metadata
    import sysconfig

    failures: list[str] = []
    import traceml_jupyter

    where = Path(traceml_jupyter.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if site not in where.parents:
        return [f"traceml_jupyter was imported from {where}, not from the venv's {site}"]
    installed = importlib.metadata.version("traceml-jupyter")
    if traceml_jupyter.__version__ != installed:
        failures.append(f"__version__ {traceml_jupyter.__version__} != installed {installed}")
    if not (where.parent / "py.typed").is_file():
        failures.append("py.typed is not installed")

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):  # the text box: its first line is printed below
        for cell in ("%load_ext traceml_jupyter", CELL):
            result = shell.run_cell(cell)
            if not result.success:
                return failures + [f"cell failed: {result.error_before_exec or result.error_in_exec!r}"]
    print(_verdict_lines(shown.getvalue()))
    run = traceml_jupyter.last()
    if run is None or run.name != "smoke" or len(run.steps["step_ms"]) != 12:
        failures.append(f"the traced cell gave {run!r}, not 12 steps of run 'smoke'")
    elif run.verdict != "INPUT-BOUND":
        failures.append(f"a loader that sleeps 80 ms a batch gave {run.verdict}, not INPUT-BOUND")

    # A child through the installed command: the entry point and the children's start-up hook.
    command = Path(sys.executable).parent / "traceml-jupyter"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(CHILD, encoding="utf-8")
        child = subprocess.run(
            [str(command), "run", "--name", "child", "--", sys.executable, str(script)],
            capture_output=True, text=True, timeout=120, cwd=tmp,
        )
    if child.returncode != 0 or "child - 12 steps" not in child.stdout or "Step Time:" not in child.stdout:
        failures.append(f"traceml-jupyter run exited {child.returncode}: {child.stdout[-600:]}{child.stderr[-600:]}")
    else:
        print(_verdict_lines(child.stdout))
    return failures


def main() -> int:
    if sys.argv[1:2] == ["contents"] and len(sys.argv) == 3:
        failures = check_contents(Path(sys.argv[2]))
    elif sys.argv[1:] == ["smoke"]:
        if Path.cwd().resolve() == ROOT or ROOT in Path.cwd().resolve().parents:
            failures = [f"run smoke from outside the checkout, not {os.getcwd()}"]
        else:
            failures = smoke()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for failure in failures:
        print(f"check_wheel {sys.argv[1]}: {failure}", file=sys.stderr)
    if not failures:
        print(f"check_wheel {sys.argv[1]}: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

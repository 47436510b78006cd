"""A long session stays fast and light: each earlier cell is read once per kernel, quoted run
names work, old live charts become static pictures and give their widgets back, clear()."""

from __future__ import annotations

import ast
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import traceml_jupyter
from traceml_jupyter.analysis.cell_code import (
    assigned_line,
    dataloader_lines,
    dataloader_sites,
    parse_cell,
    sample_code_in,
)
from traceml_jupyter.kernel import cells
from traceml_jupyter.views import environment, live

SETUP = """\
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.full((2,), float(i)), torch.tensor([float(i * i)])

loader = DataLoader(Squares(), batch_size=4)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)"""
TRAIN = """\
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()"""
OTHER_LOADER = "other = DataLoader(list(range(8)), batch_size=2)  # not the loop's"
NO_LOADER = "squares = [i * i for i in range(10)]"
WITH_MAGIC = "%time total = sum(range(10))"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How many times the report parsed each cell's text (nothing read before the test)."""
    cells.forget_cells()
    counts: Counter[str] = Counter()
    real = cells.read_cell

    def counting(text: str, transform: Any = None) -> ast.Module | None:
        counts[text] += 1
        return real(text, transform)

    monkeypatch.setattr(cells, "read_cell", counting)
    yield counts
    cells.forget_cells()


def run(ip: Any, cell: str) -> tuple[int, Any, str]:
    """Run a cell as the notebook does: its In [n], its result, the report's HTML (or "")."""
    number = len(ip.history_manager.input_hist_raw)
    with capture_output() as cap:
        result = ip.run_cell(cell, store_history=True)
    html = [o.data["text/html"] for o in cap.outputs if "traceml-report" in o.data.get("text/html", "")]
    return number, result, html[-1] if html else ""


# -- item 6: each earlier cell is read at most once per kernel ---------------------------------


@pytest.mark.slow
def test_each_earlier_cell_is_read_at_most_once_however_many_cells_are_traced(
    ip: Any, reads: Counter[str]
) -> None:
    setup, _, _ = run(ip, SETUP)
    for cell in (OTHER_LOADER, NO_LOADER, WITH_MAGIC):
        assert run(ip, cell)[1].error_in_exec is None
    for _ in range(3):
        _, result, html = run(ip, "%%traceml --no-live\n" + TRAIN)
        assert result.error_in_exec is None
        assert f"DataLoader in In [{setup}], line 10" in html  # found every time
    earlier = [SETUP, OTHER_LOADER, NO_LOADER, WITH_MAGIC]
    assert all(reads[cell] <= 1 for cell in earlier), reads
    assert reads[SETUP] == 1 and reads[OTHER_LOADER] == 1
    assert reads[NO_LOADER] == 0 and reads[WITH_MAGIC] == 0  # ruled out on their text
    assert max(reads.values()) == 1  # no cell of the session was read twice


@pytest.mark.slow
def test_a_report_reads_new_cells_for_at_most_its_budget_and_the_next_one_goes_on(
    ip: Any, reads: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup, _, _ = run(ip, SETUP)
    monkeypatch.setattr(cells, "SEARCH_BUDGET_S", 0.0)  # no time at all to read new cells
    _, result, html = run(ip, "%%traceml --no-live\n" + TRAIN)
    assert result.error_in_exec is None and "Step Time:" in html  # the report still shows
    assert reads[SETUP] == 0 and "DataLoader in In [" not in html
    monkeypatch.setattr(cells, "SEARCH_BUDGET_S", 0.02)
    _, _, html = run(ip, "%%traceml --no-live\n" + TRAIN)
    assert reads[SETUP] == 1 and f"DataLoader in In [{setup}]" in html


@pytest.mark.slow
def test_a_loop_in_a_function_of_an_earlier_cell_is_read_once(
    ip: Any, reads: Counter[str]
) -> None:
    run(ip, SETUP)
    train = "def train(loader):\n" + "\n".join("    " + line for line in TRAIN.splitlines())
    defined, _, _ = run(ip, train)
    for _ in range(3):
        _, result, html = run(ip, "%%traceml --no-live\ntrain(loader)")
        assert result.error_in_exec is None
        assert f"step loop in In [{defined}], line 2" in html
    assert reads[train] == 1


def test_a_cells_facts_are_what_the_checklist_reads_off_its_tree() -> None:
    cell = """\
import torch.utils.data as data
from torch.utils.data import DataLoader
train_loader = DataLoader(ds, batch_size=8,
                          num_workers=2)
val_loader: object = data.DataLoader(ds)
loaders = [DataLoader(ds) for _ in range(2)]; n = 3
n += 1
if (size := 4) > 3:
    pass
class Data(Dataset):
    def __getitem__(self, i):
        return decode(read_file(i))
def train():
    for batch in train_loader:
        pass
"""
    tree = parse_cell(cell)
    assert tree is not None
    facts = cells.cell_facts(tree, "In [7]")
    assert list(facts.loader_sites) == dataloader_sites(tree)
    assert list(facts.loader_lines) == dataloader_lines(tree)
    for name in ("train_loader", "val_loader", "loaders", "n", "size", "data", "missing"):
        seen = facts.first_assigned.get(name)
        assert seen == assigned_line(tree, {name}), name
    assert facts.samples == {"Data": sample_code_in(tree, "Data", "In [7]")}
    assert facts.loop_functions == {"train"}


# -- item 7: quoted names -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("quoted", ['"my run"', "'my run'"])
def test_a_quoted_name_with_spaces_names_the_run_and_compare_finds_it(
    ip: Any, quoted: str
) -> None:
    run(ip, SETUP)
    _, result, html = run(ip, f"%%traceml --no-live --name {quoted}\n{TRAIN}")
    assert result.error_in_exec is None
    last = traceml_jupyter.last()
    assert last is not None and last.name == "my run"
    assert ">my run &middot;" in html  # the report's header names it without quotes
    run(ip, f"%%traceml --no-live --name fast\n{TRAIN}")
    with capture_output():
        comparison = ip.run_line_magic("traceml", f"compare {quoted} fast")
    assert (comparison.name_a, comparison.name_b) == ("my run", "fast")


def test_an_unclosed_quote_is_a_one_line_usage_error_and_the_cell_does_not_run(ip: Any) -> None:
    ip.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match="No closing quotation"):
        ip.run_cell_magic("traceml", '--name "my run', "ran = True\n" + TRAIN)
    assert "ran" not in ip.user_ns


@pytest.mark.slow
def test_a_save_path_keeps_its_backslashes(ip: Any, tmp_path: Any) -> None:
    from traceml_jupyter.magic import split_line

    assert split_line(r'--save C:\runs\a.json --name "a b"') == [
        "--save",
        r"C:\runs\a.json",
        "--name",
        "a b",
    ]
    path = tmp_path / "with space.json"
    run(ip, SETUP)
    _, result, _ = run(ip, f'%%traceml --no-live --save "{path}"\n{TRAIN}')
    assert result.error_in_exec is None and json.loads(path.read_text())["name"]


# -- item 8: widgets do not pile up -------------------------------------------------------------

# 0.3 s with the chart's first update after 0.1 s (the throttle scaled 10x for the test)
LONG = "import time\n" + TRAIN.replace("    opt.step()", "    opt.step()\n    time.sleep(0.075)")


@pytest.fixture
def widget_front_end(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test shell draws widgets; the chart's first update comes after 0.1 s, not 1 s."""
    monkeypatch.setenv(environment.LIVE_ENV, "widget")
    monkeypatch.setattr(live, "MESSAGES_PER_S", 40.0)
    live.release_charts(0)  # charts left by other tests
    yield
    live.release_charts(0)


def chart_outputs(cap: Any) -> list[Any]:
    return [o for o in cap.outputs if o.transient and "display_id" in o.transient]


@pytest.mark.slow
def test_only_the_newest_charts_keep_their_widgets_older_ones_become_pictures(
    ip: Any, widget_front_end: None
) -> None:
    run(ip, SETUP)
    before = live.live_widget_count()
    ids = []
    for n in range(5):
        with capture_output() as cap:
            result = ip.run_cell(f"%%traceml --name chart{n}\n{LONG}")
        assert result.error_in_exec is None
        outputs = chart_outputs(cap)
        ids.append(outputs[0].transient["display_id"])
        assert any(live.WIDGET_VIEW in o.data for o in outputs)  # it became the bqplot chart
        kept = min(n + 1, live.KEEP_LIVE_CHARTS)
        assert live.live_widget_count() - before == kept * 22
        if n >= live.KEEP_LIVE_CHARTS:  # this cell replaced the oldest live chart, in place
            old = [o for o in outputs if o.update and o.transient["display_id"] == ids[n - 3]]
            assert len(old) == 1
            picture = old[0].data
            assert live.WIDGET_VIEW not in picture
            assert "traceml-live-static" in picture["text/html"] and "<svg" in picture["text/html"]
            assert f"chart{n - 3}" in picture["text/html"] and "done: 4 steps" in picture["text/html"]


def test_a_short_run_builds_no_widget_and_leaves_its_final_picture(
    ip: Any, widget_front_end: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "MESSAGES_PER_S", 4.0)  # the first update a second in
    run(ip, SETUP)
    before = live.live_widget_count()
    with capture_output() as cap:
        ip.run_cell(f"%%traceml\n{TRAIN}")
    assert live.live_widget_count() == before
    outputs = chart_outputs(cap)
    assert not any(live.WIDGET_VIEW in o.data for o in outputs)
    assert "done: 4 steps" in outputs[-1].data["text/html"] and outputs[-1].update


@pytest.mark.slow
def test_clear_forgets_the_runs_and_gives_their_widgets_back(
    ip: Any, widget_front_end: None
) -> None:
    run(ip, SETUP)
    before = live.live_widget_count()
    with capture_output():
        ip.run_cell(f"%%traceml --name kept\n{LONG}")
        ip.run_cell(f"%%traceml --name also\n{LONG}")
    assert live.live_widget_count() - before == 2 * 22
    with capture_output() as cap:
        forgotten = traceml_jupyter.clear()
    assert forgotten >= 2
    assert traceml_jupyter.runs() == [] and traceml_jupyter.last() is None
    assert live.live_widget_count() == before
    pictures = [o.data["text/html"] for o in chart_outputs(cap) if o.update]
    assert len(pictures) == 2 and all("traceml-live-static" in p for p in pictures)
    with pytest.raises(UsageError, match="compare needs two runs"):
        ip.run_line_magic("traceml", "compare")


# -- item 8 and the first traced cell, in a real kernel -----------------------------------------

KERNEL_LONG = "import time\n" + TRAIN.replace("    opt.step()", "    opt.step()\n    time.sleep(0.3)")
STATE = """\
import json, sys, threading, traceml_jupyter
live = sys.modules.get("traceml_jupyter.views.live")
print(json.dumps({
    "imported": sorted(m for m in ("ipywidgets", "bqplot", "traceml_jupyter.views.live") if m in sys.modules),
    "threads": [t.name for t in threading.enumerate() if t.name.startswith("traceml")],
    "widgets": live.live_widget_count() if live else 0,
    "runs": len(traceml_jupyter.runs()),
}))"""


def printed(cell: Any) -> Any:
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    return json.loads(text.strip().splitlines()[-1])


def chart_kind(cell: Any) -> str:
    """What the traced cell's chart output shows in the saved notebook."""
    from jupyter_harness import WIDGET_VIEW

    first = cell.outputs[0].get("data", {})
    if WIDGET_VIEW in first:
        return "widgets"
    return "picture" if "traceml-live-static" in first.get("text/html", "") else "other"


@pytest.mark.kernel
def test_in_a_kernel_old_charts_become_pictures_widgets_stay_bounded_and_clear_frees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nbclient = pytest.importorskip("nbclient")
    from jupyter_harness import KERNEL_NAME, ensure_python3_kernel, notebook

    ensure_python3_kernel()
    monkeypatch.delenv(environment.LIVE_ENV, raising=False)  # the kernel detects its front-end
    traced = [f"%%traceml --name k{n}\n{KERNEL_LONG}" for n in range(5)]
    nb = notebook(
        "%load_ext traceml_jupyter",
        "import time\ntime.sleep(0.7)  # the kernel is busy: the early import waits for the end",
        STATE,
        SETUP,
        *traced,
        STATE,
        "import traceml_jupyter\nprint(traceml_jupyter.clear())",
        STATE,
    )
    client = nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name=KERNEL_NAME)
    kinds = []
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
            if index == 9:  # before clear(): what the saved notebook would show now
                kinds = [chart_kind(nb.cells[4 + n]) for n in range(5)]
    early = printed(nb.cells[2])
    # %load_ext imported the live chart's libraries between cells, before any traced cell,
    # on the kernel's own event loop: no thread of ours
    assert early == {
        "imported": ["bqplot", "ipywidgets", "traceml_jupyter.views.live"],
        "threads": [],
        "widgets": 0,
        "runs": 0,
    }
    after = printed(nb.cells[9])
    assert after == {**early, "widgets": live.KEEP_LIVE_CHARTS * 22, "runs": 5}
    assert kinds == ["picture", "picture", "widgets", "widgets", "widgets"]
    picture = nb.cells[4].outputs[0]["data"]["text/html"]
    assert "k0" in picture and "done: 4 steps" in picture and "<svg" in picture
    assert printed(nb.cells[10]) == 5
    assert printed(nb.cells[11]) == {**early, "widgets": 0, "runs": 0}
    assert [chart_kind(nb.cells[4 + n]) for n in range(5)] == ["picture"] * 5

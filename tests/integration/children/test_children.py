"""Training in processes a traced cell starts (`!python`, `!torchrun`, subprocess.run, os.system)
and the command line: real child processes on the CPU (tests/child_scripts/), the channel that
lets no one else in, and nothing left after the cell (environment, files, sockets, threads,
processes). The kernel is this process's InteractiveShell; test_kernel_cells.py has `!python`
in a real kernel."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import psutil
import pytest
from helpers import TESTS
from IPython.utils.capture import capture_output
from result_factory import result_of

import traceml_jupyter
from traceml_jupyter import kernel_state, ranks
from traceml_jupyter.processes import children
from traceml_jupyter.processes.child_run import exit_status
from traceml_jupyter.processes.startup_hook import CHANNEL, NOTE, TOKEN, pack
from traceml_jupyter.ranks.wire import End, end_document, end_result
from traceml_jupyter.result import LoadError, RunResult
from traceml_jupyter.run import Run

SCRIPTS = TESTS / "child_scripts"
TRAIN = SCRIPTS / "train.py"
PYTHON = sys.executable


def line_of(path: Path, text: str) -> int:
    """The line of `path` that holds `text` (1-based)."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


LOADER_LINE = line_of(TRAIN, "loader = DataLoader(")
SLEEP_LINE = line_of(TRAIN, "time.sleep(self.sleep_s)")


# -- what must be left as it was --------------------------------------------------------------------
def sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            what = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if what.startswith("socket:"):
            found.add(f"{fd}:{what}")
    return found


def hook_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("traceml-")}


@pytest.fixture()
def untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel's environment, temp files, sockets, threads and child processes are as they
    were after the test's cells. The channel's directory is made in a temp dir of the test's own,
    so another process's `traceml-*` directories (a parallel run) cannot be mistaken for ours."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def environ() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    env, dirs, socks = environ(), hook_dirs(), sockets()
    yield
    assert environ() == env, "os.environ changed"
    assert hook_dirs() == dirs, "a hook directory was left behind"
    assert sockets() <= socks, f"sockets left open: {sockets() - socks}"
    assert not ranks.running, "a collector is still listening"
    assert not [t for t in threading.enumerate() if t.name.startswith("traceml")]
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left running: {left}"


def cell(ip: Any, source: str) -> tuple[Any, Run | None, str]:
    """Run a cell as the notebook does: its result, the run it made (None), what it printed."""
    before = traceml_jupyter.last()
    with capture_output() as out:
        result = ip.run_cell(source, store_history=True)
    run = traceml_jupyter.last()
    shown = [str(o.data.get("text/plain", "")) for o in out.outputs]
    return result, (run if run is not before else None), "\n".join([out.stdout, out.stderr, *shown])


def where(run: Run, key: str) -> str | None:
    return next((c["where"] for c in run.result.reading.checklist or () if c["key"] == key), None)


# -- the wire and the channel --------------------------------------------------------------------------
def test_a_frame_that_is_not_one_is_refused() -> None:
    too_long = bytearray(ranks.LENGTH.pack(ranks.MAX_FRAME + 1) + b"x" * 16)
    not_an_object = bytearray(pack(ranks.HELLO, {}).replace(b"{}", b"[]"))
    odd_rows = bytearray(pack(ranks.STEPS, {"rank": 0}, b"\0" * 8 * (len(ranks.ROWS) + 1)))
    not_json = bytearray(ranks.LENGTH.pack(ranks.KIND.size + 3) + ranks.KIND.pack(ranks.HELLO, 3) + b"{x:")
    for buf in (too_long, not_an_object, odd_rows, not_json):
        with pytest.raises(ValueError):
            ranks.read_frames(buf)
    note = bytearray(pack(NOTE, {"pid": 3, "note": "why"}))  # the start-up hook's own frame
    assert ranks.read_frames(note) == [(NOTE, {"pid": 3, "note": "why"}, None)]


def test_a_fast_loop_sends_its_steps_in_frames_under_the_limit() -> None:
    left, right = socket.socketpair()
    try:
        sender = ranks.Sender(left, None, None, 0)  # type: ignore[arg-type]
        n = ranks.STEPS_PER_FRAME * 2 + 5
        rows = np.arange(len(ranks.ROWS) * n, dtype=np.float64).reshape(len(ranks.ROWS), n)
        sender._put_steps({"rank": None}, rows)
        assert len(sender.queue) == 3 and max(map(len, sender.queue)) <= ranks.MAX_FRAME + 4
        got = ranks.read_frames(bytearray(b"".join(sender.queue)))
        assert np.array_equal(np.hstack([r for _, _, r in got if r is not None]), rows)
    finally:
        left.close()
        right.close()


def child_result(n_steps: int) -> RunResult:
    """A child's result as its capture froze it at its end."""
    return result_of("python train.py", [6.0] * n_steps, [4.0] * n_steps, step_kind="optimizer",
                     step_definition="a step = one `optimizer.step()` of SGD", loader_info={"num_workers": 0, "len": 40},
                     sources=[{"label": "`loader`", "kind": "dataloader", "training": True}],
                     loader_site={"file": "/x/train.py", "line": 7}, notes=["the child's own note"])  # fmt: skip


def test_a_childs_end_holds_its_result_as_the_one_codec_writes_it_without_its_steps() -> None:
    child = child_result(50)
    frame = ranks.frame(ranks.END, {"pid": 7, "status": 0, "result": end_document(child)})
    [(kind, meta, rows)] = ranks.read_frames(bytearray(frame))  # JSON on the wire, no code
    back = end_result(cast(End, meta), "its end")
    assert kind == ranks.END and rows is None and back is not None
    assert len(back.columns["step_ms"]) == 0 and back.n_steps == 50  # its steps came in STEPS frames
    assert replace(back, steps=child.steps) == child  # every other field as the child had it
    # A long run's end is no longer than a short one's: it fits a frame whatever the steps.
    longer = ranks.frame(ranks.END, {"pid": 7, "status": 0, "result": end_document(child_result(20_000))})
    assert len(longer) < len(frame) + 1000 < ranks.MAX_FRAME
    # What is not a result is refused by the codec: the collector drops the stream with a note.
    stream = ranks.Stream(socket.socket(), 0, None)
    with pytest.raises(LoadError, match="the end of process None: not a traceml run"):
        stream.apply(ranks.END, {"pid": 7, "result": {"name": "python train.py"}}, None)
    stream.sock.close()
    assert stream.end is None and stream.result is None


def test_the_environment_is_exactly_as_before_also_when_the_cell_changed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # put back after the test: later children import this tree
    before = dict(os.environ)
    channel = children.Channel()
    try:
        with children.child_environment(channel):
            assert os.environ["PYTHONPATH"] == channel.dir and os.environ[CHANNEL] == channel.address
        assert dict(os.environ) == before
        os.environ["PYTHONPATH"] = "/mine"
        with pytest.raises(KeyboardInterrupt), children.child_environment(channel):
            assert os.environ["PYTHONPATH"] == channel.dir + os.pathsep + "/mine"
            os.environ["PYTHONPATH"] += os.pathsep + "/added-by-the-cell"
            os.environ["MY_VAR"] = "set by the cell"
            raise KeyboardInterrupt
        assert os.environ["PYTHONPATH"] == "/mine" + os.pathsep + "/added-by-the-cell"
        assert os.environ.pop("MY_VAR") == "set by the cell"
        assert TOKEN not in os.environ and CHANNEL not in os.environ
    finally:
        os.environ.pop("PYTHONPATH", None)
        channel.close()


def test_the_channel_is_private_and_leaves_nothing() -> None:
    channel = children.Channel()
    assert stat.S_IMODE(os.stat(channel.dir).st_mode) == 0o700
    assert (Path(channel.dir) / "sitecustomize.py").exists()
    assert channel.address == f"unix:{channel.dir}/channel" and len(channel.token) == 32
    channel.close()
    assert not os.path.exists(channel.dir)
    tcp = children.Channel(tcp=True)
    assert tcp.address.startswith("tcp:127.0.0.1:") and tcp.listener.getsockname()[0] == "127.0.0.1"
    tcp.close()


def knock(address: str, data: bytes) -> socket.socket:
    kind, _, where = address.partition(":")
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(where)
    else:
        host, _, port = where.rpartition(":")
        sock = socket.create_connection((host, int(port)))
    sock.sendall(data)
    return sock


def steps_rows(n: int, wait_ms: float, step_ms: float) -> np.ndarray:
    rows = np.zeros((len(ranks.ROWS), n))
    rows[0] = np.arange(n)
    rows[1] = np.arange(n) * step_ms / 1e3
    rows[2], rows[3], rows[4], rows[5] = wait_ms, step_ms - wait_ms, step_ms, np.nan
    return rows


def until(test: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("tcp", [False, True], ids=["unix socket", "127.0.0.1"])
def test_a_connection_without_the_token_and_a_malformed_frame_are_refused(untouched: None, tcp: bool) -> None:
    run = Run("guarded")
    with children.followed(run.recording, tcp=tcp) as collector, ranks.followed(run.recording):  # as a traced cell
        address, token = os.environ[CHANNEL], os.environ[TOKEN].encode()
        # Another cell's or user's connection: a wrong token, then frames. Nothing of it is read.
        foreign = knock(address, b"0" * len(token) + ranks.frame(ranks.STEPS, {}, steps_rows(5, 1, 2)))
        silent = knock(address, b"")
        silent.close()
        # This cell's token, then a frame that is not one.
        broken = knock(address, token + ranks.LENGTH.pack(ranks.MAX_FRAME * 4) + b"\0" * 64)
        # This cell's token and real frames: a child that trained 12 steps.
        good = knock(address, token)
        good.sendall(ranks.frame(ranks.HELLO, {"pid": 42, "command": "python train.py", "origin_ns": 5}))
        good.sendall(ranks.frame(ranks.STEPS, {"rank": None, "world": None}, steps_rows(12, 6.0, 10.0)))
        child = result_of("python train.py", [6.0] * 12, [4.0] * 12, step_kind="optimizer",
                          step_definition="a step = one `optimizer.step()` of SGD",
                          loader_site={"file": "/x/train.py", "line": 7})
        good.sendall(ranks.frame(ranks.END, {"pid": 42, "error": None, "status": 0, "result": end_document(child)}))
        until(lambda: len(collector.notes) >= 3 and len(collector.streams) == 2)
        for sock in (foreign, broken, good):
            sock.close()
    run.finish()
    refused = [n for n in run.notes if "did not give this cell's token was refused" in n]
    assert len(refused) == 2
    assert any("sent what could not be read: ValueError: a frame of" in n for n in run.notes)
    assert run.n_steps == 12 and run.verdict == "INPUT-BOUND"  # only the good child's steps
    assert run.result.data.loader_site == {"file": "/x/train.py", "line": 7}  # what its end's result says
    assert run.result.steps.definition == "a step = one `optimizer.step()` of SGD"
    assert sorted(str(p["pid"]) for p in run.result.processes or []) == ["42", "None"]  # the broken one said no hello


def test_who_trained_decides_what_the_run_shows(untouched: None) -> None:
    run = Run("several")
    with children.followed(run.recording) as collector, ranks.followed(run.recording):
        address, token = os.environ[CHANNEL], os.environ[TOKEN].encode()
        short = knock(address, token + ranks.frame(ranks.HELLO, {"pid": 1, "command": "python a.py"}))
        short.sendall(ranks.frame(ranks.STEPS, {}, steps_rows(5, 1.0, 10.0)))
        long = knock(address, token + ranks.frame(ranks.HELLO, {"pid": 2, "command": "python b.py"}))
        long.sendall(ranks.frame(ranks.STEPS, {}, steps_rows(20, 1.0, 10.0)))
        early = knock(address, token + ranks.frame(ranks.HELLO, {"pid": 3, "command": "python c.py"}))
        early.sendall(ranks.frame(ranks.END, {"pid": 3, "error": "ValueError: bad flag", "status": 2}))
        helpless = knock(address, token + pack(NOTE, {"pid": 4, "command": "python3.9 d.py", "note": "no numpy"}))
        killed = knock(address, token + ranks.frame(ranks.HELLO, {"pid": 5, "command": "python e.py"}))
        until(lambda: sum(s.said_hello or bool(s.note) for s in collector.streams) == 5)
        until(lambda: sum(s.recorder.n_steps for s in collector.streams) == 25)
        live = collector.live(300)  # the live chart: one line per process, none held up by another
        assert live is not None and live["text"] == "2 processes" and live["slowest"] is None
        assert sorted(len(series["step"]) for series in live["series"]) == [5, 20]
        for sock in (short, long, early, helpless, killed):
            sock.close()
    run.finish()
    assert run.n_steps == 20  # the process that trained most
    notes = "\n".join(run.notes)
    assert "`python a.py` (pid 1) trained too (5 steps); its steps are not shown." in notes
    assert "`python c.py` failed (exit status 2): ValueError: bad flag, before its first step." in notes
    assert "`python3.9 d.py` (pid 4) trains but was not traced: no numpy" in notes
    assert "`python e.py` ended without saying how (killed, or os._exit), before its first step." in notes
    statuses = sorted((p["pid"], p["status"]) for p in run.result.processes or [])
    assert statuses == [(1, "stopped"), (2, "stopped"), (3, "failed"), (4, "not traced"), (5, "stopped")]


def test_a_child_whose_end_could_not_say_what_it_measured_still_shows_its_steps(untouched: None) -> None:
    run = Run("no result")
    with children.followed(run.recording) as collector, ranks.followed(run.recording):
        address, token = os.environ[CHANNEL], os.environ[TOKEN].encode()
        child = knock(address, token + ranks.frame(ranks.HELLO, {"pid": 9, "command": "python f.py"}))
        child.sendall(ranks.frame(ranks.STEPS, {}, steps_rows(10, 1.0, 10.0)))
        child.sendall(ranks.frame(ranks.END, {"pid": 9, "error": None, "status": 0,
                                              "note": "what fed its steps could not be read: TypeError: odd loader"}))
        until(lambda: any(s.end is not None for s in collector.streams))
        child.close()
    run.finish()
    assert run.n_steps == 10 and run.result.steps.kind == "none"  # its steps; what a step was, it could not say
    assert "`python f.py`: what fed its steps could not be read: TypeError: odd loader" in run.notes
    assert [(p["pid"], p["status"]) for p in run.result.processes or []] == [(9, "finished")]


def test_the_exit_status_a_child_reports() -> None:
    assert exit_status(None, None) == (0, None)
    assert exit_status(3, None) == (3, "exit status 3")
    assert exit_status(1, "ValueError: boom") == (1, "ValueError: boom")
    assert exit_status("bad input", None) == (1, "bad input")
    assert exit_status(False, None) == (0, None)


def test_the_commands_a_cell_starts_are_named(ip: Any) -> None:
    import ast

    code = ip.transform_cell("!ls -la\nimport subprocess\nsubprocess.run(['python', 'x.py'])\nx = 1\n")
    assert children.started_commands(ast.parse(code)) == ["ls -la", "['python', 'x.py']"]


# -- a child interpreter, no notebook ---------------------------------------------------------------------
@pytest.mark.slow
def test_the_hook_costs_a_child_that_does_not_train_nothing_but_its_check(untouched: None, tmp_path: Path) -> None:
    """The sitecustomize it hides still runs; nothing connects; the child's output is its own."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "sitecustomize.py").write_text("MARK = 'the sitecustomize that was there'\n")
    fake = tmp_path / "notorch"  # a `torch` that cannot be armed: the child says so, once
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    run = Run("no training")
    with children.followed(run.recording) as collector, ranks.followed(run.recording):
        env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"] + os.pathsep + str(earlier)}
        code = "import sitecustomize, sys; print(sitecustomize.MARK); print('torch' in sys.modules)"
        out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.splitlines() == ["the sitecustomize that was there", "False"], out.stderr
        env["PYTHONPATH"] += os.pathsep + str(fake)
        subprocess.run([PYTHON, "-c", "import torch"], env=env, check=True)
        until(lambda: any(getattr(s, "note", None) for s in collector.streams))
    run.finish()
    assert len(run.result.processes or []) == 1  # the first child never connected
    assert "trains but was not traced: traceml could not start here: ModuleNotFoundError" in " ".join(run.notes)


# -- cells ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bang_python_with_a_slow_loader_is_input_bound_at_the_scripts_line(ip: Any, untouched: None, tmp_path: Path) -> None:
    truth_file = tmp_path / "truth.json"
    result, run, out = cell(ip, f"%%traceml --no-live --name script\n!{PYTHON} {TRAIN} --sleep-ms 3 --steps 24 --truth {truth_file}")
    assert result.error_in_exec is None and run is not None, out
    truth = json.loads(truth_file.read_text())  # the script's own next() and steps, timed by hand
    share = float(np.median(np.array(truth["wait_ms"][3:]) / np.array(truth["step_ms"][3:])))
    assert run.n_steps == 24 and run.result.steps.kind == "optimizer" and run.verdict == "INPUT-BOUND"
    assert run.summary["data_wait_share"] == pytest.approx(share, abs=0.05)
    assert where(run, "num_workers") == f"train.py, line {LOADER_LINE}"
    assert where(run, "per_sample_cost") == f"train.py, line {SLEEP_LINE}"
    start = next(c for c in run.result.reading.checklist or () if c["key"] == "start_method")
    assert start["status"] == "ok" and "from module train.py" in start["seen"]  # a script, not a notebook cell
    assert run.result.data.loader is not None and run.result.data.loader["num_workers"] == 0 and run.result.steps.batch_size == 4
    (child,) = run.result.processes or []
    assert child["status"] == "finished" and child["exit_status"] == 0 and child["n_steps"] == 24
    assert child["command"].startswith("python ") and "train.py --sleep-ms 3" in child["command"]


@pytest.mark.slow
def test_subprocess_run_and_os_system_of_a_balanced_script_and_one_that_exits_early(ip: Any, untouched: None) -> None:
    source = (
        "%%traceml --no-live\n"
        "import os, subprocess, sys\n"
        # Compute-bound with room: taking each batch from the one worker costs the child 4-10 ms on
        # a loaded 2-core machine (measured), under a tenth of a step of 200 products (100-230 ms).
        f"subprocess.run([sys.executable, {str(TRAIN)!r}, '--work', '200', '--steps', '16', '--workers', '1'], check=True)\n"
        f"status = os.system({f'{PYTHON} {TRAIN} --quit 2'!r})\n"
    )
    result, run, out = cell(ip, source)
    assert result.error_in_exec is None and run is not None, out
    assert ip.user_ns["status"] == 2 << 8  # os.system's wait status: the child's exit status 2
    assert run.n_steps == 16 and run.verdict == "COMPUTE-BOUND", run.text()  # its DataLoader worker sent nothing
    assert sorted(p["n_steps"] for p in run.result.processes or []) == [0, 16]
    assert run.result.resources.host is not None and len(run.result.resources.host["workers"]) == 1  # the child's resources: its worker
    assert any("--quit 2` failed (exit status 2), before its first step." in n for n in run.notes), run.notes


@pytest.fixture()
def kernel_trains(ip: Any) -> Any:
    """A model, optimizer and loader in the kernel, trained once untraced (torch sets its own
    environment variables the first time an optimizer steps)."""
    ip.run_cell("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
                "net = torch.nn.Linear(4, 1); sgd = torch.optim.SGD(net.parameters(), lr=0.1)\n"
                "data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)\n"
                "sgd.zero_grad(); torch.nn.functional.mse_loss(net(next(iter(data))[0]), torch.zeros(8, 1)).backward(); sgd.step()")
    return ip


@pytest.mark.slow
def test_a_cell_that_trains_itself_and_starts_a_child_that_trains(kernel_trains: Any, untouched: None) -> None:
    """The kernel's own steps are the run's; the child is a note (its frames sent by the cell,
    as a child would send them)."""
    ip = kernel_trains
    source = (
        "%%traceml --no-live\n"
        "import os, socket, numpy as np\n"
        "from traceml_jupyter import ranks\n"
        "kind, _, path = os.environ['TRACEML_JUPYTER_CHANNEL'].partition(':')\n"
        "child = socket.socket(socket.AF_UNIX); child.connect(path)\n"
        "rows = np.zeros((len(ranks.ROWS), 5)); rows[0] = np.arange(5); rows[4] = 10.0\n"
        "child.sendall(os.environ['TRACEML_JUPYTER_TOKEN'].encode() + ranks.frame(ranks.HELLO, {'pid': 7, 'command': 'python other.py'})\n"
        "             + ranks.frame(ranks.STEPS, {}, rows) + ranks.frame(ranks.END, {'pid': 7, 'status': 0}))\n"
        "child.close()\n"
        "for x, y in data:\n"
        "    sgd.zero_grad(); torch.nn.functional.mse_loss(net(x), y).backward(); sgd.step()\n"
    )
    result, run, out = cell(ip, source)
    assert result.error_in_exec is None and run is not None, out
    assert run.n_steps == 8 and run.result.loop.line == 10  # the kernel's own steps
    assert "`python other.py` (pid 7), a child process, trained too (5 steps); its steps are not shown." in run.notes
    assert "The steps shown are the kernel's own." in run.notes
    # Nothing Python trains: one line says so, naming the command.
    result, run, out = cell(ip, "%%traceml\n!echo not python\n")
    assert result.error_in_exec is None and run is None
    assert "traceml: no step ran: no process this cell started (`echo not python`) trained." in out


@pytest.mark.slow
def test_the_stop_button_ends_the_child_as_without_the_magic(ip: Any, untouched: None) -> None:
    before = traceml_jupyter.last()

    def press_stop() -> None:
        def stepped() -> bool:
            run = traceml_jupyter.last()
            if run is None or run is before or run.finished:
                return False
            feed = run.recording.rank_collector
            return feed is not None and any(s.recorder.n_steps for s in feed.streams)

        try:
            until(stepped, 60)
        finally:  # pressed in any case: a child that never reports must not keep the cell running
            os.kill(os.getpid(), signal.SIGINT)

    stopper = threading.Thread(target=press_stop)
    stopper.start()
    try:
        result, run, out = cell(ip, f"%%traceml --no-live\nimport subprocess, sys\nsubprocess.run([sys.executable, {str(TRAIN)!r}, '--forever', '--sleep-ms', '1'])")
    finally:
        stopper.join()
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert run is not None and run.n_steps > 0 and run.result.error == "KeyboardInterrupt"
    assert "Step Time:" in out  # the partial report, before the KeyboardInterrupt


@pytest.mark.slow
def test_a_child_that_outlives_its_cell_stops_reporting_cleanly(
    ip: Any, untouched: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranks.collector, "DRAIN_S", 0.3)
    done = tmp_path / "done"
    source = (
        "%%traceml --no-live\n"
        "import subprocess, sys, time, traceml_jupyter\n"
        f"child = subprocess.Popen([sys.executable, {str(TRAIN)!r}, '--steps', '40', '--sleep-ms', '1', '--linger', '1', '--done', {str(done)!r}], stderr=subprocess.PIPE)\n"
        "deadline = time.monotonic() + 120\n"  # a child that never reports fails the test, not hangs it
        "while not any(s.recorder.n_steps for s in traceml_jupyter.last().recording.rank_collector.streams):\n"
        "    assert time.monotonic() < deadline, 'the child never reported a step'\n"
        "    time.sleep(0.02)\n"
    )
    result, run, out = cell(ip, source)
    child = ip.user_ns.pop("child")
    try:
        assert result.error_in_exec is None and run is not None
        assert 0 < run.n_steps <= 40
        assert any("was still running 0.3 s after the cell ended" in n for n in run.notes)
        assert run.result.processes and run.result.processes[0]["status"] == "running"
    finally:
        _, err = child.communicate(timeout=120)
    assert child.returncode == 0 and done.read_text() == "done" and not err, err  # trained on, untouched


@pytest.mark.slow
def test_percent_run_traces_in_process_and_tune_finds_the_scripts_loader(ip: Any, untouched: None) -> None:
    result, run, out = cell(ip, f"%%traceml --no-live\n%run {TRAIN} --sleep-ms 2 --steps 12")
    assert result.error_in_exec is None and run is not None and run.result.processes is None
    assert run.n_steps == 12 and run.verdict == "INPUT-BOUND"
    assert where(run, "num_workers") == f"train.py, line {LOADER_LINE}"
    assert run.loader_ref is not None and run.loader_ref() is not None  # main()'s loader, kept
    with capture_output():
        tuned = ip.run_line_magic("traceml", "tune --budget 2 --workers 0")
    assert tuned.rows and tuned.rows[0]["batches_per_s"] > 0
    traceml_jupyter.clear()
    assert kernel_state.kept_loader_copy() is None  # kept until the next run or clear()


@pytest.mark.slow
def test_loop_file_line_steps_a_script_without_training_events(ip: Any, untouched: None) -> None:
    """A script whose loop reads a generator and trains nothing (no torch): `--loop FILE:LINE`
    makes its iterations the steps, the script run as Python runs it."""
    script = SCRIPTS / "generator_loop.py"
    line = line_of(script, "for batch in batches(")
    result, run, out = cell(ip, f"%%traceml --no-live --loop {script}:{line}\n!{PYTHON} {script} 20")
    assert result.error_in_exec is None and run is not None, out
    assert run.n_steps == 20 and run.result.steps.kind == "iteration" and run.verdict == "INPUT-BOUND"
    assert run.result.loop.line == line and run.result.loop.where == "generator_loop.py"
    assert f"loop on line {line} of generator_loop.py" in run.text()
    result, run, out = cell(ip, "%%traceml --loop nowhere/train.py:3\n!echo hi")
    assert run is None and "--loop nowhere/train.py:3: there is no file nowhere/train.py" in out


@pytest.mark.slow
def test_torchrun_in_a_cell_names_the_rank_that_holds_the_others_back(ip: Any, untouched: None) -> None:
    port = free_port()
    command = (f"!OMP_NUM_THREADS=1 {PYTHON} -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 "
               f"--master_port {port} {TESTS / 'ranks_scripts' / 'ddp_trace.py'} --plain")
    result, run, out = cell(ip, "%%traceml --no-live\n" + command)
    assert result.error_in_exec is None and run is not None, out
    assert run.verdict == "RANK STRAGGLER", run.text()
    assert run.straggler is not None and run.straggler["rank"] == 1 and run.straggler["cause"] == "input"
    assert sorted(r["rank"] for r in run.result.ranks or []) == [0, 1]  # the elastic agent sent nothing
    assert len(run.result.processes or []) == 2
    assert "Ranks (median per step; * holds the others back):" in run.text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the command line ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_command_line_on_a_crashing_script_prints_the_box_and_passes_its_status_through(
    untouched: None, tmp_path: Path
) -> None:
    saved = tmp_path / "run.json"
    done = subprocess.run(
        [PYTHON, "-m", "traceml_jupyter", "run", "--name", "cli", "--save", str(saved), "--",
         PYTHON, str(TRAIN), "--sleep-ms", "3", "--steps", "30", "--crash-at", "16"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: corrupt batch at step 16" in done.stderr  # the script's own traceback
    out = done.stdout
    assert "traceml: cli - 16 steps (a step = one `optimizer.step()` of SGD)" in out  # its partial steps
    assert "|  Step Time: INPUT-BOUND" in out
    assert f"Checklist: fix Worker processes (num_workers) - 0 (train.py, line {LOADER_LINE}): try" in out
    assert "Stopped by: `python" in out and "failed (exit status 1): RuntimeError: corrupt batch at step 16" in out
    data = json.loads(saved.read_text())
    assert data["verdict"]["label"] == "INPUT-BOUND" and len(data["steps"]["step"]) == 16
    assert data["processes"][0]["exit_status"] == 1 and data["loader_site"]["line"] == LOADER_LINE


@pytest.mark.slow
def test_the_command_line_refuses_a_bad_save_and_names_a_missing_command() -> None:
    bad = subprocess.run([PYTHON, "-m", "traceml_jupyter", "run", "--save", "x.csv", "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--save x.csv: the file name must end in .html or .json" in bad.stderr
    missing = subprocess.run([PYTHON, "-m", "traceml_jupyter", "run", "--", "no-such-command-xyz"], capture_output=True, text=True)
    assert missing.returncode == 127 and "cannot run no-such-command-xyz" in missing.stderr
    nothing = subprocess.run([PYTHON, "-m", "traceml_jupyter", "run", "--", "true"], capture_output=True, text=True)
    assert nothing.returncode == 0 and "no process the command started (`true`) trained" in nothing.stdout

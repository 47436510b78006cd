"""TraceML (`pip install traceml-ai`), the peer we compare with: installed in its own venv
(never pulling torch), its aggregator started with `traceml serve` and stopped by PID, and
its per-step telemetry read back.

Its runtime starts threads and patches DataLoader/forward/backward for the life of the
process, so it is measured in a worker process of its own (the same loop, the same code,
with its own plain baseline), never in the process that measures the others.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VENV = Path(os.environ.get("TRACEML_AI_VENV", "/tmp/venv-traceml"))
VERSION = "0.5.0"
# Its declared requirements (none of them is torch): it imports the torch already loaded.
LIGHT_DEPS = ["rich>=12.0.0", "psutil>=5.0.0", "nvidia-ml-py", "numpy>=1.26", "msgspec", "pyyaml>=6.0"]
INSTALL_HINT = (
    f"{sys.executable} -m venv {VENV} && {VENV}/bin/pip install --no-deps traceml-ai=={VERSION} "
    f"&& {VENV}/bin/pip install " + " ".join(f"'{d}'" for d in LIGHT_DEPS)
)


def site_packages() -> Path | None:
    found = glob.glob(str(VENV / "lib" / "python*" / "site-packages"))
    return Path(found[0]) if found else None


def installed() -> bool:
    site = site_packages()
    return bool(site and (site / "traceml_ai").is_dir() and (VENV / "bin" / "traceml").exists())


def ensure_installed(allow_install: bool = True) -> str | None:
    """None when traceml-ai is ready, else why it is not (the tables print this)."""
    if installed():
        return None
    if not allow_install:
        return f"traceml-ai is not installed in {VENV} (install: {INSTALL_HINT})"
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(VENV / "bin" / "pip"), "install", "-q", "--no-deps", f"traceml-ai=={VERSION}"],
        [str(VENV / "bin" / "pip"), "install", "-q", *LIGHT_DEPS],
    ]
    for cmd in steps:
        print("installing the peer:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return f"could not install traceml-ai ({' '.join(cmd[:3])}...): {' | '.join(tail)}"
    return None if installed() else "traceml-ai installed, but its package was not found"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def aggregator(logs_dir: Path, run_name: str) -> Iterator[tuple[dict[str, str], int]]:
    """`traceml serve` in the background for as long as the block runs; stopped by its PID
    (SIGINT, its clean shutdown; then SIGTERM, then SIGKILL). Yields the worker's env and
    the aggregator's PID."""
    port = free_port()
    log = open(logs_dir / f"serve-{run_name}.log", "w")
    cmd = [
        str(VENV / "bin" / "traceml"), "serve", "--logs-dir", str(logs_dir),
        "--run-name", run_name, "--aggregator-port", str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"`traceml serve` did not start (exit {proc.poll()}); see {log.name}"
                )
            time.sleep(0.1)
        env = {
            "TRACEML_AI_SITE": str(site_packages()),
            "TRACEML_AI_PORT": str(port),
            "TRACEML_AI_LOGS": str(logs_dir),
            "TRACEML_AI_RUN": run_name,
        }
        yield env, proc.pid
    finally:
        for sig, wait_s in ((signal.SIGINT, 20), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                break
            try:
                os.kill(proc.pid, sig)
                proc.wait(timeout=wait_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        log.close()


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by a process and its children (the aggregator's own cost)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True):
            total += sum(child.cpu_times()[:2])
        return float(total)
    except psutil.Error:
        return float("nan")


def run_worker(script: str, args: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run `script --traceml-ai-worker ARGS` and return the JSON it printed on its RESULT line."""
    full_env = {**os.environ, **env}
    done = subprocess.run(
        [sys.executable, script, "--traceml-ai-worker", *args],
        capture_output=True, text=True, timeout=timeout_s, env=full_env,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
    raise RuntimeError(f"traceml-ai worker failed (exit {done.returncode}):\n{tail}")


# -- inside the worker process ----------------------------------------------------------------
def init_in_worker() -> Any:
    """Import traceml_ai from its venv and `traceml.init(mode="auto")` against the aggregator."""
    sys.path.append(os.environ["TRACEML_AI_SITE"])  # appended: torch and numpy stay ours
    import traceml_ai as traceml

    cfg = traceml.init(
        mode="auto",
        aggregator_host="127.0.0.1",
        aggregator_port=int(os.environ["TRACEML_AI_PORT"]),
        logs_dir=os.environ["TRACEML_AI_LOGS"],
        session_id=os.environ["TRACEML_AI_RUN"],
        on_missing_aggregator="raise",
    )
    if cfg.disabled:
        raise RuntimeError("traceml.init() came back disabled")
    return traceml


def current_step() -> int:
    from traceml_ai.sdk import get_trace_session_state

    return int(get_trace_session_state().step)


def step_events(first: int, last: int, timeout_s: float = 30.0) -> dict[int, dict[str, float]]:
    """Per-step CPU times (ms) that traceml-ai recorded for steps first..last, from its
    aggregator's telemetry database: {step: {"dataloader_next": ms, "step_time": ms, ...}}."""
    db = Path(os.environ["TRACEML_AI_LOGS"]) / os.environ["TRACEML_AI_RUN"] / "aggregator" / "telemetry"
    deadline = time.monotonic() + timeout_s
    rows: list[tuple[int, str]] = []
    while time.monotonic() < deadline:
        if db.exists():
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                rows = con.execute(
                    "SELECT step, events_json FROM step_time_samples WHERE step BETWEEN ? AND ?",
                    (first, last),
                ).fetchall()
                con.close()
            except sqlite3.Error:
                rows = []
            if len({r[0] for r in rows}) >= last - first + 1:
                break
        time.sleep(0.25)
    out: dict[int, dict[str, float]] = {}
    for step, text in rows:
        events = json.loads(text)
        phases: dict[str, float] = {}
        for name, per_device in events.items():
            cpu = per_device.get("cpu") or {}
            if cpu.get("duration_ms") is not None:
                phases[name.split(":", 1)[-1]] = float(cpu["duration_ms"])
        out[int(step)] = phases
    return out

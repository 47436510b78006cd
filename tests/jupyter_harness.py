"""Notebooks driven end to end for the kernel and browser tests: the traced notebook with a slow
DataLoader, the python3 kernelspec, a throwaway Jupyter server, and saved widget state decoded."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
import numpy as np

KERNEL_NAME = "python3"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# The Lab/Notebook "would you like news?" toast covers the cell outputs in screenshots.
NO_NEWS = {
    "@jupyterlab/apputils-extension:notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
    }
}

BATCHES_PER_EPOCH = 32


def loader_cell(sleep_ms: float) -> str:
    """A tiny model and a DataLoader that sleeps per sample: the loop is input-bound."""
    return f"""\
import time
import torch
from torch.utils.data import DataLoader, Dataset

class SlowDataset(Dataset):
    def __len__(self):
        return {BATCHES_PER_EPOCH * 8}

    def __getitem__(self, i):
        time.sleep({sleep_ms / 1000.0!r})  # stands in for decoding an image
        return torch.randn(16), i % 2

loader = DataLoader(SlowDataset(), batch_size=8, num_workers=0)
model = torch.nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()"""


# A dataset whose samples cost `decode_ms` each (the fix: decode less), torch on one thread so
# that compute stays small and steady on a shared machine: for runs that are compared.
DECODING_DATASET = """\
import time, torch
from torch.utils.data import DataLoader, Dataset
torch.set_num_threads(1)

class SlowDataset(Dataset):
    def __init__(self, decode_ms, n=160):
        self.decode_ms, self.n = decode_ms, n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        time.sleep(self.decode_ms / 1000)  # stands in for decoding an image
        return torch.randn(16), i % 2
"""


def traced_cell(epochs: int, name: str = "slow") -> str:
    """The cell a user traces: `epochs` passes over the slow loader."""
    return f"""\
%%traceml --name {name}
for epoch in range({epochs}):
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()"""


def notebook(*sources: str) -> nbformat.NotebookNode:
    """A notebook of code cells with a python3 kernelspec (without one, Lab starts no kernel)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": KERNEL_NAME,
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return nb


def ensure_python3_kernel() -> None:
    """The python3 kernelspec of this venv, installed into it when missing."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    here = specs.get(KERNEL_NAME, "")
    if not here or not Path(here).resolve().is_relative_to(Path(sys.prefix).resolve()):
        subprocess.run(
            [sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL_NAME],
            check=True,
            capture_output=True,
        )


def ensure_no_news_overrides() -> None:
    """{sys.prefix}/share/jupyter/lab/settings/overrides.json with the news toast turned off."""
    path = Path(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
    current: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    merged = {**current, **NO_NEWS}
    if merged != current:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=1))


# -- saved widget state -----------------------------------------------------------------------
def widget_models(nb: nbformat.NotebookNode) -> dict[str, dict[str, Any]]:
    """Model id -> saved model (model_name, model_module, state, buffers) from the metadata."""
    saved = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {})
    return dict(saved.get("state", {}))


def model_arrays(model: dict[str, Any]) -> dict[str, np.ndarray]:
    """The binary traits of a saved model (bqplot's x, y, ...) decoded to numpy arrays,
    keyed by their path in the state ('y', or 'y.0' for a list of arrays)."""
    arrays: dict[str, np.ndarray] = {}
    for buffer in model.get("buffers", []):
        path = list(buffer["path"])
        if path and path[-1] == "value":
            path = path[:-1]
        spec: Any = model["state"]
        for key in path:
            spec = spec[key]
        raw = base64.b64decode(buffer["data"])
        if isinstance(spec, dict) and "dtype" in spec and "shape" in spec:
            arr = np.frombuffer(raw, dtype=spec["dtype"]).reshape(spec["shape"])
        else:
            arr = np.frombuffer(raw, dtype=np.uint8)
        arrays[".".join(str(k) for k in path)] = arr
    return arrays


def message_arrays(msg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The binary traits carried by one comm message (an update of a bqplot mark)."""
    data = msg["content"]["data"]
    arrays: dict[str, np.ndarray] = {}
    for path, raw in zip(data.get("buffer_paths", []), msg.get("buffers", []), strict=False):
        keys = list(path)
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        spec: Any = data["state"]
        for key in keys:
            spec = spec[key]
        if isinstance(spec, dict) and "dtype" in spec and "shape" in spec:
            arrays[".".join(str(k) for k in keys)] = np.frombuffer(
                bytes(raw), dtype=spec["dtype"]
            ).reshape(spec["shape"])
    return arrays


# -- a throwaway Jupyter server ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def _children(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (the kernels a server started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM the server by PID and wait; then any kernel it left behind, also by PID."""
    kernels = _children(proc.pid)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    deadline = time.monotonic() + 5.0
    for pid in kernels:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)


class JupyterServer:
    """A running `jupyter lab` / `jupyter notebook` with no token, in fresh config dirs."""

    def __init__(self, app: str, root: Path, home: Path) -> None:
        self.app = app
        self.root = root
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / f"{app}-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def page_url(self, notebook_name: str) -> str:
        if self.app == "lab":
            return f"{self.url}/lab/tree/{notebook_name}"
        return f"{self.url}/notebooks/{notebook_name}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def start(self, timeout: float = 60.0) -> None:
        dirs = {
            "JUPYTER_CONFIG_DIR": self.home / "config",
            "JUPYTER_RUNTIME_DIR": self.home / "runtime",
            "JUPYTERLAB_SETTINGS_DIR": self.home / "settings",
            "JUPYTERLAB_WORKSPACES_DIR": self.home / "workspaces",
        }
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **{k: str(v) for k, v in dirs.items()}}
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env.pop("TRACEML_LIVE", None)  # the kernel detects its front-end itself
        module = "jupyterlab" if self.app == "lab" else "notebook"
        cmd = [
            sys.executable,
            "-m",
            module,
            "--no-browser",
            "--ServerApp.token=",
            "--ServerApp.password=",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            "--allow-root",
            f"--ServerApp.root_dir={self.root}",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter {self.app} exited early:\n{self.log()}")
            try:
                get_json(f"{self.url}/api/status", timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise TimeoutError(f"jupyter {self.app} did not answer /api/status:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def kernels(self) -> list[dict[str, Any]]:
        """/api/kernels, retried on transient errors (the server is busy starting a kernel)."""
        for _ in range(5):
            try:
                return list(get_json(f"{self.url}/api/kernels"))
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                time.sleep(0.2)
        return []

    def kernel_state(self) -> str | None:
        """The execution state of the connected kernel (None before one is connected)."""
        for kernel in self.kernels():
            if kernel.get("connections", 0) >= 1:
                return str(kernel.get("execution_state"))
        return None

    def wait_kernel_idle(self, timeout: float = 60.0) -> None:
        """Ready = a kernel with a connection, idle (the toolbar says idle before that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kernel_state() == "idle":
                return
            time.sleep(0.25)
        raise TimeoutError(f"no connected idle kernel after {timeout:.0f}s: {self.kernels()}")


@contextmanager
def jupyter_server(app: str, root: Path, home: Path) -> Iterator[JupyterServer]:
    """A server for the duration of the block, stopped by PID (SIGTERM + wait) after it."""
    server = JupyterServer(app, root, home)
    try:
        server.start()
        yield server
    finally:
        server.stop()

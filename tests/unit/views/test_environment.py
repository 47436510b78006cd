"""Which live view each front-end gets, and the Colab path, tested with stand-in modules."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from traceml_jupyter.views import environment


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.LIVE_ENV, raising=False)


@pytest.fixture
def colab(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A stand-in google.colab.output whose enable_custom_widget_manager records its calls."""
    calls: list[str] = []
    google = types.ModuleType("google")
    colab_pkg = types.ModuleType("google.colab")
    output = types.ModuleType("google.colab.output")
    output.enable_custom_widget_manager = lambda: calls.append("enable")  # type: ignore[attr-defined]
    colab_pkg.output = output  # type: ignore[attr-defined]
    google.colab = colab_pkg  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab_pkg)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    monkeypatch.setattr(environment, "_colab_widgets_enabled", False)
    return calls


def kernel_shell(kernel: Any) -> Any:
    """An ipykernel shell object as Lab, Notebook, VS Code, Colab and Kaggle run (not started)."""
    zmqshell = pytest.importorskip("ipykernel.zmqshell")
    shell = zmqshell.ZMQInteractiveShell.__new__(zmqshell.ZMQInteractiveShell)
    shell.kernel = kernel
    return shell


def test_ipython_test_shell_and_terminal_get_no_live_display(ip: Any, no_override: None) -> None:
    assert not environment.in_kernel(ip)
    assert not environment.has_widget_frontend(ip)
    assert environment.live_mode(ip) == "none"
    assert environment.live_mode() == "none"  # the running shell, found by itself


def test_a_kernel_with_widgets_gets_the_chart(no_override: None) -> None:
    shell = kernel_shell(kernel=object())
    assert environment.in_kernel(shell)
    assert environment.has_widget_frontend(shell)
    assert environment.live_mode(shell) == "widget"


def test_a_kernel_without_widgets_gets_the_html_display(
    monkeypatch: pytest.MonkeyPatch, no_override: None
) -> None:
    monkeypatch.setattr(environment, "widgets_installed", lambda: False)
    shell = kernel_shell(kernel=object())
    assert not environment.has_widget_frontend(shell)
    assert environment.live_mode(shell) == "html"


def test_a_kernel_shell_without_a_kernel_is_no_front_end(no_override: None) -> None:
    assert not environment.in_kernel(kernel_shell(kernel=None))


@pytest.mark.parametrize("value", ["widget", "html", "none", " HTML "])
def test_traceml_live_overrides_the_detection(
    monkeypatch: pytest.MonkeyPatch, ip: Any, value: str
) -> None:
    monkeypatch.setenv(environment.LIVE_ENV, value)
    assert environment.live_mode(ip) == value.strip().lower()


def test_an_unknown_traceml_live_value_is_ignored(monkeypatch: pytest.MonkeyPatch, ip: Any) -> None:
    monkeypatch.setenv(environment.LIVE_ENV, "fancy")
    assert environment.live_mode(ip) == "none"


def test_colab_custom_widget_manager_is_enabled_once_per_kernel(colab: list[str]) -> None:
    assert environment.in_colab()
    assert environment.enable_custom_widget_manager_once()
    assert environment.enable_custom_widget_manager_once()
    assert colab == ["enable"]


def test_outside_colab_nothing_is_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(environment, "_colab_widgets_enabled", False)
    assert not environment.in_colab()
    assert not environment.enable_custom_widget_manager_once()


def test_a_failing_colab_manager_is_not_fatal(
    monkeypatch: pytest.MonkeyPatch, colab: list[str]
) -> None:
    def refuse() -> None:
        raise RuntimeError("no manager here")

    monkeypatch.setattr(sys.modules["google.colab.output"], "enable_custom_widget_manager", refuse)
    assert not environment.enable_custom_widget_manager_once()


def test_ipywidgets_major_matches_the_installed_version() -> None:
    import ipywidgets

    assert environment.ipywidgets_major() == int(ipywidgets.__version__.split(".")[0])
    assert environment.ipywidgets_major() in (7, 8)

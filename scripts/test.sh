#!/usr/bin/env bash
# Set up, then lint, type-check, build and smoke-test the wheel, and run every test: unit, real
# shell, real kernel, real browser, and the widget tests again under ipywidgets 7 (Colab's).
#   ./scripts/test.sh [PYTEST ARGS]           what CI runs (.ci/run)
#   ./scripts/test.sh --quick [PYTEST ARGS]   the inner loop, under a minute: ruff, mypy and the
#       tests that need no kernel, browser, child process or CUDA and take under half a second
#       (-m "not kernel and not browser and not slow and not cuda"; docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
    shift
    [ -x .venv/bin/python ] || bash scripts/setup.sh
    .venv/bin/ruff check traceml_jupyter tests scripts
    .venv/bin/mypy traceml_jupyter
    exec .venv/bin/python -m pytest tests -q -p no:cacheprovider \
        -m "not kernel and not browser and not slow and not cuda" "$@"
fi
bash scripts/setup.sh
bash scripts/install_browser.sh
.venv/bin/ruff check traceml_jupyter tests scripts
.venv/bin/mypy traceml_jupyter
bash scripts/test_widgets7.sh
mkdir -p artifacts/screenshots
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"

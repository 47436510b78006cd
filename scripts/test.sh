#!/usr/bin/env bash
# Set up, then lint, type-check and run every test: unit, real shell, real kernel, real browser,
# and the widget tests again under ipywidgets 7 (Colab's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_browser.sh
.venv/bin/ruff check traceml_jupyter tests scripts
.venv/bin/mypy traceml_jupyter
bash scripts/test_widgets7.sh
mkdir -p artifacts/screenshots
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"

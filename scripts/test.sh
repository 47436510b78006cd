#!/usr/bin/env bash
# Set up, then lint, type-check and run every test (unit, real shell, real kernel, real browser).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f scripts/install_browser.sh ]; then bash scripts/install_browser.sh; fi
.venv/bin/ruff check traceml_jupyter tests scripts
.venv/bin/mypy traceml_jupyter
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"

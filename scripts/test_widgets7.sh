#!/usr/bin/env bash
# The widget tests again under ipywidgets 7.x (what Colab ships), in a venv of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-w7/bin/python ] || python3 -m venv .venv-w7
.venv-w7/bin/python -m pip install -q --disable-pip-version-check \
    "torch==2.13.0" "ipywidgets>=7.7,<8" bqplot ipython pytest numpy nvidia-ml-py
.venv-w7/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
.venv-w7/bin/python -c "import ipywidgets, bqplot; print('ipywidgets', ipywidgets.__version__, '| bqplot', bqplot.__version__)"
.venv-w7/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_live_view.py tests/test_nvml.py tests/test_environment.py

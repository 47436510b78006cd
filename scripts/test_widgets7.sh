#!/usr/bin/env bash
# The package as others get it, and the widget tests again under ipywidgets 7.x (what Colab ships):
# build the sdist and the wheel, check what they hold, install the wheel (with its own
# dependencies, torch pinned) into a venv of its own beside ipywidgets 7, and smoke-test it there
# from outside the checkout: %load_ext, one traced cell, a child through the installed command.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist
mkdir -p artifacts
# Without isolation: .venv holds the backend (setuptools, the test extra). Its log on failure only.
.venv/bin/python -m build --no-isolation --outdir dist . >artifacts/build.log 2>&1 || {
    cat artifacts/build.log; exit 1; }
.venv/bin/python scripts/check_wheel.py contents dist
[ -x .venv-w7/bin/python ] || python3 -m venv .venv-w7
.venv-w7/bin/python -m pip uninstall -q -y traceml-jupyter 2>/dev/null || true  # an older install
.venv-w7/bin/python -m pip install -q --disable-pip-version-check \
    "torch==2.13.0" "ipywidgets>=7.7,<8" bqplot ipython pytest dist/traceml_jupyter-*.whl
.venv-w7/bin/python -c "import ipywidgets, bqplot; print('ipywidgets', ipywidgets.__version__, '| bqplot', bqplot.__version__)"
outside="$(mktemp -d)"
(cd "$outside" && "$OLDPWD/.venv-w7/bin/python" "$OLDPWD/scripts/check_wheel.py" smoke) || { rm -rf "$outside"; exit 1; }
rm -rf "$outside"
# The tests import the checkout (python -m pytest puts it first on sys.path), the same code.
.venv-w7/bin/python -m pytest -q -p no:cacheprovider \
    tests/unit/views/test_live_view.py tests/unit/capture/resources/test_nvml.py tests/unit/views/test_environment.py

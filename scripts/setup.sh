#!/usr/bin/env bash
# Create .venv with the CPU build of torch, the package and its test dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned in the same command so pip never reaches for a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null

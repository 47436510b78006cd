#!/usr/bin/env bash
# The main job: set up, then run the demo notebook headless in a real kernel and print its verdicts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/run_demo.py "$@"

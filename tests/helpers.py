"""What several test files share, besides the fixtures in conftest.py: the paths tests reach
(importable from any folder under tests/: pyproject's pytest `pythonpath` puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: child_scripts/, ranks_scripts/, data/
REPO = TESTS.parent  # the checkout: traceml_jupyter/, scripts/, docs/, notebooks/

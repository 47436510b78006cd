"""The benchmarks are scripts that print tables (run_all.py runs them all), not tests:
pytest collects nothing here."""

collect_ignore_glob = ["*.py"]

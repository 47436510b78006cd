"""The shapes of what a run measures, declared once: the capture builds them, the result keeps
them, the analysis and the views read them, so mypy --strict checks the same field names from
the watch to the report. Under every layer: TypedDicts only, importing nothing of the package."""

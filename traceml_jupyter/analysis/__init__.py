"""Analysis: pure functions from what a run recorded to numbers and words. Summaries, verdicts
(one process and several ranks), checklist rules, comparisons, tune's arithmetic, the text box.
No I/O, no widgets, no IPython: unit-testable with synthetic columns."""

"""The steps as recorded: the step model that turns the training's events into steps online
(step_model), the per-step path's raw stamps and their replay into it (stamps), the per-step
columns in bounded memory (recorder), and per-step sums of what is measured inside steps
(step_tally). Timestamps only: no torch, no GPU, no loader; imports nothing else of the capture."""
